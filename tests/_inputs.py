"""Random inputs for op tests: never zeros, raw keys with varied norms."""

from __future__ import annotations

import torch

from deltaflow.rules import RULES


def normalized_keys(rule: str) -> bool:
    """Rules whose transition is only contractive for ‖k‖²·β ≤ 1 declare L2-normalized keys
    (``StepRule.qk_norm``): test them with keys of norm in (0.3, 1); every other rule (and an
    unregistered name) gets raw keys of very varied norm."""
    return rule in RULES and RULES[rule].qk_norm[1] == "l2"


def reads_decay(rule: str) -> bool:
    """Rules whose strengths read the decay (``gated_efla``): refused without one."""
    return RULES[rule].decay_coefficients is not None


def rule_variants() -> list[dict]:
    """One layer (or model) config per rule of ``RULES``, every rule included: the rules without
    a decay of their own in RULES's order, a decay on every other one; then the rules that read
    the decay, with it (the op and the layer refuse them without)."""
    plain = [r for r in RULES if not reads_decay(r)]
    variants = [dict(rule=r, use_decay=i % 2 == 1) for i, r in enumerate(plain)]
    return variants + [dict(rule=r, use_decay=True) for r in RULES if reads_decay(r)]


def make_inputs(
    B: int,
    T: int,
    H: int,
    Dk: int,
    Dv: int,
    *,
    rule: str = "delta",
    dtype: torch.dtype = torch.float64,
    decay: bool = True,
    initial_state: bool = True,
    n_states: int | None = None,
    seed: int = 0,
) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    k = randn(B, T, H, Dk)
    if normalized_keys(rule):
        k = k / k.norm(dim=-1, keepdim=True) * (0.3 + 0.7 * rand(B, T, H, 1))
    else:
        k = k * (0.05 + 2.0 * rand(B, T, H, 1))  # ‖k‖ from ~0.1 to ~2·√Dk
    out = {
        "q": randn(B, T, H, Dk).to(dtype),
        "k": k.to(dtype),
        "v": randn(B, T, H, Dv).to(dtype),
        "beta": (0.05 + 0.95 * rand(B, T, H)).to(dtype),
        "log_decay": (-0.5 * rand(B, T, H)).to(dtype) if decay else None,
        "initial_state": randn(n_states or B, H, Dk, Dv).to(dtype) if initial_state else None,
    }
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
