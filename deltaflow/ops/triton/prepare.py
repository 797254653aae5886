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
    HALF,
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
# The diagonal blocks' inverses: fp32-accurate products ("ieee" FMA loops or "tf32x3", three
# tensor-core products); their error is T's, which every later stage inherits.
PREPARE_DIAG_PRECISION = "tf32x3"
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
def _first_bad(finite, base):
    """Index in the chunk of the first token that is not finite among a half's rows ``base``,
    ``base + 1``, ... (CHUNK: none)."""
    return tl.min(tl.where(finite, CHUNK, base + tl.arange(0, HALF)), axis=0)


@triton.jit
def chunk_strengths(
    lam, beta_ptr, g_ptr, offs_t, mask_t, i_h, eps, rule, neg, H,
    HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr,
):  # fmt: skip
    """The rule's strengths ``a, b`` of tokens ``offs_t`` from ``λ = ‖k‖²`` (0 past eos and at a
    token that is not finite), which tokens are finite (``ok``: docs/design.md §8: a token whose
    key, β, strengths or log α is not finite, x·0 being NaN unless x is, takes no part in any
    product) and ``γ_i = Σ_{j≤i} log α_j`` over the finite ones."""
    b_beta, b_g = load_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    a, b = rule_table.strengths(b_beta, lam, b_g, eps, rule, neg)
    ok = (lam * 0.0 + a * 0.0 + b * 0.0 + b_g * 0.0) == 0.0
    a = tl.where(ok & mask_t, a, 0.0)
    b = tl.where(ok & mask_t, b, 0.0)
    gamma = tl.cumsum(tl.where(ok, b_g, 0.0), axis=0)
    return a, b, ok, gamma


@triton.jit
def half_strengths(
    lam1, lam2, beta_ptr, g_ptr, offs1, offs2, mask1, mask2, i_h, eps, rule, neg, H,
    HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr,
):  # fmt: skip
    """:func:`chunk_strengths` of the chunk's two halves (rows ``offs1``, ``offs2``), γ of the
    second continuing the first's. The prepare's and the rebuild's (rebuild.py) one copy: the
    rebuilt W, Ũ must be the prepare's bit for bit."""
    a1, b1, ok1, g1 = chunk_strengths(
        lam1, beta_ptr, g_ptr, offs1, mask1, i_h, eps, rule, neg, H, HAS_BETA, HAS_DECAY
    )
    a2, b2, ok2, g2 = chunk_strengths(
        lam2, beta_ptr, g_ptr, offs2, mask2, i_h, eps, rule, neg, H, HAS_BETA, HAS_DECAY
    )
    g2 += tl.sum(tl.where(tl.arange(0, HALF) == HALF - 1, g1, 0.0), axis=0)
    return a1, b1, ok1, g1, a2, b2, ok2, g2


@triton.jit
def halves_product(L11, L21, L22, x1, x2, PREC: tl.constexpr, DT: tl.constexpr):
    """[L11 0; L21 L22] @ [x1; x2] by its three nonzero blocks, operands in DT, accumulated in
    fp32: the row halves (the bottom one L21 x1 first, then + L22 x2)."""
    top = mm(L11, x1, PREC, DT)
    bottom = tl.dot(L22.to(DT), x2.to(DT), acc=mm(L21, x1, PREC, DT), input_precision=PREC)
    return top, bottom


@triton.jit
def store_w(
    T11, T21, T22, a1, a2, g1, g2, ok1, ok2, k_ptr, w_ptr, offs1, offs2, mask1, mask2, i_h, H,
    Dk: tl.constexpr, TILE: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """(4) W = T diag(aΓ) K by row halves (:func:`halves_product`), TILE key columns at a time,
    written in k's layout (a token that is not finite zeroed). FOLD: the strengths scale T's
    columns before its one rounding to DT, so K enters the product as loaded (exact); otherwise
    T and diag(aΓ) K are rounded apart (fla's way: benchmarks/bf16_floor.py knobs T_W, X).
    Returns T's blocks rounded to DT (Ũ's left operands without the fold). The prepare's and the
    rebuild's one copy."""
    cols = tl.arange(0, TILE)
    s1 = a1 * tl.exp(g1)
    s2 = a2 * tl.exp(g2)
    if FOLD:  # T in fp32 here (t_dtype)
        L11 = (T11 * s1[None, :]).to(DT)
        L21 = (T21 * s1[None, :]).to(DT)
        L22 = (T22 * s2[None, :]).to(DT)
    else:
        L11 = T11.to(DT)
        L21 = T21.to(DT)
        L22 = T22.to(DT)
    for c in range(0, Dk, TILE):
        k1 = load_rows(k_ptr, offs1, mask1, i_h, c + cols, c + cols < Dk, H, Dk)
        k2 = load_rows(k_ptr, offs2, mask2, i_h, c + cols, c + cols < Dk, H, Dk)
        if FOLD:
            x1 = tl.where(ok1[:, None], k1, 0.0)
            x2 = tl.where(ok2[:, None], k2, 0.0)
        else:
            x1 = tl.where(ok1[:, None], s1[:, None] * k1.to(tl.float32), 0.0)
            x2 = tl.where(ok2[:, None], s2[:, None] * k2.to(tl.float32), 0.0)
        w1, w2 = halves_product(L11, L21, L22, x1, x2, PREC, DT)
        store_rows(w_ptr, w1, offs1, mask1, i_h, c + cols, c + cols < Dk, H, Dk)
        store_rows(w_ptr, w2, offs2, mask2, i_h, c + cols, c + cols < Dk, H, Dk)
    return L11, L21, L22


@triton.jit
def u_left(T11, T21, T22, L11, L21, L22, b1, b2, FOLD: tl.constexpr, DT: tl.constexpr):
    """Ũ = T diag(b) V's left operand's blocks: T diag(b) rounded once (FOLD), or ``L``, T
    rounded as :func:`store_w` returned it (diag(b) V then rounded apart: Y's rounding alone
    was the H100's D=256 dβ error, issue 30 item 4)."""
    if FOLD:
        return (T11 * b1[None, :]).to(DT), (T21 * b1[None, :]).to(DT), (T22 * b2[None, :]).to(DT)
    else:
        return L11, L21, L22


@triton.jit
def u_right(v32, b, FOLD: tl.constexpr):
    """Ũ's right operand for a value tile (fp32): V as loaded (FOLD) or diag(b) V."""
    if FOLD:
        return v32
    else:
        return b[:, None] * v32


@triton.jit
def _stack_inverses(N, PREC: tl.constexpr):
    """(I + N_b)⁻¹ for a [n, SUB, SUB] stack of strictly lower-triangular blocks at once. N is
    nilpotent (N^SUB = 0), so (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸): six batched
    SUB³ products (PREC: fp32-accurate, "ieee" or "tf32x3"), no serial row-by-row substitution."""
    tl.static_assert(SUB == 16, "the product below has log2(SUB) = 4 factors")
    rows = tl.arange(0, SUB)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)[None, :, :]
    N2 = tl.dot(N, N, input_precision=PREC)
    N4 = tl.dot(N2, N2, input_precision=PREC)
    N8 = tl.dot(N4, N4, input_precision=PREC)
    P = tl.dot(eye - N, eye + N2, input_precision=PREC)
    P = tl.dot(P, eye + N4, input_precision=PREC)
    return tl.dot(P, eye + N8, input_precision=PREC)


@triton.jit
def _mm_t(x, y, PREC: tl.constexpr, PAIR: tl.constexpr):
    """x @ y for fp32 x, y: a tl.dot at PREC, or with PREC = "pair", x and y each as a PAIR
    (bf16/fp16) hi + lo and three PAIR products (lo·lo, 2⁻¹⁶ of the product in bf16, left out):
    ~16 significant bits, on half-precision tensor cores, half tf32x3's time."""
    if PREC == "pair":
        xh = x.to(PAIR)
        yh = y.to(PAIR)
        acc = tl.dot(xh, yh)
        acc = tl.dot(xh, (y - yh.to(tl.float32)).to(PAIR), acc=acc)
        return tl.dot((x - xh.to(tl.float32)).to(PAIR), yh, acc=acc)
    else:
        return tl.dot(x, y, input_precision=PREC)


@triton.jit
def _half_inverse(A, PREC: tl.constexpr, DIAG_PREC: tl.constexpr, PAIR: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular HALF × HALF ``A``, in fp32: its two SUB × SUB
    diagonal blocks by :func:`_stack_inverses` (D = their block diagonal), then, with
    M = D·A_below strictly block-lower (so M² = 0), (I + A)⁻¹ = (I − M)·D: two HALF³ products
    (PREC, see :func:`_mm_t`)."""
    blocks = tl.arange(0, 2)
    same = blocks[:, None, None, None] == blocks[None, None, :, None]  # [2, 1, 2, 1]
    diag = tl.sum(tl.where(same, tl.reshape(A, [2, SUB, 2, SUB]), 0.0), axis=2)
    D = tl.reshape(
        tl.where(same, _stack_inverses(diag, DIAG_PREC)[:, :, None, :], 0.0), [HALF, HALF]
    )
    rows = tl.arange(0, HALF)
    below = (rows[:, None] // SUB) > (rows[None, :] // SUB)
    M = _mm_t(D, tl.where(below, A, 0.0), PREC, PAIR)
    return D - _mm_t(M, D, PREC, PAIR)


@triton.jit
def _chunk_inverse(
    kk11, kk21, kk22, a1, a2, g1, g2, ok1, ok2, PREC: tl.constexpr, DIAG_PREC: tl.constexpr,
    PAIR: tl.constexpr,
):  # fmt: skip
    """(3) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i (a bad token's row and column zero) by
    row and column halves, and T = (I + A)⁻¹ = [T11 0; T21 T22] in fp32: T11, T22 by
    :func:`_half_inverse`, T21 = −T22 A21 T11. Six HALF³ products where the whole CHUNK × CHUNK
    inverse took four CHUNK³ (session 24: a quarter of the flops, no product of zero blocks)."""
    rows = tl.arange(0, HALF)
    lower = rows[:, None] > rows[None, :]
    d11 = tl.exp(tl.where(lower, g1[:, None] - g1[None, :], -float("inf")))
    d22 = tl.exp(tl.where(lower, g2[:, None] - g2[None, :], -float("inf")))
    A11 = tl.where(lower & ok1[:, None] & ok1[None, :], a1[:, None] * d11 * kk11, 0.0)
    A22 = tl.where(lower & ok2[:, None] & ok2[None, :], a2[:, None] * d22 * kk22, 0.0)
    d21 = tl.exp(g2[:, None] - g1[None, :])
    A21 = tl.where(ok2[:, None] & ok1[None, :], a2[:, None] * d21 * kk21, 0.0)
    T11 = _half_inverse(A11, PREC, DIAG_PREC, PAIR)
    T22 = _half_inverse(A22, PREC, DIAG_PREC, PAIR)
    T21 = -_mm_t(_mm_t(T22, A21, PREC, PAIR), T11, PREC, PAIR)
    return T11, T21, T22


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
    cu_seqlens_ptr,
    chunk_indices_ptr,
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
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    half = tl.arange(0, HALF)
    offs1 = t0 + half  # the chunk's two row halves: T is formed as [T11 0; T21 T22]
    offs2 = offs1 + HALF
    mask1 = offs1 < eos
    mask2 = offs2 < eos
    cols = tl.arange(0, TILE)
    # Operand dtype of the W and Ũ products: the inputs' (bf16/fp16) or fp32.
    DT: tl.constexpr = k_ptr.dtype.element_ty if LOW_PRECISION_DOTS else tl.float32

    # K Kᵀ's three nonzero blocks and λ = ‖k‖², one column tile at a time (λ over every column)
    kk11 = tl.zeros([HALF, HALF], dtype=tl.float32)
    kk21 = tl.zeros([HALF, HALF], dtype=tl.float32)
    kk22 = tl.zeros([HALF, HALF], dtype=tl.float32)
    lam1 = tl.zeros([HALF], dtype=tl.float32)
    lam2 = tl.zeros([HALF], dtype=tl.float32)
    for c in range(0, Dk, TILE):
        k1 = load_rows(k_ptr, offs1, mask1, i_h, c + cols, c + cols < Dk, H, Dk)
        k2 = load_rows(k_ptr, offs2, mask2, i_h, c + cols, c + cols < Dk, H, Dk)
        lam1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), axis=1)
        lam2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), axis=1)
        k1 = k1.to(DT)
        k2 = k2.to(DT)
        kk11 = tl.dot(k1, tl.trans(k1), acc=kk11, input_precision=PREC)
        kk21 = tl.dot(k2, tl.trans(k1), acc=kk21, input_precision=PREC)
        kk22 = tl.dot(k2, tl.trans(k2), acc=kk22, input_precision=PREC)

    # a token that is not finite takes no part in any product; the later stages make the
    # outputs NaN from the chunk's first such token on
    a1, b1, ok1, g1, a2, b2, ok2, g2 = half_strengths(
        lam1, lam2, beta_ptr, g_ptr, offs1, offs2, mask1, mask2, i_h, eps, rule, neg, H,
        HAS_BETA, HAS_DECAY,
    )  # fmt: skip
    first_bad = tl.minimum(_first_bad(ok1, 0), _first_bad(ok2, HALF))
    # (3) A and T = (I + A)⁻¹ by halves
    T11, T21, T22 = _chunk_inverse(
        kk11, kk21, kk22, a1, a2, g1, g2, ok1, ok2, T_PREC, DIAG_PREC, k_ptr.dtype.element_ty
    )
    # (4) W = T diag(aΓ) K and Ũ = T diag(b) V (FOLD: store_w)
    L11, L21, L22 = store_w(
        T11, T21, T22, a1, a2, g1, g2, ok1, ok2, k_ptr, w_ptr, offs1, offs2, mask1, mask2, i_h,
        H, Dk, TILE, FOLD, PREC, DT,
    )  # fmt: skip
    # A value tile is checked by the sum of its Ũ tile: only a tile with a non-finite value row
    # (rare) is recomputed with those rows zeroed, lowering first_bad.
    L11, L21, L22 = u_left(T11, T21, T22, L11, L21, L22, b1, b2, FOLD, DT)
    for c in range(0, Dv, TILE):
        v1 = load_rows(v_ptr, offs1, mask1, i_h, c + cols, c + cols < Dv, H, Dv).to(tl.float32)
        v2 = load_rows(v_ptr, offs2, mask2, i_h, c + cols, c + cols < Dv, H, Dv).to(tl.float32)
        y1 = u_right(v1, b1, FOLD)
        y2 = u_right(v2, b2, FOLD)
        u1, u2 = halves_product(L11, L21, L22, y1, y2, PREC, DT)
        if not (_all_finite(u1) & _all_finite(u2)):
            finite1 = tl.sum(tl.where(v1 * 0.0 == 0.0, 0, 1), axis=1) == 0
            finite2 = tl.sum(tl.where(v2 * 0.0 == 0.0, 0, 1), axis=1) == 0
            y1 = tl.where(finite1[:, None], y1, 0.0)
            y2 = tl.where(finite2[:, None], y2, 0.0)
            u1, u2 = halves_product(L11, L21, L22, y1, y2, PREC, DT)
            first_bad = tl.minimum(first_bad, _first_bad(finite1, 0))
            first_bad = tl.minimum(first_bad, _first_bad(finite2, HALF))
        store_rows(u_ptr, u1, offs1, mask1, i_h, c + cols, c + cols < Dv, H, Dv)
        store_rows(u_ptr, u2, offs2, mask2, i_h, c + cols, c + cols < Dv, H, Dv)
    tl.store(first_bad_ptr + i_c * H + i_h, first_bad)

    if store_t != 0:  # T itself ([chunk, head, CHUNK, CHUNK], t_dtype) for the backward
        t_base = t_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK) + half[:, None] * CHUNK
        t_dt = t_ptr.dtype.element_ty
        tl.store(t_base + half[None, :], T11.to(t_dt))
        tl.store(t_base + HALF + half[None, :], tl.zeros([HALF, HALF], dtype=t_dt))
        tl.store(t_base + HALF * CHUNK + half[None, :], T21.to(t_dt))
        tl.store(t_base + HALF * CHUNK + HALF + half[None, :], T22.to(t_dt))
    if STORE_P:  # last, where nothing else is live: the keys again (L2) beside the queries
        offs_t = t0 + tl.arange(0, CHUNK)
        store_p(q_ptr, k_ptr, g_ptr, p_ptr, 1.0, i_c, i_h, offs_t, offs_t < eos, H, Dk, TILE,
                HAS_DECAY, PREC)  # fmt: skip


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
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_indices_ptr=tables.chunk_indices,
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
        DIAG_PREC=PREPARE_DIAG_PRECISION,
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
    }
