"""Random inputs for op tests: never zeros, raw keys with varied norms."""

from __future__ import annotations

from collections.abc import Callable

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


def reduce_overhead_grads(T: int) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]]]:
    """A dense bf16 forward + backward of the Triton op on the GPU (B=2, H=2, D=64, ``T``
    tokens) through ``torch.compile(mode="reduce-overhead")``: four steps (warm-up, recording,
    replays), the last step's gradients, and a function that gives eager's on the same inputs
    (called once the caller has checked what the capture left behind)."""
    from deltaflow import delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, D = 2, 2, 64
    q, k = (
        torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(B, T, H, D, device="cuda", generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    log_decay = -torch.rand(B, T, H, device="cuda", generator=g)
    inputs = [x.bfloat16() for x in (q, k, v)] + [beta, log_decay]

    def loss(q, k, v, beta, log_decay):
        o, _ = delta_rule(q, k, v, beta, log_decay=log_decay, backend="triton", check_values=False)
        return o.float().square().sum()

    def grads(fn) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    compiled = torch.compile(loss, mode="reduce-overhead")
    for _ in range(4):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        got = grads(compiled)
    return got, lambda: grads(loss)
