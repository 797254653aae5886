"""Random inputs for op tests: never zeros, raw keys with varied norms."""

from __future__ import annotations

import torch

from deltaflow.rules import RULES


def normalized_keys(rule: str) -> bool:
    """Rules whose transition is only contractive for ‖k‖²·β ≤ 1 declare L2-normalized keys
    (``StepRule.qk_norm``): test them with keys of norm in (0.3, 1); every other rule (and an
    unregistered name) gets raw keys of very varied norm."""
    return rule in RULES and RULES[rule].qk_norm[1] == "l2"


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
