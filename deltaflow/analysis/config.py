"""The stability study's settings (``deltaflow stability``'s flags): :class:`StudyConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaflow.analysis import spectrum


@dataclass
class StudyConfig:
    rules: list[str] = field(default_factory=spectrum.default_rules)  # derived from RULES
    precisions: list[str] = field(
        default_factory=lambda: ["fp32", "bf16", "bf16/fp32", "fp32/bf16", "fp16"]
    )
    steps: int = 10_000
    dk: int = 32
    dv: int = 16
    seeds: int = 3
    keys: list[str] = field(default_factory=lambda: ["unit", "gaussian", "heavy"])
    betas: list[str] = field(default_factory=lambda: ["uniform"])
    negative_eigenvalues: list[bool] = field(default_factory=lambda: [False, True])
    pinned_rules: list[str] = field(default_factory=lambda: ["delta"])
    pinned_keys: list[str] = field(default_factory=lambda: ["unit", "vocab:16", "vocab:1"])
    pinned_betas: list[str] = field(default_factory=lambda: ["near1", "uniform:0.9"])
    pinned_seeds: int = 8
    pinned_steps: int = 30_000
    op_backend: str = "torch"  # backend of the real-op cross-check of experiment B; "none": skip
    eps: float = 1e-6
    seed: int = 0
    device: str = "cpu"
    parts: list[str] = field(default_factory=lambda: ["spectrum", "growth", "discretization"])
    checkpoint: str | None = None
    text: str | None = None
    tokenizer: str = "byte"
    max_tokens: int = 2048
