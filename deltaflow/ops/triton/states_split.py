"""Stage 2's three state passes with the state held as row blocks (issue 32; benchmarks/NOTES.md,
"Issue 32, session 18: the state passes' registers and D=256"). ``states.STATES_SPLIT_K`` (128 by
default: Dk = 256) sends a launch of ``states.py`` or ``dstates.py`` (the reverse pass, at its own
rows: ``dstates.dstates_split_k``) here when its key block is wider than that.

The kernels of ``states.py`` and ``dstates.py`` hold the state of one program as one [BK, BV] fp32
tile (BK the whole key head) and load every key-side operand (Q, K, W: [C, BK]) whole for the chunk.
At Dk = 256 that is 128 registers a thread of state alone (4 warps), and the chunk's operands, the
[C, BK] fp32 decay-scaled keys of the fused forward and the reverse pass's [C, BK] fp32 Γq (since
session 22 a [C, BV] scaled dO) on top, spill. Here the same equations run on NKB ≤ 4 blocks of BKS
key rows, ``S = [S_0; S_1; ...]``, each its own fp32 accumulator, with the operands loaded one
[C, BKS] block at a time where a block needs them (a block read twice in one chunk step comes from
L1/L2 the second time, not from memory):

- the products that sum over the key rows (W S, Q S, Q Kᵀ, K G) accumulate block by block into
  one [C, BV] (or [C, C]) accumulator, via ``acc=`` (no second tile for a product's result);
- the state updates act on each block alone (row block b of Kᵀ U is K_bᵀ U; of Wᵀ dU, W_bᵀ dU),
  each accumulated into its own block (``acc=`` again: Γ_C S_b + K_bᵀ Ũ_C in one tile);
- a subtraction of a product becomes a product of a negated operand, exact in every dtype
  (rounding is symmetric: ``(−x).to(DT) == −(x.to(DT))``), so it too accumulates in place.

The roundings are those of ``states.py`` and ``dstates.py``: the same operands rounded to the dot
dtype DT once each (the state, U scaled by its decay to the chunk's end, dU, Pᵀ's scale·P, the
scaled dO as hi + lo); only fp32 accumulation orders differ. One exception, by choice: the fused
forward here updates the state as ``chunk_state_update`` does (U·e^{γ_C − γ} rounded once, the keys
exact), as the two-pass form does, while ``states.chunk_forward_kernel`` rounds decay-scaled keys K̃
(the other form cost it a program an SM at D = 128: issue 32, session 22, call 2).

Equations, poison (non-finite causality) and launch grid as in ``states.py`` and ``dstates.py``,
whose launchers call these kernels with the same arguments plus ``BKS``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaflow.ops.triton.common import (
    CHUNK,
    chunk_gamma,
    decay_matrix,
    dot_split,
    gamma_and_next,
    load_rows,
    log_alpha_rows,
    scaled_grad_o,
)


# ---------------------------------------------------------------------------- block helpers
@triton.jit
def _rows(i_b, BKS: tl.constexpr, Dk: tl.constexpr):
    """Key rows of block ``i_b`` and their mask (a head narrower than the blocks is masked)."""
    offs_k = i_b * BKS + tl.arange(0, BKS)
    return offs_k, offs_k < Dk


@triton.jit
def _state_offs(i_b, offs_v, mask_v, BKS: tl.constexpr, Dk: tl.constexpr, Dv: tl.constexpr):
    """Offsets (in one head's [Dk, Dv] state) and mask of block ``i_b``'s rows, ``offs_v``."""
    offs_k, mask_k = _rows(i_b, BKS, Dk)
    return offs_k[:, None] * Dv + offs_v[None, :], mask_k[:, None] & mask_v[None, :]


@triton.jit
def _load_block(
    ptr,
    base,
    i_b,
    offs_v,
    mask_v,
    BKS: tl.constexpr,
    BV: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    HAS: tl.constexpr,
):
    """Block ``i_b`` of the fp32 state at ``ptr + base`` (zeros where there is none)."""
    if HAS:
        offs, mask = _state_offs(i_b, offs_v, mask_v, BKS, Dk, Dv)
        return tl.load(ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros([BKS, BV], dtype=tl.float32)


@triton.jit
def _store_block(
    ptr, base, x, i_b, offs_v, mask_v, BKS: tl.constexpr, Dk: tl.constexpr, Dv: tl.constexpr
):
    """``x`` into block ``i_b`` of the state at ``ptr + base``, in ``ptr``'s dtype."""
    offs, mask = _state_offs(i_b, offs_v, mask_v, BKS, Dk, Dv)
    tl.store(ptr + base + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _keys(ptr, offs_t, mask_t, i_h, i_b, H: tl.constexpr, Dk: tl.constexpr, BKS: tl.constexpr):
    """Block ``i_b`` ([C, BKS]) of a key-side tensor's chunk rows ``offs_t`` (q, k or W)."""
    offs_k, mask_k = _rows(i_b, BKS, Dk)
    return load_rows(ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)


@triton.jit
def _update(S, b_k, u_to_end, decay_last, PREC: tl.constexpr):
    """(6) on one row block: Γ_C S_b + K_bᵀ (diag(e^{γ_C − γ}) U), accumulated in S's tile."""
    return tl.dot(tl.trans(b_k), u_to_end, acc=decay_last * S, input_precision=PREC)


# ---------------------------------------------------------------------------- the fused forward
@triton.jit
def _forward_in(
    S, acc_u, acc_qs, acc_qk, q_ptr, k_ptr, w_ptr, offs_t, mask_t, i_h, i_b,
    H: tl.constexpr, Dk: tl.constexpr, BKS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    HAS_P: tl.constexpr,
):  # fmt: skip
    """Block ``i_b``'s share of the chunk's key-row sums: U += W_b (−S_b), Q(−S) += Q_b (−S_b),
    Q Kᵀ += Q_b K_bᵀ (the state rounded to DT once, negated: exact, and both accumulate); not
    Q Kᵀ with ``HAS_P`` (the prepare formed P)."""
    b_w = _keys(w_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    b_q = _keys(q_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    b_k = _keys(k_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    s_neg = (-S).to(DT)
    acc_u = tl.dot(b_w.to(DT), s_neg, acc=acc_u, input_precision=PREC)
    acc_qs = tl.dot(b_q.to(DT), s_neg, acc=acc_qs, input_precision=PREC)
    if not HAS_P:
        acc_qk = tl.dot(b_q, tl.trans(b_k), acc=acc_qk, input_precision=PREC)
    return acc_u, acc_qs, acc_qk, b_k


@triton.jit
def split_forward_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    o_ptr,
    sT_ptr,
    first_bad_ptr,
    p_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKS: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
    KEEP_K: tl.constexpr,
    HAS_P: tl.constexpr,
    G_AHEAD: tl.constexpr,
):
    """``states.chunk_forward_kernel`` ((4)–(6), one sequence, head and BV value columns) with
    the state in BK / BKS ≤ 4 row blocks S0..S3 of BKS rows. ``KEEP_K``: the key blocks of
    Q Kᵀ serve the state update too (with a pipelined loop, num_stages ≥ 2, they stay in its
    shared buffers: sm_90 D=256 205 KB and 192 B of spill, against 270 KB loading them twice);
    else each is loaded again for the update (num_stages = 1, the loads through registers:
    holding four [C, BKS] blocks there spilled 936 B at D=256, loading again 544 B). ``HAS_P``:
    (5)'s P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j} as the prepare formed it once per chunk ([chunks, H,
    C, C] in DT at ``p_ptr``), rather than Q Kᵀ formed by each value block's program."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < Dv
    causal = rows[:, None] >= rows[None, :]
    base = i_nh.to(tl.int64) * Dk * Dv
    # blocks past BK are never touched (constexpr branches): S1..S3 exist only where BK needs them
    S0 = _load_block(s0_ptr, base, 0, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > BKS:
        S1 = _load_block(s0_ptr, base, 1, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > 2 * BKS:
        S2 = _load_block(s0_ptr, base, 2, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > 3 * BKS:
        S3 = _load_block(s0_ptr, base, 3, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    n_chunks = tl.cdiv(eos - bos, CHUNK)
    g_next = log_alpha_rows(g_ptr, bos + rows, bos, eos, i_h, H, HAS_DECAY and G_AHEAD)
    for j in range(0, n_chunks):
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        first_bad = tl.load(first_bad_ptr + (c_first + j) * H + i_h)
        row_poison = poison + tl.where(rows >= first_bad, float("nan"), 0.0)
        gamma, g_next = gamma_and_next(g_next, g_ptr, offs_t, mask_t, CHUNK, bos, eos, i_h, H,
                                       HAS_DECAY, G_AHEAD)  # fmt: skip
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)  # γ_C
        # (4) U = Ũ − W S_0, accumulated from Ũ; beside it Q (−S_0) and Q Kᵀ for (5)
        U = load_rows(u_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        qs_neg = tl.zeros([CHUNK, BV], dtype=tl.float32)
        qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        U, qs_neg, qk, k0 = _forward_in(
            S0, U, qs_neg, qk, q_ptr, k_ptr, w_ptr, offs_t, mask_t, i_h, 0, H, Dk, BKS, DT, PREC,
            HAS_P,
        )  # fmt: skip
        if BK > BKS:
            U, qs_neg, qk, k1 = _forward_in(
                S1, U, qs_neg, qk, q_ptr, k_ptr, w_ptr, offs_t, mask_t, i_h, 1, H, Dk, BKS, DT,
                PREC, HAS_P,
            )  # fmt: skip
        if BK > 2 * BKS:
            U, qs_neg, qk, k2 = _forward_in(
                S2, U, qs_neg, qk, q_ptr, k_ptr, w_ptr, offs_t, mask_t, i_h, 2, H, Dk, BKS, DT,
                PREC, HAS_P,
            )  # fmt: skip
        if BK > 3 * BKS:
            U, qs_neg, qk, k3 = _forward_in(
                S3, U, qs_neg, qk, q_ptr, k_ptr, w_ptr, offs_t, mask_t, i_h, 3, H, Dk, BKS, DT,
                PREC, HAS_P,
            )  # fmt: skip
        # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]; Q S_0 = −Q(−S_0)
        if HAS_P:
            p_offs = ((c_first + j).to(tl.int64) * H + i_h) * (CHUNK * CHUNK)
            P = tl.load(p_ptr + p_offs + rows[:, None] * CHUNK + rows[None, :])
        else:
            P = tl.where(causal, qk * decay_matrix(gamma), 0.0)
        row_scale = tl.exp(gamma) + row_poison
        b_o = tl.dot(P.to(DT), U.to(DT), acc=-row_scale[:, None] * qs_neg, input_precision=PREC)
        tl.store(
            o_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            (scale * b_o).to(o_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        # (6) per row block: S_b ← Γ_C S_b + K_bᵀ diag(e^{γ_C − γ}) U (as chunk_state_update)
        u_to_end = (U * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        decay_last = tl.exp(gamma_last)
        if not KEEP_K:  # loaded again (L1/L2) rather than held in registers since Q Kᵀ
            k0 = _keys(k_ptr, offs_t, mask_t, i_h, 0, H, Dk, BKS)
        S0 = _update(S0, k0, u_to_end, decay_last, PREC)
        if BK > BKS:
            if not KEEP_K:
                k1 = _keys(k_ptr, offs_t, mask_t, i_h, 1, H, Dk, BKS)
            S1 = _update(S1, k1, u_to_end, decay_last, PREC)
        if BK > 2 * BKS:
            if not KEEP_K:
                k2 = _keys(k_ptr, offs_t, mask_t, i_h, 2, H, Dk, BKS)
            S2 = _update(S2, k2, u_to_end, decay_last, PREC)
        if BK > 3 * BKS:
            if not KEEP_K:
                k3 = _keys(k_ptr, offs_t, mask_t, i_h, 3, H, Dk, BKS)
            S3 = _update(S3, k3, u_to_end, decay_last, PREC)
        poison += tl.where(first_bad < CHUNK, float("nan"), 0.0)

    _store_block(sT_ptr, base, S0 + poison, 0, offs_v, mask_v, BKS, Dk, Dv)
    if BK > BKS:
        _store_block(sT_ptr, base, S1 + poison, 1, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 2 * BKS:
        _store_block(sT_ptr, base, S2 + poison, 2, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 3 * BKS:
        _store_block(sT_ptr, base, S3 + poison, 3, offs_v, mask_v, BKS, Dk, Dv)


# ---------------------------------------------------------------------------- the state pass
@triton.jit
def _states_in(
    S, acc_u, h_ptr, h_base, poison, w_ptr, offs_t, mask_t, i_h, i_b, offs_v, mask_v,
    H: tl.constexpr, Dk: tl.constexpr, Dv: tl.constexpr, BKS: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Block ``i_b``: stores S_b (+ poison) as the chunk's h, and U += W_b (−S_b)."""
    _store_block(h_ptr, h_base, S + poison, i_b, offs_v, mask_v, BKS, Dk, Dv)
    b_w = _keys(w_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    return tl.dot(b_w.to(DT), (-S).to(DT), acc=acc_u, input_precision=PREC)


@triton.jit
def split_states_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    h_ptr,
    v_new_ptr,
    sT_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKS: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
):
    """``states.chunk_states_kernel`` ((4), (6); h and U stored) in row blocks S0..S3."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < Dv
    base = i_nh.to(tl.int64) * Dk * Dv
    S0 = _load_block(s0_ptr, base, 0, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > BKS:
        S1 = _load_block(s0_ptr, base, 1, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > 2 * BKS:
        S2 = _load_block(s0_ptr, base, 2, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)
    if BK > 3 * BKS:
        S3 = _load_block(s0_ptr, base, 3, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_S0)

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    n_chunks = tl.cdiv(eos - bos, CHUNK)
    for j in range(0, n_chunks):
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        h_base = (c * H + i_h) * Dk * Dv
        # (4) U = Ũ − W S_0, accumulated from Ũ block by block (each block's S_0 stored as h)
        U = load_rows(u_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        U = _states_in(
            S0, U, h_ptr, h_base, poison, w_ptr, offs_t, mask_t, i_h, 0, offs_v, mask_v, H, Dk,
            Dv, BKS, DT, PREC,
        )  # fmt: skip
        if BK > BKS:
            U = _states_in(
                S1, U, h_ptr, h_base, poison, w_ptr, offs_t, mask_t, i_h, 1, offs_v, mask_v, H,
                Dk, Dv, BKS, DT, PREC,
            )  # fmt: skip
        if BK > 2 * BKS:
            U = _states_in(
                S2, U, h_ptr, h_base, poison, w_ptr, offs_t, mask_t, i_h, 2, offs_v, mask_v, H,
                Dk, Dv, BKS, DT, PREC,
            )  # fmt: skip
        if BK > 3 * BKS:
            U = _states_in(
                S3, U, h_ptr, h_base, poison, w_ptr, offs_t, mask_t, i_h, 3, offs_v, mask_v, H,
                Dk, Dv, BKS, DT, PREC,
            )  # fmt: skip
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        tl.store(v_new_ptr + v_offs, U.to(DT), mask=mask_t[:, None] & mask_v[None, :])
        # (6) per row block, as chunk_state_update
        gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)  # γ_C
        u_to_end = (U * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        decay_last = tl.exp(gamma_last)
        b_k = _keys(k_ptr, offs_t, mask_t, i_h, 0, H, Dk, BKS)
        S0 = _update(S0, b_k, u_to_end, decay_last, PREC)
        if BK > BKS:
            b_k = _keys(k_ptr, offs_t, mask_t, i_h, 1, H, Dk, BKS)
            S1 = _update(S1, b_k, u_to_end, decay_last, PREC)
        if BK > 2 * BKS:
            b_k = _keys(k_ptr, offs_t, mask_t, i_h, 2, H, Dk, BKS)
            S2 = _update(S2, b_k, u_to_end, decay_last, PREC)
        if BK > 3 * BKS:
            b_k = _keys(k_ptr, offs_t, mask_t, i_h, 3, H, Dk, BKS)
            S3 = _update(S3, b_k, u_to_end, decay_last, PREC)
        first_bad = tl.load(first_bad_ptr + c * H + i_h)
        poison += tl.where(first_bad < CHUNK, float("nan"), 0.0)

    _store_block(sT_ptr, base, S0 + poison, 0, offs_v, mask_v, BKS, Dk, Dv)
    if BK > BKS:
        _store_block(sT_ptr, base, S1 + poison, 1, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 2 * BKS:
        _store_block(sT_ptr, base, S2 + poison, 2, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 3 * BKS:
        _store_block(sT_ptr, base, S3 + poison, 3, offs_v, mask_v, BKS, Dk, Dv)


# ---------------------------------------------------------------------------- the reverse pass
@triton.jit
def _dstates_in(
    G, acc_kg, acc_qk, dh_ptr, dh_base, q_ptr, k_ptr, offs_t, mask_t, i_h, i_b, offs_v, mask_v,
    H: tl.constexpr, Dk: tl.constexpr, Dv: tl.constexpr, BKS: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, HAS_P: tl.constexpr,
):  # fmt: skip
    """Block ``i_b``: stores G_b as the chunk's dh; K G += K_b G_b and Q Kᵀ += Q_b K_bᵀ (not
    with ``HAS_P``: the rebuild formed scale·P)."""
    _store_block(dh_ptr, dh_base, G, i_b, offs_v, mask_v, BKS, Dk, Dv)
    b_k = _keys(k_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    acc_kg = tl.dot(b_k, G.to(DT), acc=acc_kg, input_precision=PREC)
    if not HAS_P:
        b_q = _keys(q_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
        acc_qk = tl.dot(b_q, tl.trans(b_k), acc=acc_qk, input_precision=PREC)
    return acc_kg, acc_qk


@triton.jit
def _dstate_block(
    G, du_neg, do_gamma, decay_last, q_ptr, w_ptr, offs_t, mask_t, i_h, i_b,
    H: tl.constexpr, Dk: tl.constexpr, BKS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """(7) on one row block: Γ_C G_b + Q_bᵀ (scale·diag(Γ) dO) − W_bᵀ dU, in G_b's tile
    (dstates.dstate_add_outputs: the scaled dO, shared by every block, as hi + lo; then
    dstate_finish with dU negated)."""
    b_q = _keys(q_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    G = dot_split(tl.trans(b_q), do_gamma, decay_last * G, DT, PREC)
    b_w = _keys(w_ptr, offs_t, mask_t, i_h, i_b, H, Dk, BKS)
    return tl.dot(tl.trans(b_w), du_neg, acc=G, input_precision=PREC)


@triton.jit
def split_dstates_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    g_ptr,
    do_ptr,
    dsT_ptr,
    dh_ptr,
    du_ptr,
    ds0_ptr,
    p_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKS: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_DST: tl.constexpr,
    PREC: tl.constexpr,
    HAS_P: tl.constexpr,
):
    """``dstates.chunk_dstates_kernel`` ((7)–(8) from each sequence's end) in row blocks G0..G3:
    dU = K̃ G + scale·Pᵀ dO sums over the blocks; G_b ← Γ_C G_b + scale·(Γ Q_b)ᵀ dO − W_bᵀ dU.
    ``HAS_P``: scale·P as the backward's rebuild formed it once per chunk ([chunks, H, C, C] in
    DT at ``p_ptr``; dstates.DSTATES_P), rather than Q Kᵀ formed by each value block's program."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < Dv
    base = i_nh.to(tl.int64) * Dk * Dv
    G0 = _load_block(dsT_ptr, base, 0, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_DST)
    if BK > BKS:
        G1 = _load_block(dsT_ptr, base, 1, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_DST)
    if BK > 2 * BKS:
        G2 = _load_block(dsT_ptr, base, 2, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_DST)
    if BK > 3 * BKS:
        G3 = _load_block(dsT_ptr, base, 3, offs_v, mask_v, BKS, BV, Dk, Dv, HAS_DST)

    n_chunks = tl.cdiv(eos - bos, CHUNK)
    for jj in range(0, n_chunks):
        j = n_chunks - 1 - jj
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        dh_base = (c * H + i_h) * Dk * Dv
        # (8) K G and Q Kᵀ summed over the row blocks (each block's G stored as dh)
        kg = tl.zeros([CHUNK, BV], dtype=tl.float32)
        qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        kg, qk = _dstates_in(
            G0, kg, qk, dh_ptr, dh_base, q_ptr, k_ptr, offs_t, mask_t, i_h, 0, offs_v, mask_v, H,
            Dk, Dv, BKS, DT, PREC, HAS_P,
        )  # fmt: skip
        if BK > BKS:
            kg, qk = _dstates_in(
                G1, kg, qk, dh_ptr, dh_base, q_ptr, k_ptr, offs_t, mask_t, i_h, 1, offs_v, mask_v,
                H, Dk, Dv, BKS, DT, PREC, HAS_P,
            )  # fmt: skip
        if BK > 2 * BKS:
            kg, qk = _dstates_in(
                G2, kg, qk, dh_ptr, dh_base, q_ptr, k_ptr, offs_t, mask_t, i_h, 2, offs_v, mask_v,
                H, Dk, Dv, BKS, DT, PREC, HAS_P,
            )  # fmt: skip
        if BK > 3 * BKS:
            kg, qk = _dstates_in(
                G3, kg, qk, dh_ptr, dh_base, q_ptr, k_ptr, offs_t, mask_t, i_h, 3, offs_v, mask_v,
                H, Dk, Dv, BKS, DT, PREC, HAS_P,
            )  # fmt: skip
        gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
        # dU = diag(e^{γ_C − γ}) (K G) + scale·Pᵀ dO (du_from_state, du_add_outputs)
        b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(DT)
        if HAS_P:
            p_offs = (c * H + i_h) * (CHUNK * CHUNK) + rows[:, None] * CHUNK + rows[None, :]
            scaled_p = tl.load(p_ptr + p_offs).to(DT)
        else:
            scaled_p = (scale * (qk * decay_matrix(gamma))).to(DT)
        dU = tl.exp(gamma_last - gamma)[:, None] * kg
        dU = tl.dot(tl.trans(scaled_p), b_do, acc=dU, input_precision=PREC)
        tl.store(
            du_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            dU.to(DT),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        # (7) per row block: G_b ← Γ_C G_b + scale·(diag(Γ) Q_b)ᵀ dO − W_bᵀ dU
        du_neg = (-dU).to(DT)
        do_gamma = scaled_grad_o(b_do, gamma, scale)
        decay_last = tl.exp(gamma_last)
        G0 = _dstate_block(
            G0, du_neg, do_gamma, decay_last, q_ptr, w_ptr, offs_t, mask_t, i_h, 0, H, Dk,
            BKS, DT, PREC,
        )  # fmt: skip
        if BK > BKS:
            G1 = _dstate_block(
                G1, du_neg, do_gamma, decay_last, q_ptr, w_ptr, offs_t, mask_t, i_h, 1, H,
                Dk, BKS, DT, PREC,
            )  # fmt: skip
        if BK > 2 * BKS:
            G2 = _dstate_block(
                G2, du_neg, do_gamma, decay_last, q_ptr, w_ptr, offs_t, mask_t, i_h, 2, H,
                Dk, BKS, DT, PREC,
            )  # fmt: skip
        if BK > 3 * BKS:
            G3 = _dstate_block(
                G3, du_neg, do_gamma, decay_last, q_ptr, w_ptr, offs_t, mask_t, i_h, 3, H,
                Dk, BKS, DT, PREC,
            )  # fmt: skip

    _store_block(ds0_ptr, base, G0, 0, offs_v, mask_v, BKS, Dk, Dv)
    if BK > BKS:
        _store_block(ds0_ptr, base, G1, 1, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 2 * BKS:
        _store_block(ds0_ptr, base, G2, 2, offs_v, mask_v, BKS, Dk, Dv)
    if BK > 3 * BKS:
        _store_block(ds0_ptr, base, G3, 3, offs_v, mask_v, BKS, Dk, Dv)
