"""Stage 1, parallel over every chunk and head: the rule's strengths and the UT transform,
(3)–(4) of docs/design.md §3. Forward and backward both start here.

For one chunk of CHUNK tokens (four sub-blocks of SUB tokens): ``a, b`` from ``β`` and
``λ = ‖k‖²`` (the rule table), the in-chunk decay ``γ``, ``A`` (3), and ``W = T diag(aΓ) K``,
``Ũ = T diag(b) V`` (4) by block forward substitution, written in k's and v's layout; for the
backward also ``T = (I + A)⁻¹`` itself. And each chunk's first token with a non-finite input
(docs/design.md §8), which the later stages turn into NaN outputs from that token on.
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
    dot_precision,
    head_block,
    load_gates,
    mm,
)

# Launch settings (benchmarks/NOTES.md). Low-precision dots: the small products take bf16/fp16
# operands instead of tf32 (accumulation stays fp32).
PREPARE_WARPS = 2
PREPARE_LOW_PRECISION_DOTS = True


@triton.jit
def _load_keys(
    k_ptr,
    beta_ptr,
    g_ptr,
    t0,
    eos,
    i_h,
    eps,
    H: tl.constexpr,
    Dk: tl.constexpr,
    BK: tl.constexpr,
    RULE: tl.constexpr,
    NEG: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
):
    """SUB tokens from t0: keys, the rule's strengths a and b (0 beyond eos), log α, and which
    tokens are finite (k, β, a, b and log α all finite). Nothing is zeroed here: that is the
    rare path's work (:func:`_zero_bad_tokens`)."""
    offs_t = t0 + tl.arange(0, SUB)
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    b_k = tl.load(
        k_ptr + (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :],
        mask=mask_t[:, None] & (offs_k[None, :] < Dk),
        other=0.0,
    ).to(tl.float32)
    b_beta, b_g = load_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    lam = tl.sum(b_k * b_k, axis=1)  # λ_i = ‖k_i‖² (NaN or inf when any entry of k_i is)
    a, b = rule_table.strengths(b_beta, lam, eps, RULE, NEG)
    finite = (lam * 0.0 + a * 0.0 + b * 0.0 + b_g * 0.0) == 0.0  # x·0 is NaN unless x is finite
    return b_k, tl.where(mask_t, a, 0.0), tl.where(mask_t, b, 0.0), b_g, finite


@triton.jit
def _zero_bad_tokens(b_k, a, b, b_g, finite):
    """Zeros in place of a non-finite token's key, strengths and log α, so that the chunk's
    products over tokens stay finite (a masked product's 0 · NaN would reach back in time)."""
    return (
        tl.where(finite[:, None], b_k, 0.0),
        tl.where(finite, a, 0.0),
        tl.where(finite, b, 0.0),
        tl.where(finite, b_g, 0.0),
    )


@triton.jit
def _load_values(v_ptr, t0, eos, i_h, H: tl.constexpr, Dv: tl.constexpr, BV: tl.constexpr):
    """SUB value rows from t0 (zeros past eos), in fp32."""
    offs_t = t0 + tl.arange(0, SUB)
    offs_v = tl.arange(0, BV)
    return tl.load(
        v_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
        mask=(offs_t[:, None] < eos) & (offs_v[None, :] < Dv),
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _all_finite(x):
    """Whether every entry of a 2-D block is finite: its sum is NaN or ±inf otherwise (and a
    sum of finite values that overflows only sends the block down the exact, slower path)."""
    return tl.sum(tl.sum(x, axis=1), axis=0) * 0.0 == 0.0


@triton.jit
def _u_block(
    D, x_minus, b_sub, v, first_bad, block: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr
):
    """Ũ_b = D_b (diag(b) V_b − Σ_{j<b} A_bj Ũ_j), with ``x_minus`` the sum. The fast path
    computes it from V as loaded; only when the result is not finite (a NaN or ±inf in V_b)
    is it recomputed with those rows zeroed and ``first_bad`` lowered to the first of them."""
    u = mm(D, b_sub[:, None] * v - x_minus, PREC, DT)
    if not _all_finite(u):  # rare: one of this block's value rows is not finite
        finite = tl.sum(tl.where(v * 0.0 == 0.0, 0, 1), axis=1) == 0
        u = mm(D, b_sub[:, None] * tl.where(finite[:, None], v, 0.0) - x_minus, PREC, DT)
        first_bad = tl.minimum(first_bad, _first_bad(finite, block))
    return u, first_bad


@triton.jit
def _first_bad(finite, block: tl.constexpr):
    """Index in the chunk of the first token of sub-block ``block`` that is not finite
    (CHUNK: none)."""
    return tl.min(tl.where(finite, CHUNK, block * SUB + tl.arange(0, SUB)), axis=0)


@triton.jit
def _store_rows(ptr, x, t0, eos, i_h, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """SUB rows from t0 of head i_h into a [.., T, H, D] tensor (rows past eos skipped)."""
    offs_t = t0 + tl.arange(0, SUB)
    offs_d = tl.arange(0, BD)
    tl.store(
        ptr + (offs_t[:, None] * H + i_h) * D + offs_d[None, :],
        x.to(ptr.dtype.element_ty),
        mask=(offs_t[:, None] < eos) & (offs_d[None, :] < D),
    )


@triton.jit
def _a_block(k_i, k_j, a_i, gamma_i, gamma_j, PREC: tl.constexpr, DT: tl.constexpr):
    """(3) off-diagonal block A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j (every j before every i)."""
    kk = tl.dot(k_i.to(DT), tl.trans(k_j.to(DT)), input_precision=PREC)
    return a_i[:, None] * tl.exp(gamma_i[:, None] - gamma_j[None, :]) * kk


@triton.jit
def _diag_a(k_i, a_i, gamma_i, PREC: tl.constexpr, DT: tl.constexpr):
    """(3) diagonal block of A: a_i e^{γ_i − γ_j} k_iᵀk_j for j < i inside one sub-block."""
    rows = tl.arange(0, SUB)
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, gamma_i[:, None] - gamma_i[None, :], -float("inf")))
    kk = tl.dot(k_i.to(DT), tl.trans(k_i.to(DT)), input_precision=PREC)
    return tl.where(strict, a_i[:, None] * decay * kk, 0.0)


@triton.jit
def _pick(x3, b: tl.constexpr):
    """Sub-block b of a [4, SUB, SUB] stack."""
    blocks = tl.arange(0, 4)
    return tl.sum(tl.where(blocks[:, None, None] == b, x3, 0.0), axis=0)


@triton.jit
def _diag_inverses(A0, A1, A2, A3):
    """(I + A_bb)⁻¹ for the four SUB×SUB diagonal blocks at once, by forward substitution
    T_i = e_i − Σ_{j<i} A_ij T_j on a [4, SUB, SUB] stack: SUB − 1 serial steps for all four.
    Row i is computed from rows j < i only (rows after it still hold the identity), so a
    non-finite row never reaches an earlier one."""
    blocks = tl.arange(0, 4)[:, None, None]
    A = tl.where(
        blocks == 0,
        A0[None, :, :],
        tl.where(
            blocks == 1, A1[None, :, :], tl.where(blocks == 2, A2[None, :, :], A3[None, :, :])
        ),
    )
    rows = tl.arange(0, SUB)
    row3 = rows[None, :, None]
    Tm = tl.where(row3 == rows[None, None, :], 1.0, 0.0) + tl.zeros([4, SUB, SUB], tl.float32)
    for i in range(1, SUB):
        a_row = tl.sum(tl.where(row3 == i, A, 0.0), axis=1)  # [4, SUB]: row i of each A_bb
        t_row = tl.where(rows[None, :] == i, 1.0, 0.0) - tl.sum(a_row[:, :, None] * Tm, axis=1)
        Tm = tl.where(row3 == i, t_row[:, None, :], Tm)
    return _pick(Tm, 0), _pick(Tm, 1), _pick(Tm, 2), _pick(Tm, 3)


@triton.jit
def chunk_prepare_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    w_ptr,
    u_ptr,
    t_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    eps,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    RULE: tl.constexpr,
    NEG: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
    LOW_PRECISION_DOTS: tl.constexpr,
    STORE_T: tl.constexpr,
):
    """(3)–(4) for one chunk and head, in four sub-blocks of SUB tokens:
    W = T diag(aΓ) K and Ũ = T diag(b) V with T = (I + A)⁻¹ by block forward substitution
    X_b ← D_b (X_b − Σ_{j<b} A_bj X_j), D_b = (I + A_bb)⁻¹. Written in k's and v's layout.
    Also the chunk's first token with a non-finite input (CHUNK: none), for the later stages."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    k0, a0, b0, g0, ok0 = _load_keys(
        k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    k1, a1, b1, g1, ok1 = _load_keys(
        k_ptr, beta_ptr, g_ptr, t0 + SUB, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    k2, a2, b2, g2, ok2 = _load_keys(
        k_ptr,
        beta_ptr,
        g_ptr,
        t0 + 2 * SUB,
        eos,
        i_h,
        eps,
        H,
        Dk,
        BK,
        RULE,
        NEG,
        HAS_BETA,
        HAS_DECAY,
    )
    k3, a3, b3, g3, ok3 = _load_keys(
        k_ptr,
        beta_ptr,
        g_ptr,
        t0 + 3 * SUB,
        eos,
        i_h,
        eps,
        H,
        Dk,
        BK,
        RULE,
        NEG,
        HAS_BETA,
        HAS_DECAY,
    )
    # Non-finite inputs (docs/design.md §8): the first token whose key, β, strengths or log α
    # is not finite, from cheap per-token flags; only a chunk that has one pays for zeroing.
    first_bad = tl.minimum(
        tl.minimum(_first_bad(ok0, 0), _first_bad(ok1, 1)),
        tl.minimum(_first_bad(ok2, 2), _first_bad(ok3, 3)),
    )
    if first_bad < CHUNK:
        k0, a0, b0, g0 = _zero_bad_tokens(k0, a0, b0, g0, ok0)
        k1, a1, b1, g1 = _zero_bad_tokens(k1, a1, b1, g1, ok1)
        k2, a2, b2, g2 = _zero_bad_tokens(k2, a2, b2, g2, ok2)
        k3, a3, b3, g3 = _zero_bad_tokens(k3, a3, b3, g3, ok3)
    # γ_i = Σ_{j≤i} log α_j over the whole chunk
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)

    # Operand dtype of the small matrix products: the inputs' (bf16/fp16) or fp32.
    DT: tl.constexpr = k_ptr.dtype.element_ty if LOW_PRECISION_DOTS else tl.float32
    D0, D1, D2, D3 = _diag_inverses(
        _diag_a(k0, a0, c0, PREC, DT),
        _diag_a(k1, a1, c1, PREC, DT),
        _diag_a(k2, a2, c2, PREC, DT),
        _diag_a(k3, a3, c3, PREC, DT),
    )
    A10 = _a_block(k1, k0, a1, c1, c0, PREC, DT)
    A20 = _a_block(k2, k0, a2, c2, c0, PREC, DT)
    A21 = _a_block(k2, k1, a2, c2, c1, PREC, DT)
    A30 = _a_block(k3, k0, a3, c3, c0, PREC, DT)
    A31 = _a_block(k3, k1, a3, c3, c1, PREC, DT)
    A32 = _a_block(k3, k2, a3, c3, c2, PREC, DT)

    # W = T diag(aΓ) K, block by block: W_b = D_b (X_b − Σ_{j<b} A_bj W_j)
    w0 = mm(D0, (a0 * tl.exp(c0))[:, None] * k0, PREC, DT)
    w1 = mm(D1, (a1 * tl.exp(c1))[:, None] * k1 - mm(A10, w0, PREC, DT), PREC, DT)
    w2 = mm(
        D2,
        (a2 * tl.exp(c2))[:, None] * k2 - mm(A20, w0, PREC, DT) - mm(A21, w1, PREC, DT),
        PREC,
        DT,
    )
    w3 = mm(
        D3,
        (a3 * tl.exp(c3))[:, None] * k3
        - mm(A30, w0, PREC, DT)
        - mm(A31, w1, PREC, DT)
        - mm(A32, w2, PREC, DT),
        PREC,
        DT,
    )
    _store_rows(w_ptr, w0, t0, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w1, t0 + SUB, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w2, t0 + 2 * SUB, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w3, t0 + 3 * SUB, eos, i_h, H, Dk, BK)

    # Ũ = T diag(b) V, the same substitution (each value block loaded where it is used; a
    # block with a non-finite value row is recomputed with it zeroed, see _u_block)
    u0, first_bad = _u_block(
        D0, 0.0, b0, _load_values(v_ptr, t0, eos, i_h, H, Dv, BV), first_bad, 0, PREC, DT
    )
    u1, first_bad = _u_block(
        D1,
        mm(A10, u0, PREC, DT),
        b1,
        _load_values(v_ptr, t0 + SUB, eos, i_h, H, Dv, BV),
        first_bad,
        1,
        PREC,
        DT,
    )
    u2, first_bad = _u_block(
        D2,
        mm(A20, u0, PREC, DT) + mm(A21, u1, PREC, DT),
        b2,
        _load_values(v_ptr, t0 + 2 * SUB, eos, i_h, H, Dv, BV),
        first_bad,
        2,
        PREC,
        DT,
    )
    u3, first_bad = _u_block(
        D3,
        mm(A30, u0, PREC, DT) + mm(A31, u1, PREC, DT) + mm(A32, u2, PREC, DT),
        b3,
        _load_values(v_ptr, t0 + 3 * SUB, eos, i_h, H, Dv, BV),
        first_bad,
        3,
        PREC,
        DT,
    )
    _store_rows(u_ptr, u0, t0, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u1, t0 + SUB, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u2, t0 + 2 * SUB, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u3, t0 + 3 * SUB, eos, i_h, H, Dv, BV)
    tl.store(first_bad_ptr + i_c * H + i_h, first_bad)

    if STORE_T:  # T itself (fp32, [chunk, head, CHUNK, CHUNK]) for the backward
        _store_t(t_ptr, i_c, i_h, H, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, PREC)


@triton.jit
def _store_t(t_ptr, i_c, i_h, H, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, PREC: tl.constexpr):
    """T = (I + A)⁻¹ row block by row block: T_b = D_b (E_b − Σ_{j<b} A_bj T_j), E_b the rows
    of I, in fp32 (the backward's dY = Tᵀ dU rounds it to the dot dtype only once)."""
    F32: tl.constexpr = tl.float32
    rows = tl.arange(0, SUB)
    cols = tl.arange(0, CHUNK)
    t0 = mm(D0, tl.where(rows[:, None] == cols[None, :], 1.0, 0.0), PREC, F32)
    t1 = mm(
        D1,
        tl.where(rows[:, None] + SUB == cols[None, :], 1.0, 0.0) - mm(A10, t0, PREC, F32),
        PREC,
        F32,
    )
    t2 = mm(
        D2,
        tl.where(rows[:, None] + 2 * SUB == cols[None, :], 1.0, 0.0)
        - mm(A20, t0, PREC, F32)
        - mm(A21, t1, PREC, F32),
        PREC,
        F32,
    )
    t3 = mm(
        D3,
        tl.where(rows[:, None] + 3 * SUB == cols[None, :], 1.0, 0.0)
        - mm(A30, t0, PREC, F32)
        - mm(A31, t1, PREC, F32)
        - mm(A32, t2, PREC, F32),
        PREC,
        F32,
    )
    base = t_ptr + (i_c.to(tl.int64) * H + i_h) * (CHUNK * CHUNK)
    base += rows[:, None] * CHUNK + cols[None, :]
    tl.store(base, t0)
    tl.store(base + SUB * CHUNK, t1)
    tl.store(base + 2 * SUB * CHUNK, t2)
    tl.store(base + 3 * SUB * CHUNK, t3)


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
) -> None:
    """Fill ``w`` and ``u`` (laid out like k and v), ``first_bad`` ([chunks, H] int32) and, when
    given, ``t`` ([chunks, H, CHUNK, CHUNK] fp32). Rows past a sequence's end are never
    written nor read."""
    if tables.n_chunks == 0:
        return
    H, Dk, Dv = k.shape[2], k.shape[3], v.shape[3]
    chunk_prepare_kernel[(tables.n_chunks, H)](
        k_ptr=k,
        v_ptr=v,
        beta_ptr=k if beta is None else beta,  # absent pointers are never read: flags say so
        g_ptr=k if log_decay is None else log_decay,
        w_ptr=w,
        u_ptr=u,
        t_ptr=w if t is None else t,
        first_bad_ptr=first_bad,
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_indices_ptr=tables.chunk_indices,
        eps=eps,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=head_block(Dk),
        BV=head_block(Dv),
        RULE=kernel_id,
        NEG=bool(negative_eigenvalues),
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        PREC=dot_precision(k.dtype),
        LOW_PRECISION_DOTS=PREPARE_LOW_PRECISION_DOTS and k.dtype != torch.float32,
        STORE_T=t is not None,
        num_warps=PREPARE_WARPS,
    )
