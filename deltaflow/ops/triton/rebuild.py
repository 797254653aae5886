"""The backward's W and Ũ from the T the forward kept (``triton_backend.SAVE_FOR_BACKWARD =
"t"``): W = T diag(aΓ) K and Ũ = T diag(b) V, (4) of docs/design.md §3, without the prepare's
K Kᵀ and solve. The prepare's own lines (prepare.py: ``chunk_strengths``, ``store_w``,
``u_left``, ``u_right``: its roundings), so the rebuilt W, Ũ are the recomputing backward's
bit for bit and the gradients of "t" are those of "none".

One program per chunk and head writes both W and Ũ, as fla's recompute_w_u does, and holds
nothing else (issue 32, session 20). Until then the prepare kernel rebuilt them under a
``T_GIVEN`` flag, carrying the prepare's registers (170 a thread at 4 warps, AOT sm_90: three
programs an SM): 0.50 ms at (16, 2048, 32, 64) bf16 on the H200 against fla's 0.17 (call 1);
this kernel 0.23 ms, and 0.21 against 0.37 at (8, 4096, 16, 128) (call 2; benchmarks/NOTES.md).
Its programs are short, so how many an SM holds decides the time. Given ``p``
(``dstates.DSTATES_P``) it also writes scale·P of the chunk for the split reverse pass,
last, with the prepare's lines (``prepare.store_p``). At key blocks of at most
``states.STATES_REBUILD_MAX_BK`` columns the backward's recomputed state pass runs these lines
itself, a chunk at a time (``rebuilt_w``, ``u_product``), and this kernel does not run.

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
    ChunkTables,
    chunk_bounds,
    dot_precision,
    load_chunk_square,
    load_rows,
    mm,
    store_rows,
)
from deltaflow.ops.triton.prepare import (
    chunk_strengths,
    store_p,
    store_w,
    store_w_tile,
    u_left,
    u_right,
    w_right,
    w_scale_left,
)

# Warps and register cap (0: none). Measured (H200, session 20 call 2, bf16, forward + backward,
# 8 against 4 warps; 45-61 registers a thread against 84-118, AOT): (8, 4096, 16, 128) 3.286 →
# 3.263 ms, (1, 32768, 16, 128) 5.091 → 5.075, (16, 2048, 32, 64) 3.187 → 3.155, (8, 2048, 32,
# 256) 11.099 → 11.067. Session 29 call 3: 1 or 2 stages (Triton's 3 by default), a cap of 48
# registers (five programs an SM instead of four) or both: −0.001 to +0.095 ms on the kernel.
REBUILD_WARPS = 8
# Half-precision launches (the low-precision products) hold their key tiles from λ's sums to
# W's products where the head has at most two column tiles (KEEP_K; wider heads read them again
# from L2), under a cap of REBUILD_MAXNREG registers: four 8-warp programs an SM, as before
# (fla's w_u runs four of 4 warps). H200, bf16, session 29 call 6 (the key tiles read twice:
# 66.5% of DRAM bandwidth against fla's w_u's 78%, call 5): the kernel 0.187 → 0.170 ms at
# (8, 4096, 16, 128) and (1, 32768, 16, 128); 0.502 → 0.485 at (8, 2048, 32, 256) (the cap
# alone there: 72 → 64 registers); held without the cap (72 registers, three an SM) 0.187, at
# 4 warps (112 registers) 0.175 (0.577 at D = 256). Not fp32 (180-250 registers: holding the
# keys takes them to 255 and the cap would spill kilobytes, AOT).
REBUILD_MAXNREG = 64


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
    chunk_spans_ptr,
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
    KEEP_K: tl.constexpr,
):
    """W and Ũ of chunk program_id(0), head program_id(1), from its kept T; with STORE_P also
    scale·P for the split reverse pass (dstates.DSTATES_P; prepare.store_p). KEEP_K (Dk ≤
    2·TILE): the key tiles held from λ to W (see REBUILD_MAXNREG)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    cols = tl.arange(0, TILE)
    DT: tl.constexpr = k_ptr.dtype.element_ty if LOW_PRECISION_DOTS else tl.float32
    # T first: its load is in flight while λ is summed
    t_base = t_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK)
    T = tl.load(t_base + rows[:, None] * CHUNK + rows[None, :])
    lam = tl.zeros([CHUNK], dtype=tl.float32)
    if KEEP_K:  # λ summed as the loop below: tile 0, then tile 1 (the prepare's order)
        k0 = load_rows(k_ptr, offs_t, mask_t, i_h, cols, cols < Dk, H, Dk)
        lam += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), axis=1)
        if Dk > TILE:
            k1 = load_rows(k_ptr, offs_t, mask_t, i_h, TILE + cols, TILE + cols < Dk, H, Dk)
            lam += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), axis=1)
    else:
        for c in range(0, Dk, TILE):
            k32 = load_rows(k_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dk, H, Dk)
            k32 = k32.to(tl.float32)
            lam += tl.sum(k32 * k32, axis=1)
    a, b, ok, gamma = chunk_strengths(
        lam, beta_ptr, g_ptr, offs_t, mask_t, i_h, eps, rule, neg, H, HAS_BETA, HAS_DECAY
    )
    if KEEP_K:  # store_w's steps on the held tiles
        scale_w, T_dt = w_scale_left(T, a, gamma, FOLD, DT)
        store_w_tile(T_dt, k0, scale_w, ok, 0, w_ptr, offs_t, mask_t, i_h, H, Dk, TILE, FOLD,
                     PREC, DT)  # fmt: skip
        if Dk > TILE:
            store_w_tile(T_dt, k1, scale_w, ok, TILE, w_ptr, offs_t, mask_t, i_h, H, Dk, TILE,
                         FOLD, PREC, DT)  # fmt: skip
    else:  # the keys again (from L1/L2)
        T_dt = store_w(T, a, gamma, ok, k_ptr, w_ptr, offs_t, mask_t, i_h, H, Dk, TILE, FOLD,
                       PREC, DT)  # fmt: skip
    T_dt = u_left(T, T_dt, b, FOLD, DT)
    for c in range(0, Dv, TILE):
        v32 = load_rows(v_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dv, H, Dv).to(tl.float32)
        u = u_product(T_dt, v32, b, FOLD, PREC, DT)
        store_rows(u_ptr, u, offs_t, mask_t, i_h, c + cols, c + cols < Dv, H, Dv)
    if STORE_P:  # last, as the prepare's: the keys again (L2) beside the queries
        store_p(q_ptr, k_ptr, g_ptr, p_ptr, scale, i_c, i_h, offs_t, mask_t, H, Dk, TILE,
                HAS_DECAY, PREC)  # fmt: skip


@triton.jit
def u_product(T_u, v32, b, FOLD: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Ũ = T diag(b) V for the value columns of ``v32`` (fp32 as loaded), ``T_u`` Ũ's left
    operand (``u_left``), a row not finite in these columns zeroed first (as the prepare
    recomputes such a tile). The rebuild's and the state pass's one copy."""
    y = u_right(v32, b, FOLD)
    finite = tl.sum(tl.where(v32 * 0.0 == 0.0, 0, 1), axis=1) == 0
    return mm(T_u, tl.where(finite[:, None], y, 0.0), PREC, DT)


@triton.jit
def rebuilt_w(
    t_ptr, b_k, beta_ptr, g_ptr, c, i_h, offs_t, mask_t, eps, rule, neg, H: tl.constexpr,
    HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """For the state pass that rebuilds as it goes (states.rebuilds_w_u): W of chunk ``c``, head
    ``i_h`` from its kept T and its keys ``b_k`` (every key column: λ sums them), rounded to DT
    as the rebuild stores it; with Ũ's left operand and the strengths b for :func:`u_product`.
    The rebuild kernel's lines on the whole key block at once."""
    T = load_chunk_square(t_ptr, c, i_h, H)
    k32 = b_k.to(tl.float32)
    a, b, ok, gamma = chunk_strengths(
        tl.sum(k32 * k32, axis=1), beta_ptr, g_ptr, offs_t, mask_t, i_h, eps, rule, neg, H,
        HAS_BETA, HAS_DECAY,
    )  # fmt: skip
    scale, T_dt = w_scale_left(T, a, gamma, FOLD, DT)
    W = mm(T_dt, w_right(b_k, scale, ok, FOLD), PREC, DT).to(DT)
    return W, u_left(T, T_dt, b, FOLD, DT), b


def pass_args(
    t: Tensor | None,
    v: Tensor | None,
    *,
    tables: ChunkTables,
    beta: Tensor | None = None,
    log_decay: Tensor | None = None,
    kernel_id: int = 0,
    negative_eigenvalues: bool = False,
    eps: float = 0.0,
) -> dict:
    """The state pass's arguments for W and Ũ formed in the pass from the kept ``t`` and ``v``
    (states.rebuilds_w_u) and the rule (launch_rebuild's keywords; ``log_decay`` is the pass's
    own argument already), or, ``t`` None, for reading the rebuild's (placeholders, FROM_T
    off)."""
    ph = tables.placeholder
    fold = v is not None and prepare.backward_settings(v.dtype, t_kept=True)["FOLD"]
    return dict(
        t_ptr=ph if t is None else t,
        v_ptr=ph if v is None else v,
        beta_ptr=ph if beta is None else beta,
        eps=eps,
        rule=kernel_id,
        neg=int(negative_eigenvalues),
        HAS_BETA=beta is not None,
        FOLD=bool(fold),
        FROM_T=t is not None,
    )


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
    half = settings["LOW_PRECISION_DOTS"]  # the held keys and the cap (REBUILD_MAXNREG)
    cap = {"maxnreg": REBUILD_MAXNREG} if half and REBUILD_MAXNREG else {}
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
        chunk_spans_ptr=tables.chunk_spans,
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
        KEEP_K=half and Dk <= 2 * prepare.tile(k, v),
        num_warps=REBUILD_WARPS,
        **cap,
    )
