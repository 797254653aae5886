"""Decode: apply a few tokens to a recurrent state in place (generation)."""

from __future__ import annotations

import torch
from torch import Tensor

from deltaflow.ops.naive import recurrent_delta_rule
from deltaflow.rules import CoefficientFn, StepRule, get_rule


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    state: Tensor,
    *,
    rule: str | StepRule | CoefficientFn = "delta",
    log_decay: Tensor | None = None,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
) -> Tensor:
    """Apply ``T`` (usually 1) tokens to ``state [B, H, Dk, Dv]`` in place; return ``o``.

    Shapes as in :func:`deltaflow.delta_rule` with small T. ``state`` must be float32 (float64
    allowed for exact checks) and is updated in place, so a decode loop keeps one buffer and
    never synchronizes with the host (no value checks here, only shape checks).
    """
    step_rule = get_rule(rule)
    if not isinstance(state, Tensor) or state.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            "state must be a float32 (or float64) tensor [B, H, Dk, Dv] updated "
            f"in place, got {getattr(state, 'dtype', type(state).__name__)}"
        )
    _check_step_shapes(q, k, v, beta, step_rule, log_decay, state)
    step_rule.check_decay(log_decay is not None, "give log_decay")  # as delta_rule does
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    if q.is_cuda and step_rule.has_triton:
        from deltaflow.ops.delta_rule import _triton_backend

        triton_backend = _triton_backend()
        if triton_backend is not None:
            return triton_backend.delta_rule_step(
                q,
                k,
                v,
                beta,
                state,
                rule=step_rule,
                log_decay=log_decay,
                negative_eigenvalues=negative_eigenvalues,
                eps=eps,
                scale=scale,
            )

    # Elsewhere: the reference recurrence from this state, written back in place (in the
    # state's dtype under an autocast too, as delta_rule's torch backends).
    with torch.autocast(q.device.type, enabled=False):
        o, new_state = recurrent_delta_rule(
            q,
            k,
            v,
            beta,
            step_rule,
            log_decay,
            negative_eigenvalues,
            eps,
            scale,
            state,
            state.dtype,
        )
    with torch.no_grad():
        state.copy_(new_state)
    return o.to(v.dtype)


def _check_step_shapes(q, k, v, beta, rule, log_decay, state) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a tensor of shape [B, T, H, D], got "
                f"{getattr(t, 'shape', type(t).__name__)}"
            )
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"k must match q {list(q.shape)} and v must be [B, T, H, Dv], got "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if beta is None and rule.needs_beta:
        raise ValueError(f"beta is None but rule {rule.name!r} needs beta of shape [B, T, H]")
    for name, t in (("beta", beta), ("log_decay", log_decay)):
        if t is not None and tuple(t.shape) != (B, T, H):
            raise ValueError(
                f"{name} must have shape [B, T, H] = [{B}, {T}, {H}], got {list(t.shape)}"
            )
    if tuple(state.shape) != (B, H, Dk, Dv):
        raise ValueError(
            f"state must have shape [B, H, Dk, Dv] = [{B}, {H}, {Dk}, {Dv}], "
            f"got {list(state.shape)}"
        )
