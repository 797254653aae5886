"""The backward's W and Ũ from the T the forward kept (``triton_backend.SAVE_FOR_BACKWARD =
"t"``): W = T diag(aΓ) K and Ũ = T diag(b) V, (4) of docs/design.md §3, without the prepare's
K Kᵀ and solve. The prepare's own lines (prepare.py: ``half_strengths``, ``store_w``,
``u_left``, ``u_right``, ``halves_product``: its roundings), so the rebuilt W, Ũ are the
recomputing backward's bit for bit and the gradients of "t" are those of "none".

One program per chunk and head writes both W and Ũ, as fla's recompute_w_u does, and holds
nothing else (issue 32, session 20). Until then the prepare kernel rebuilt them under a
``T_GIVEN`` flag, carrying the prepare's registers (170 a thread at 4 warps, AOT sm_90: three
programs an SM): 0.50 ms at (16, 2048, 32, 64) bf16 on the H200 against fla's 0.17 (call 1);
this kernel 0.23 ms, and 0.21 against 0.37 at (8, 4096, 16, 128) (call 2; benchmarks/NOTES.md).
Its programs are short, so how many an SM holds decides the time. Given ``p``
(``dstates.DSTATES_P``, off) it also writes scale·P of the chunk for the split reverse pass,
last, with the prepare's lines (``prepare.store_p``).

A value tile with a row that is not finite has that row zeroed before its product, as the
prepare does when the tile's Ũ is not finite (the same product where every row is finite: a
non-finite row always makes Ũ non-finite, T's diagonal being 1); the kept ``first_bad`` already
counts it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import prepare
from deltaflow.ops.triton.common import (
    CHUNK,
    HALF,
    ChunkTables,
    chunk_bounds,
    dot_precision,
    load_rows,
    store_rows,
)
from deltaflow.ops.triton.prepare import (
    half_strengths,
    halves_product,
    store_p,
    store_w,
    u_left,
    u_right,
)

# Warps and register cap (0: none). Measured (H200, session 20 call 2, bf16, forward + backward,
# 8 against 4 warps; 45-61 registers a thread against 84-118, AOT): (8, 4096, 16, 128) 3.286 →
# 3.263 ms, (1, 32768, 16, 128) 5.091 → 5.075, (16, 2048, 32, 64) 3.187 → 3.155, (8, 2048, 32,
# 256) 11.099 → 11.067.
REBUILD_WARPS = 8
REBUILD_MAXNREG = 0


@triton.jit(do_not_specialize=["rule", "neg"])  # every rule: one compiled kernel (rules.py)
def chunk_rebuild_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    w_ptr,
    u_ptr,
    p_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    eps,
    scale,
    rule,
    neg,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    TILE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
    LOW_PRECISION_DOTS: tl.constexpr,
    FOLD: tl.constexpr,
    STORE_P: tl.constexpr,
):
    """W and Ũ of chunk program_id(0), head program_id(1), from its kept T; with STORE_P also
    scale·P for the split reverse pass (dstates.DSTATES_P; prepare.store_p)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    half = tl.arange(0, HALF)
    offs1 = t0 + half  # the prepare's row halves; T's blocks [T11 0; T21 T22]
    offs2 = offs1 + HALF
    mask1 = offs1 < eos
    mask2 = offs2 < eos
    cols = tl.arange(0, TILE)
    DT: tl.constexpr = k_ptr.dtype.element_ty if LOW_PRECISION_DOTS else tl.float32
    # T first: its loads are in flight while λ is summed
    t_base = t_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK) + half[:, None] * CHUNK
    T11 = tl.load(t_base + half[None, :])
    T21 = tl.load(t_base + HALF * CHUNK + half[None, :])
    T22 = tl.load(t_base + HALF * CHUNK + HALF + half[None, :])
    lam1 = tl.zeros([HALF], dtype=tl.float32)
    lam2 = tl.zeros([HALF], dtype=tl.float32)
    for c in range(0, Dk, TILE):  # as the prepare sums them
        k1 = load_rows(k_ptr, offs1, mask1, i_h, c + cols, c + cols < Dk, H, Dk)
        k2 = load_rows(k_ptr, offs2, mask2, i_h, c + cols, c + cols < Dk, H, Dk)
        lam1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), axis=1)
        lam2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), axis=1)
    a1, b1, ok1, g1, a2, b2, ok2, g2 = half_strengths(
        lam1, lam2, beta_ptr, g_ptr, offs1, offs2, mask1, mask2, i_h, eps, rule, neg, H,
        HAS_BETA, HAS_DECAY,
    )  # fmt: skip
    # the keys again (from L1/L2)
    L11, L21, L22 = store_w(
        T11, T21, T22, a1, a2, g1, g2, ok1, ok2, k_ptr, w_ptr, offs1, offs2, mask1, mask2, i_h,
        H, Dk, TILE, FOLD, PREC, DT,
    )  # fmt: skip
    L11, L21, L22 = u_left(T11, T21, T22, L11, L21, L22, b1, b2, FOLD, DT)
    for c in range(0, Dv, TILE):
        v1 = load_rows(v_ptr, offs1, mask1, i_h, c + cols, c + cols < Dv, H, Dv).to(tl.float32)
        v2 = load_rows(v_ptr, offs2, mask2, i_h, c + cols, c + cols < Dv, H, Dv).to(tl.float32)
        finite1 = tl.sum(tl.where(v1 * 0.0 == 0.0, 0, 1), axis=1) == 0
        finite2 = tl.sum(tl.where(v2 * 0.0 == 0.0, 0, 1), axis=1) == 0
        y1 = tl.where(finite1[:, None], u_right(v1, b1, FOLD), 0.0)
        y2 = tl.where(finite2[:, None], u_right(v2, b2, FOLD), 0.0)
        u1, u2 = halves_product(L11, L21, L22, y1, y2, PREC, DT)
        store_rows(u_ptr, u1, offs1, mask1, i_h, c + cols, c + cols < Dv, H, Dv)
        store_rows(u_ptr, u2, offs2, mask2, i_h, c + cols, c + cols < Dv, H, Dv)
    if STORE_P:  # last, as the prepare's: the keys again (L2) beside the queries
        offs_t = t0 + tl.arange(0, CHUNK)
        store_p(q_ptr, k_ptr, g_ptr, p_ptr, scale, i_c, i_h, offs_t, offs_t < eos, H, Dk, TILE,
                HAS_DECAY, PREC)  # fmt: skip


def launch_rebuild(
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    tables: ChunkTables,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    t: Tensor,
    w: Tensor,
    u: Tensor,
    q: Tensor | None = None,
    p: Tensor | None = None,
    scale: float = 1.0,
) -> None:
    """Fill ``w`` and ``u`` from ``t`` as prepare.launch_prepare stored it (the forward's, kept;
    the kept ``first_bad`` already counts the rows this zeroes): the backward's prepare without
    K Kᵀ and the solve, the same W and Ũ (the same lines and roundings on the same T). Given
    ``p``, also ``scale``·P from ``q`` and k into it ([chunks, H, CHUNK, CHUNK], k's dtype)."""
    if p is not None and q is None:
        raise ValueError("launch_rebuild: p needs q (P = Q Kᵀ ⊙ D needs the queries)")
    if tables.n_chunks == 0:
        return
    H, Dk, Dv = k.shape[2], k.shape[3], v.shape[3]
    settings = prepare.backward_settings(k.dtype, t_kept=True)
    chunk_rebuild_kernel[(tables.n_chunks, H)](
        q_ptr=k if p is None else q,  # read only with p (STORE_P)
        k_ptr=k,
        v_ptr=v,
        beta_ptr=k if beta is None else beta,  # absent pointers are never read: flags say so
        g_ptr=k if log_decay is None else log_decay,
        t_ptr=t,
        w_ptr=w,
        u_ptr=u,
        p_ptr=tables.placeholder if p is None else p,
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_indices_ptr=tables.chunk_indices,
        eps=eps,
        scale=scale,
        rule=kernel_id,
        neg=int(negative_eigenvalues),
        H=H,
        Dk=Dk,
        Dv=Dv,
        TILE=prepare.tile(k, v),
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        PREC=dot_precision(k.dtype),
        LOW_PRECISION_DOTS=settings["LOW_PRECISION_DOTS"],
        FOLD=settings["FOLD"],
        STORE_P=p is not None,
        num_warps=REBUILD_WARPS,
        **({"maxnreg": REBUILD_MAXNREG} if REBUILD_MAXNREG else {}),
    )
