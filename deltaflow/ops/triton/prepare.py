"""Stage 1, parallel over every chunk and head: the rule's strengths and the UT transform,
(3)–(4) of docs/design.md §3. Forward and backward both start here.

For one chunk of CHUNK tokens: ``a, b`` from ``β`` and ``λ = ‖k‖²`` (the rule table), the
in-chunk decay ``γ``, ``A`` (3), ``T = (I + A)⁻¹`` as one CHUNK × CHUNK matrix, then
``W = T diag(aΓ) K`` and ``Ũ = T diag(b) V`` (4) as plain products, one column tile at a time,
written in k's and v's layout; for the backward also ``T`` itself. And each chunk's first token
with a non-finite input (docs/design.md §8), which the later stages turn into NaN outputs from
that token on. Given a kept ``T`` (``triton_backend.SAVE_FOR_BACKWARD = "t"``), rebuild.py
rebuilds ``W`` and ``Ũ`` from it with this file's jit lines (no ``K Kᵀ``, no solve).

Register budget is the design constraint: a program holds ``T`` and one TILE-wide column block,
never the whole chunk's keys or W (the previous block-substitution form held four sub-blocks of
each and spilled; benchmarks/NOTES.md, issue 30).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import rules as rule_table
from deltaflow.ops.triton.common import (
    CHUNK,
    SUB,
    ChunkTables,
    chunk_bounds,
    chunk_gamma,
    decay_matrix,
    dot_precision,
    head_block,
    load_gates,
    load_rows,
    mm,
    store_rows,
)

# Launch settings (benchmarks/NOTES.md). TILE: head-dimension columns per step of the column
# loops. Low-precision dots: W and Ũ take bf16/fp16 operands (T rounded once) instead of tf32
# (accumulation stays fp32); T itself is always formed in fp32.
PREPARE_WARPS = 4
PREPARE_TILE = 64
PREPARE_LOW_PRECISION_DOTS = True
# A register cap per thread: more programs per SM (0 or None: none).
PREPARE_MAXNREG: int | None = 168
# The diagonal blocks' inverses of bf16/fp16 launches: "pair" (:func:`_mm_t`: ~16 significant
# bits, twice the dot dtype's; T is rounded to it afterwards) or "tf32x3" (fp32-accurate, three
# tf32 products). Pair's m16n8k16 products take half tf32x3's instructions and most of its SHFL /
# SEL layout work: the prepare −0.03 ms at D = 128, −0.07 at D = 64, check_triton's errors
# unchanged (benchmarks/NOTES.md, issue 32 session 30). fp32 launches: always "tf32x3".
PREPARE_DIAG_PRECISION = "pair"
# The forward's W and Ũ from T diag(aΓ) and T diag(b) rounded once, with K and V as loaded (see
# the kernel): the same products with two roundings fewer (aΓK, bV). T's four CHUNK³ products
# (the off-diagonal part) at the inputs' dot precision (common.dot_precision: "tf32" for
# bf16/fp16, truncated on sm_90; "tf32x3" for fp32).
PREPARE_FOLD_STRENGTHS = True
# The backward's prepare (bf16/fp16 inputs) rounds where fla's does: T fp32-accurate, rounded
# once to the dot dtype, and diag(aΓ) K, diag(b) V rounded apart (benchmarks/bf16_floor.py,
# FLOOR: T_W, X, Y). The gradients' bf16 error is then the bf16 floor's, draw for draw: a
# rounding anywhere else (T's truncated tf32 products, the fold) draws the rounding noise anew,
# 0.73-1.7x the floor's over CPU draws (issue 30 item 4, benchmarks/NOTES.md). fp32 inputs:
# the forward's settings (the same compiled kernel).
BACKWARD_T_PRECISION: str | None = "pair"  # None: the inputs' (the forward's)
BACKWARD_FOLD_STRENGTHS = False


def low_precision(dot_dtype: torch.dtype) -> bool:
    """Whether a launch of ``dot_dtype`` takes the low-precision dots, and with them, T stored,
    the backward's roundings (BACKWARD_*): the forward's and the backward's prepare then round W
    and Ũ apart. Otherwise (fp32) both are one compiled kernel, the same W and Ũ."""
    return PREPARE_LOW_PRECISION_DOTS and dot_dtype != torch.float32


def t_dtype(dot_dtype: torch.dtype, *, kept_alone: bool) -> torch.dtype:
    """The dtype T is stored in for the backward. Kept alone (SAVE_FOR_BACKWARD "t", where its
    bytes are the point): the launch's dot dtype where every reader of T rounds it to that
    dtype first (half-precision launches: the unfolded W, Ũ products here, the gradient
    kernels), the same values in half the bytes (fla keeps its A so); fp32 where a reader
    takes T as fp32 (fp32 inputs, products not in low precision, the fold: T diag(aΓ) formed
    before the rounding). The other modes keep fp32, their kernels as the GPU validated them:
    a rounded T there changes the gradient kernels' spills (benchmarks/NOTES.md, "Issue 32,
    session 19"), untimed."""
    low = low_precision(dot_dtype)
    return dot_dtype if kept_alone and low and not BACKWARD_FOLD_STRENGTHS else torch.float32


@triton.jit
def _all_finite(x):
    """Whether every entry of a 2-D block is finite: its sum is NaN or ±inf otherwise (and a
    sum of finite values that overflows only sends the block down the exact, slower path)."""
    return tl.sum(tl.sum(x, axis=1), axis=0) * 0.0 == 0.0


@triton.jit
def _first_bad(finite):
    """Index in the chunk of the first token that is not finite (CHUNK: none)."""
    return tl.min(tl.where(finite, CHUNK, tl.arange(0, CHUNK)), axis=0)


@triton.jit
def chunk_strengths(
    lam, beta_ptr, g_ptr, offs_t, mask_t, i_h, eps, rule, neg, H,
    HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr,
):  # fmt: skip
    """The rule's strengths ``a, b`` of a chunk's tokens from ``λ = ‖k‖²`` (0 past eos and at a
    token that is not finite), which tokens are finite (``ok``: docs/design.md §8: a token whose
    key, β, strengths or log α is not finite, x·0 being NaN unless x is, takes no part in any
    product) and ``γ_i = Σ_{j≤i} log α_j`` over the finite ones. The prepare's and the rebuild's
    (rebuild.py) one copy: the rebuilt W, Ũ must be the prepare's bit for bit."""
    b_beta, b_g = load_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    return gated_strengths(lam, b_beta, b_g, mask_t, eps, rule, neg)


@triton.jit
def gated_strengths(lam, b_beta, b_g, mask_t, eps, rule, neg):
    """:func:`chunk_strengths` from β and log α as loaded (``load_gates``): the prepare loads
    them before its key loop."""
    a, b = rule_table.strengths(b_beta, lam, b_g, eps, rule, neg)
    ok = (lam * 0.0 + a * 0.0 + b * 0.0 + b_g * 0.0) == 0.0
    a = tl.where(ok & mask_t, a, 0.0)
    b = tl.where(ok & mask_t, b, 0.0)
    gamma = tl.cumsum(tl.where(ok, b_g, 0.0), axis=0)
    return a, b, ok, gamma


@triton.jit
def store_w(
    T, a, gamma, ok, k_ptr, w_ptr, offs_t, mask_t, i_h, H,
    Dk: tl.constexpr, TILE: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """(4) W = T diag(aΓ) K, TILE key columns at a time, written in k's layout (a token that is
    not finite zeroed). FOLD: the strengths scale T's columns before its one rounding to DT, so
    K enters the product as loaded (exact); otherwise T and diag(aΓ) K are rounded apart (fla's
    way: benchmarks/bf16_floor.py knobs T_W, X). Returns T rounded to DT (Ũ's left operand
    without the fold). The prepare's and the rebuild's one copy."""
    cols = tl.arange(0, TILE)
    scale, T_dt = w_scale_left(T, a, gamma, FOLD, DT)
    for c in range(0, Dk, TILE):
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dk, H, Dk)
        store_w_tile(T_dt, b_k, scale, ok, c, w_ptr, offs_t, mask_t, i_h, H, Dk, TILE, FOLD,
                     PREC, DT)  # fmt: skip
    return T_dt


@triton.jit
def store_w_tile(
    T_dt, b_k, scale, ok, c, w_ptr, offs_t, mask_t, i_h, H, Dk: tl.constexpr,
    TILE: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """Key columns ``c`` … ``c + TILE`` of W (their keys ``b_k``): :func:`store_w`'s step, and
    the rebuild's where it holds the key tiles (rebuild.py: KEEP_K)."""
    cols = c + tl.arange(0, TILE)
    w = mm(T_dt, w_right(b_k, scale, ok, FOLD), PREC, DT)
    store_rows(w_ptr, w, offs_t, mask_t, i_h, cols, cols < Dk, H, Dk)


@triton.jit
def w_scale_left(T, a, gamma, FOLD: tl.constexpr, DT: tl.constexpr):
    """W's row scale aΓ and its left operand (:func:`w_left`): :func:`store_w`'s, the rebuild's
    and the state pass's one copy (rebuild.py)."""
    scale = a * tl.exp(gamma)
    return scale, w_left(T, scale, FOLD, DT)


@triton.jit
def w_left(T, scale, FOLD: tl.constexpr, DT: tl.constexpr):
    """W = T diag(aΓ) K's left operand (``scale`` = aΓ): T diag(aΓ) rounded once to DT (FOLD; T
    in fp32 then, t_dtype) or T rounded alone."""
    if FOLD:
        return (T * scale[None, :]).to(DT)
    else:
        return T.to(DT)


@triton.jit
def w_right(b_k, scale, ok, FOLD: tl.constexpr):
    """W's right operand for the keys ``b_k`` (any of their columns): K as loaded (FOLD) or
    diag(aΓ) K in fp32, a token that is not finite zeroed."""
    if FOLD:
        return tl.where(ok[:, None], b_k, 0.0)
    else:
        return tl.where(ok[:, None], scale[:, None] * b_k.to(tl.float32), 0.0)


@triton.jit
def u_left(T, T_dt, b, FOLD: tl.constexpr, DT: tl.constexpr):
    """Ũ = T diag(b) V's left operand: T diag(b) rounded once (FOLD), or ``T_dt``, T rounded as
    :func:`store_w` returned it (diag(b) V then rounded apart: Y's rounding alone was the
    H100's D=256 dβ error, issue 30 item 4)."""
    if FOLD:
        return (T * b[None, :]).to(DT)
    else:
        return T_dt


@triton.jit
def u_right(v32, b, FOLD: tl.constexpr):
    """Ũ's right operand for a value tile (fp32): V as loaded (FOLD) or diag(b) V."""
    if FOLD:
        return v32
    else:
        return b[:, None] * v32


@triton.jit
def _stack_inverses(N, PREC: tl.constexpr, PAIR: tl.constexpr):
    """(I + N_b)⁻¹ for a [4, SUB, SUB] stack of strictly lower-triangular blocks at once. N is
    nilpotent (N^SUB = 0), so (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸): six batched
    SUB³ products (PREC as :func:`_mm_t`'s), no serial row-by-row substitution."""
    tl.static_assert(SUB == 16, "the product below has log2(SUB) = 4 factors")
    rows = tl.arange(0, SUB)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)[None, :, :]
    N2 = _mm_t(N, N, PREC, PAIR)
    N4 = _mm_t(N2, N2, PREC, PAIR)
    N8 = _mm_t(N4, N4, PREC, PAIR)
    P = _mm_t(eye - N, eye + N2, PREC, PAIR)
    P = _mm_t(P, eye + N4, PREC, PAIR)
    return _mm_t(P, eye + N8, PREC, PAIR)


@triton.jit
def _mm_t(x, y, PREC: tl.constexpr, PAIR: tl.constexpr):
    """x @ y for fp32 x, y (2-D, or 3-D batches: the diagonal blocks'): a tl.dot at PREC, or
    with PREC = "pair", x and y each as a PAIR (bf16/fp16) hi + lo and three PAIR products
    (lo·lo, 2⁻¹⁶ of the product in bf16, left out): ~16 significant bits, on half-precision
    tensor cores, half tf32x3's time."""
    if PREC == "pair":
        xh = x.to(PAIR)
        yh = y.to(PAIR)
        acc = tl.dot(xh, yh)
        acc = tl.dot(xh, (y - yh.to(tl.float32)).to(PAIR), acc=acc)
        return tl.dot((x - xh.to(tl.float32)).to(PAIR), yh, acc=acc)
    else:
        return tl.dot(x, y, input_precision=PREC)


@triton.jit
def _unit_lower_inverse(A, PREC: tl.constexpr, DIAG_PREC: tl.constexpr, PAIR: tl.constexpr):
    """T = (I + A)⁻¹ for a strictly lower-triangular CHUNK × CHUNK ``A``, in fp32.

    The four SUB × SUB diagonal blocks are inverted by :func:`_stack_inverses` (D = their block
    diagonal); the rest follows from I + A = (I + A_diag)(I + M), M = D·A_below, which is
    strictly block-lower with four blocks, so M⁴ = 0 and T = (I − M + M² − M³)·D,
    evaluated as D − M(D − M(D − M·D)): four CHUNK³ products on the tensor cores (PREC, see
    :func:`_mm_t`)."""
    blocks = tl.arange(0, 4)
    same = blocks[:, None, None, None] == blocks[None, None, :, None]  # [4, 1, 4, 1]
    diag = tl.sum(tl.where(same, tl.reshape(A, [4, SUB, 4, SUB]), 0.0), axis=2)
    D = tl.reshape(
        tl.where(same, _stack_inverses(diag, DIAG_PREC, PAIR)[:, :, None, :], 0.0), [CHUNK, CHUNK]
    )
    rows = tl.arange(0, CHUNK)
    below = (rows[:, None] // SUB) > (rows[None, :] // SUB)
    M = _mm_t(D, tl.where(below, A, 0.0), PREC, PAIR)
    return D - _mm_t(M, D - _mm_t(M, D - _mm_t(M, D, PREC, PAIR), PREC, PAIR), PREC, PAIR)


# store_t, the rule's kernel id and the negative-eigenvalue flag are runtime arguments, not
# compile-time ones: forward and backward, and every rule, share one compiled kernel per head
# size and dtype (check_triton's compile work, benchmarks/NOTES.md issue 30).
@triton.jit(do_not_specialize=["store_t", "rule", "neg"])
def chunk_prepare_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    w_ptr,
    u_ptr,
    t_ptr,
    p_ptr,
    first_bad_ptr,
    chunk_spans_ptr,
    eps,
    rule,
    neg,
    store_t,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    TILE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
    T_PREC: tl.constexpr,
    DIAG_PREC: tl.constexpr,
    LOW_PRECISION_DOTS: tl.constexpr,
    FOLD: tl.constexpr,
    STORE_P: tl.constexpr,
):
    """(3)–(4) for one chunk and head: A, T = (I + A)⁻¹, W = T diag(aΓ) K, Ũ = T diag(b) V.
    Also the chunk's first token with a non-finite input (CHUNK: none), for the later stages,
    and with STORE_P the outputs' (5) P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j} in the dot dtype, for the
    split fused forward (states.SPLIT_FORWARD_P). Chunks on the first grid axis, which takes
    2³¹ − 1 (the others 65535)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    cols = tl.arange(0, TILE)
    # Operand dtype of the W and Ũ products: the inputs' (bf16/fp16) or fp32.
    DT: tl.constexpr = k_ptr.dtype.element_ty if LOW_PRECISION_DOTS else tl.float32

    # β and log α first: in flight while K Kᵀ forms (−0.006 to −0.01 ms beside the pair diagonal)
    b_beta, b_g = load_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    # K Kᵀ and λ = ‖k‖², one column tile at a time (λ over every column: the strengths need it)
    kk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    lam = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, Dk, TILE):
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dk, H, Dk)
        k32 = b_k.to(tl.float32)
        lam += tl.sum(k32 * k32, axis=1)
        kk += tl.dot(b_k.to(DT), tl.trans(b_k.to(DT)), input_precision=PREC)

    # a token that is not finite takes no part in any product; the later stages make the
    # outputs NaN from the chunk's first such token on
    a, b, ok, gamma = gated_strengths(lam, b_beta, b_g, mask_t, eps, rule, neg)
    first_bad = _first_bad(ok)

    # (3) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i (a bad token's row and column are zero)
    pairs = (rows[:, None] > rows[None, :]) & ok[:, None] & ok[None, :]
    A = tl.where(pairs, a[:, None] * decay_matrix(gamma) * kk, 0.0)
    T = _unit_lower_inverse(A, T_PREC, DIAG_PREC, k_ptr.dtype.element_ty)
    # (4) W = T diag(aΓ) K and Ũ = T diag(b) V (FOLD: store_w)
    T_dt = store_w(T, a, gamma, ok, k_ptr, w_ptr, offs_t, mask_t, i_h, H, Dk, TILE, FOLD, PREC, DT)
    # A value tile is checked by the sum of its Ũ tile: only a tile with a non-finite value row
    # (rare) is recomputed with those rows zeroed, lowering first_bad.
    T_dt = u_left(T, T_dt, b, FOLD, DT)
    for c in range(0, Dv, TILE):
        b_v = load_rows(v_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dv, H, Dv)
        v32 = b_v.to(tl.float32)
        y = u_right(v32, b, FOLD)
        u = mm(T_dt, y, PREC, DT)
        if not _all_finite(u):
            finite = tl.sum(tl.where(v32 * 0.0 == 0.0, 0, 1), axis=1) == 0
            u = mm(T_dt, tl.where(finite[:, None], y, 0.0), PREC, DT)
            first_bad = tl.minimum(first_bad, _first_bad(finite))
        store_rows(u_ptr, u, offs_t, mask_t, i_h, c + cols, c + cols < Dv, H, Dv)
    tl.store(first_bad_ptr + i_c * H + i_h, first_bad)

    if store_t != 0:  # T itself ([chunk, head, CHUNK, CHUNK], t_dtype) for the backward
        t_base = t_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK)
        tl.store(t_base + rows[:, None] * CHUNK + rows[None, :], T.to(t_ptr.dtype.element_ty))
    if STORE_P:  # last, where nothing else is live: the keys again (L2) beside the queries
        store_p(q_ptr, k_ptr, g_ptr, p_ptr, 1.0, i_c, i_h, offs_t, mask_t, H, Dk, TILE, HAS_DECAY,
                PREC)  # fmt: skip


@triton.jit
def store_p(
    q_ptr, k_ptr, g_ptr, p_ptr, scale, i_c, i_h, offs_t, mask_t, H: tl.constexpr,
    Dk: tl.constexpr, TILE: tl.constexpr, HAS_DECAY: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """``scale`` times (5)'s P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j} of one chunk and head, as the fused
    forward (scale 1) and the reverse pass (the op's scale) form it (q and k as loaded, γ the
    plain cumulative log α: a non-finite token's poison is theirs to apply), rounded once to
    p's dtype, [chunk, head, CHUNK, CHUNK]. The prepare's and the rebuild's (rebuild.py) one
    copy."""
    rows = tl.arange(0, CHUNK)
    cols = tl.arange(0, TILE)
    qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for c in range(0, Dk, TILE):
        b_q = load_rows(q_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dk, H, Dk)
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, c + cols, c + cols < Dk, H, Dk)
        qk = tl.dot(b_q, tl.trans(b_k), acc=qk, input_precision=PREC)
    gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
    P = scale * tl.where(rows[:, None] >= rows[None, :], qk * decay_matrix(gamma), 0.0)
    p_base = p_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK)
    tl.store(p_base + rows[:, None] * CHUNK + rows[None, :], P.to(p_ptr.dtype.element_ty))


def launch_prepare(
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    tables: ChunkTables,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    w: Tensor,
    u: Tensor,
    t: Tensor | None,
    first_bad: Tensor,
    q: Tensor | None = None,
    p: Tensor | None = None,
) -> None:
    """Fill ``w`` and ``u`` (laid out like k and v), ``first_bad`` ([chunks, H] int32) and, when
    given, ``t`` ([chunks, H, CHUNK, CHUNK] in :func:`t_dtype`) and ``p`` (the outputs' P from
    ``q`` and k, [chunks, H, CHUNK, CHUNK] in k's dtype). Rows past a sequence's end are never
    written nor read. Given ``t``, this is the backward's prepare (its roundings)."""
    if tables.n_chunks == 0:
        return
    H, Dk, Dv = k.shape[2], k.shape[3], v.shape[3]
    settings = backward_settings(k.dtype, t_kept=t is not None)
    if (p is None) != (q is None):
        raise ValueError("launch_prepare: p and q come together (P = Q Kᵀ ⊙ D needs the queries)")
    chunk_prepare_kernel[(tables.n_chunks, H)](
        q_ptr=k if q is None else q,
        k_ptr=k,
        v_ptr=v,
        beta_ptr=k if beta is None else beta,  # absent pointers are never read: flags say so
        g_ptr=k if log_decay is None else log_decay,
        w_ptr=w,
        u_ptr=u,
        t_ptr=tables.placeholder if t is None else t,  # the forward's: fp32 as fp32 inputs' T
        p_ptr=tables.placeholder if p is None else p,
        first_bad_ptr=first_bad,
        chunk_spans_ptr=tables.chunk_spans,
        eps=eps,
        store_t=int(t is not None),
        H=H,
        Dk=Dk,
        Dv=Dv,
        TILE=tile(k, v),
        rule=kernel_id,
        neg=int(negative_eigenvalues),
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        PREC=dot_precision(k.dtype),
        T_PREC=settings["T_PREC"],
        DIAG_PREC=settings["DIAG_PREC"],
        LOW_PRECISION_DOTS=settings["LOW_PRECISION_DOTS"],
        FOLD=settings["FOLD"],
        STORE_P=p is not None,
        num_warps=PREPARE_WARPS,
        **({"maxnreg": PREPARE_MAXNREG} if PREPARE_MAXNREG else {}),  # 0 would reach ptxas
    )


def tile(k: Tensor, v: Tensor) -> int:
    """Head columns per step of the column loops (the rebuild's too)."""
    return min(PREPARE_TILE, head_block(max(k.shape[3], v.shape[3]), k.dtype))


def backward_settings(dtype: torch.dtype, *, t_kept: bool) -> dict[str, bool | str]:
    """The products' settings of a launch over ``dtype`` inputs: the forward's, or, where T is
    stored or given (``t_kept``) in half precision, the backward's (see above). One place for
    the prepare and the rebuild (rebuild.py), whose W and Ũ must round alike."""
    low = low_precision(dtype)
    backward = t_kept and low
    return {
        "LOW_PRECISION_DOTS": low,
        "FOLD": BACKWARD_FOLD_STRENGTHS if backward else PREPARE_FOLD_STRENGTHS,
        "T_PREC": (BACKWARD_T_PRECISION if backward else None) or dot_precision(dtype),
        "DIAG_PREC": PREPARE_DIAG_PRECISION if dtype != torch.float32 else "tf32x3",
    }
