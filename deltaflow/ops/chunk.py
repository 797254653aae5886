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
    return x.movedim(3, 1).contiguous()  # one copy here instead of one per matmul


def unit_lower_inverse(A: Tensor) -> Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two).

    The recursion of LAPACK's trtri, batched: from 1×1 diagonal blocks up, two inverted blocks
    merge as ``[[X1, 0], [L21, X2]]^{-1} = [[X1⁻¹, 0], [−X2⁻¹ L21 X1⁻¹, X2⁻¹]]``. Exact (no
    series), a handful of batched matmuls, and much faster on CPU than a batched triangular solve.
    """
    C = A.shape[-1]
    lead = A.shape[:-2]
    X = torch.ones(*lead, C, 1, 1, dtype=A.dtype, device=A.device)  # inverted 1×1 blocks
    b = 1
    while b < C:
        n = C // (2 * b)
        blocks = A.reshape(*lead, n, 2 * b, n, 2 * b)
        blocks = torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)  # 2b×2b diagonal blocks
        X1, X2 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        lower = -(X2 @ blocks[..., b:, :b] @ X1)
        X = torch.cat([torch.cat([X1, torch.zeros_like(X1)], -1), torch.cat([lower, X2], -1)], -2)
        b *= 2
    return X.squeeze(-3)


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
    Gamma = torch.exp(gamma)  # Γ_i = e^{γ_i}
    # W = T diag(aΓ) K,  Ũ = T diag(b) V   (all chunks at once)
    T_inv = unit_lower_inverse(A)
    W = T_inv @ ((a * Gamma)[..., None] * k)
    U_tilde = T_inv @ (b[..., None] * v)
    # Kᵀ diag(e^{γ_C − γ_j}): token j's key, weighted by how much of its write survives to
    # the chunk's end, laid out for the state update (6).
    k_to_end = (k * torch.exp(gamma[..., -1:] - gamma)[..., None]).mT.contiguous()
    Gamma_C = Gamma[..., -1, None, None]  # [B, H, N, 1, 1]

    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state
    states, updates = [], []
    for n in range(N):  # the only sequential part: one state update per chunk
        U = U_tilde[:, :, n] - W[:, :, n] @ S  # U = Ũ − W S_0
        states.append(S)
        updates.append(U)
        # S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        S = Gamma_C[:, :, n] * S + k_to_end[:, :, n] @ U
    S0 = torch.stack(states, dim=2)  # state entering each chunk, [B, H, N, Dk, Dv]
    U = torch.stack(updates, dim=2)  # [B, H, N, C, Dv]

    # O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
    o = Gamma[..., None] * (q @ S0) + ((q @ k.transpose(-1, -2)) * decay) @ U
    o = (scale * o).movedim(1, 3).reshape(B, N * C, H, Dv)[:, :T]
    return o, S
