"""The reference backend: the recurrence of docs/design.md §1, one token at a time.

This is the ground truth every other backend is tested against. It is slow on purpose: each
line is one equation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaflow.rules import StepRule, step_coefficients


def recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    rule: StepRule,
    log_decay: Tensor | None,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    initial_state: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """One batch of equal-length sequences. Returns ``o [B,T,H,Dv]`` and ``S [B,H,Dk,Dv]``."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    beta = None if beta is None else beta.to(dtype)
    lam = (k * k).sum(-1)  # λ_t = ‖k_t‖², [B, T, H]
    a, b = step_coefficients(rule, beta, lam, negative_eigenvalues=negative_eigenvalues, eps=eps)
    alpha = torch.ones_like(lam) if log_decay is None else torch.exp(log_decay.to(dtype))

    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, t], v[:, t], q[:, t]  # [B, H, D]
        a_t, b_t, alpha_t = a[:, t, :, None], b[:, t, :, None], alpha[:, t, :, None, None]
        kS = torch.einsum("bhk,bhkv->bhv", k_t, S)  # prediction for k_t: kᵀS
        # S_t = α_t (I − a_t k kᵀ) S_{t−1} + b_t k vᵀ    (docs/design.md §1)
        S = alpha_t * (S - torch.einsum("bhk,bhv->bhkv", k_t, a_t * kS)) + torch.einsum(
            "bhk,bhv->bhkv", k_t, b_t * v_t
        )
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q_t))  # o_t = scale·S_tᵀq_t
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, Dv)
    return o, S
