"""The chunked PyTorch backend: DESIGN.md §3 (UT transform with separate erase/write strengths).

Inside a chunk of ``C`` tokens every token writes ``S_i = α_i S_{i−1} + k_i u_iᵀ``; solving for all
``u_i`` at once is one unit-lower-triangular system, so the only sequential work left is one
state update per chunk. Everything else is batched over batch, heads and chunks.

Inputs arrive with the rule already applied (``a``, ``b``) and padded tokens made identity
steps (``k = v = 0``, ``a = b = 0``, ``log_decay = 0``), so this file knows nothing of rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _to_chunks(x: Tensor, n_chunks: int, chunk_size: int) -> Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...]."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, n_chunks, chunk_size, H, *x.shape[3:])
    return x.movedim(3, 1)


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor | None,
    scale: float,
    initial_state: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """All inputs in the compute dtype. Returns ``o [B,T,H,Dv]`` and the final state."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    if log_decay is None:
        log_decay = torch.zeros_like(a)
    pad = (-T) % C
    if pad:  # identity steps at the end: k = v = 0, a = b = 0, α = 1
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        a, b, log_decay = (F.pad(x, (0, 0, 0, pad)) for x in (a, b, log_decay))
    N = (T + pad) // C
    q, k, v = (_to_chunks(x, N, C) for x in (q, k, v))  # [B, H, N, C, D]
    a, b, log_decay = (_to_chunks(x, N, C) for x in (a, b, log_decay))  # [B, H, N, C]

    gamma = log_decay.cumsum(-1)  # γ_i = Σ_{j≤i} log α_j
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # j < i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j ≤ i
    # e^{γ_i − γ_j} for j ≤ i, formed from the difference (never Γ_i / Γ_j), 0 above the diagonal.
    decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf))

    # A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i;  T = (I + A)^{-1}
    A = (a[..., :, None] * decay * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    Gamma = torch.exp(gamma)  # Γ_i = e^{γ_i}
    # W = T diag(aΓ) K,  Ũ = T diag(b) V   (one triangular solve each, all chunks at once)
    W = torch.linalg.solve_triangular(
        A + eye, (a * Gamma)[..., None] * k, upper=False, unitriangular=True
    )
    U_tilde = torch.linalg.solve_triangular(
        A + eye, b[..., None] * v, upper=False, unitriangular=True
    )
    # e^{γ_C − γ_j}: how much of token j's write survives to the chunk's end.
    to_end = torch.exp(gamma[..., -1:] - gamma)

    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state
    states, updates = [], []
    for n in range(N):  # the only sequential part: one state update per chunk
        U = U_tilde[:, :, n] - W[:, :, n] @ S  # U = Ũ − W S_0
        states.append(S)
        updates.append(U)
        # S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        S = Gamma[:, :, n, -1, None, None] * S + (k[:, :, n] * to_end[:, :, n, :, None]).mT @ U
    S0 = torch.stack(states, dim=2)  # state entering each chunk, [B, H, N, Dk, Dv]
    U = torch.stack(updates, dim=2)  # [B, H, N, C, Dv]

    # O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
    o = Gamma[..., None] * (q @ S0) + ((q @ k.transpose(-1, -2)) * decay) @ U
    o = (scale * o).movedim(1, 3).reshape(B, N * C, H, Dv)[:, :T]
    return o, S
