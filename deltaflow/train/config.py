"""Training configuration: one flat dataclass, loadable from YAML, overridable from the CLI.

A config names a task (``deltaflow.tasks.get_task(task, **task_kwargs)``) and a model
(``DeltaFlowConfig(vocab_size=task.vocab_size, **model)``); everything else is optimization,
evaluation and I/O. ``batch_size`` is the GLOBAL batch (summed over data-parallel ranks and
gradient-accumulation micro-steps), so a run gives the same result on 1 or 8 GPUs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class TrainConfig:
    # --- what to train
    task: str = "mqar"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)  # DeltaFlowConfig kwargs minus vocab_size
    # --- optimization
    steps: int = 1000
    batch_size: int = 64  # global: all ranks x all accumulation micro-steps
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_steps: int | None = None  # None: 5% of steps
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to norms, biases, embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    # --- evaluation
    eval_every: int = 0  # 0: evaluate only at the end
    eval_split: str = "valid"
    eval_lengths: list[int] | None = None  # None: task.eval_lengths if it has one, else its seq_len
    eval_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. num_examples, batch_size
    # --- I/O and runtime
    out_dir: str | None = None  # None: no logs, no checkpoints (quick experiments, tests)
    log_every: int = 10
    ckpt_every: int = 0  # 0: no step-based checkpoints (ckpt_minutes still applies)
    # wall-clock minutes between checkpoints (at log steps), so a killed run loses minutes,
    # not the run; 0 disables. Both kinds may be on; the end, Ctrl-C and SIGTERM always save.
    ckpt_minutes: float = 10.0
    keep_checkpoints: int = 2
    resume: bool = True  # continue from out_dir's latest checkpoint when there is one
    seed: int = 0
    device: str = "auto"  # auto: cuda:LOCAL_RANK if available, else cpu
    precision: str = "auto"  # auto: bf16 autocast on cuda, fp32 on cpu; or 'bf16' | 'fp32'
    progress: bool = True  # tqdm bar (rank 0 only)
    # Under torchrun: 'ddp' replicates the model; 'fsdp' shards it (FSDP2) and writes sharded
    # checkpoints that resume on any number of GPUs.
    parallel: str = "ddp"
    # torch.compile each model block (fused glue, selective activation checkpointing): 'auto'
    # compiles on CUDA, where it is faster (benchmarks/NOTES.md), not on CPU; 'blocks' | 'off'.
    compile: str = "auto"

    def __post_init__(self) -> None:
        # YAML 1.1 reads "3e-4" (no dot) as a string: accept numeric strings for float fields.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str | int) and not isinstance(value, bool):
                try:
                    setattr(self, name, float(value))
                except ValueError:
                    raise ValueError(f"{name} must be a number, got {value!r}") from None
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints"):
            positive(name)
        for name in ("eval_every", "ckpt_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.ckpt_minutes >= 0:
            raise ValueError(f"ckpt_minutes must be >= 0 (0: off), got {self.ckpt_minutes}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1, beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.compile not in ("auto", "blocks", "off"):
            raise ValueError(f"compile must be 'auto', 'blocks' or 'off', got {self.compile!r}")
        for name in ("task_kwargs", "model", "eval_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(
                    f"{name} must be a mapping, got {type(getattr(self, name)).__name__}"
                )
        if "vocab_size" in self.model:
            raise ValueError("model.vocab_size is taken from the task; remove it from the config")
        if self.eval_lengths is not None:
            if not isinstance(self.eval_lengths, list) or not all(
                isinstance(n, int) and n > 0 for n in self.eval_lengths
            ):
                raise ValueError(
                    f"eval_lengths must be a list of positive ints, got {self.eval_lengths!r}"
                )

    @property
    def resolved_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a config file must be a YAML mapping")
        return cls.from_dict(data)

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (nested dicts are copied, not shared)."""
        data = self.to_dict()
        data.update(changes)
        return TrainConfig.from_dict(data)


_FLOAT_FIELDS = (
    "lr",
    "min_lr_ratio",
    "weight_decay",
    "beta1",
    "beta2",
    "adam_eps",
    "grad_clip",
    "ckpt_minutes",
)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``model.key=value`` overrides; values are parsed as YAML scalars.

    ``--set model.rule=efla --set eval_lengths=[64,128]`` reaches any field, nested or not.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value or section.key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        parts = key.strip().split(".")
        if len(parts) == 1:
            out[parts[0]] = value
        elif len(parts) == 2:
            section = out.setdefault(parts[0], {})
            if not isinstance(section, dict):
                raise ValueError(f"override {item!r}: {parts[0]!r} is not a section")
            section[parts[1]] = value
        else:
            raise ValueError(f"override {item!r}: at most one level of nesting (section.key)")
    return out
