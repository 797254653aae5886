"""Triton kernels of the state passes and the fused backward. Equation numbers refer to
deltaflow/ops/README.md; the gradient equations (7)–(12) are written out there too.

The forward's two-pass form (few sequences × heads, e.g. one long sequence):

1. ``chunk_states_kernel`` (one program per sequence, head and value block, sequential over
   chunks): only the state recurrence (4), (6). It stores the state entering every chunk
   ``S_0`` and ``U = Ũ − W S_0``; with a small value block there are many programs.
2. ``chunk_output_kernel`` (parallel over every chunk): the output (5) from ``S_0`` and ``U``.

The backward, after the prepare kernel (recomputing ``W``, ``Ũ`` and storing ``T``) and
``chunk_states_kernel`` (recomputing ``S_0``, ``U``):

3. ``chunk_dstates_kernel`` (sequential over chunks, from the end): the state's gradient
   ``G`` (7), storing ``G`` leaving every chunk and ``dU`` (8).
4. ``chunk_grads_v_kernel`` then ``chunk_grads_k_kernel`` (parallel over every chunk):
   everything else, (9)–(12): the value side (dv, and two C×C matrices and three row vectors
   for the key side), then dq, dk, dβ through the rule's derivatives, and d log α by a
   reverse cumulative sum in the chunk. Two kernels rather than one: one spilled registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaflow.ops.triton.kernels import _load_chunk_gates, chunk_bounds, rule_strengths


@triton.jit
def rule_derivatives(beta, lam, eps, RULE: tl.constexpr, NEG: tl.constexpr):
    """∂a/∂β, ∂a/∂λ, ∂b/∂β, ∂b/∂λ of :func:`rule_strengths` (elementwise)."""
    zero = lam * 0.0
    if RULE == 0:  # linear: a = 0, b = β
        da_dbeta, da_dlam = zero, zero
        db_dbeta, db_dlam = zero + 1.0, zero
    else:
        if RULE == 1:  # delta: a = β
            da_dbeta, da_dlam = zero + 1.0, zero
        elif RULE == 2:  # efla: a = β φ(h), φ(h) = (1 − e^{−h})/h: ∂β = e^{−h}, ∂λ = β² φ'(h)
            h = beta * lam
            small = h < 0.1
            h_safe = tl.where(small, 1.0, h)
            # φ'(h) = (e^{−h}(1 + h) − 1)/h², by its series where that cancels
            series = -0.5 + h * (1.0 / 3.0 - h * (0.125 - h * (1.0 / 30.0 - h * (1.0 / 144.0))))
            direct = (tl.exp(-h_safe) * (1.0 + h_safe) - 1.0) / (h_safe * h_safe)
            da_dbeta = tl.exp(-h)
            da_dlam = beta * beta * tl.where(small, series, direct)
        elif RULE == 3:  # longhorn: a = β/(1 + h)
            r = 1.0 / (1.0 + beta * lam)
            da_dbeta, da_dlam = r * r, -beta * beta * r * r
        elif RULE == 4:  # trapezoid: a = β/(1 + h/2)
            r = 1.0 / (1.0 + 0.5 * beta * lam)
            da_dbeta, da_dlam = r * r, -0.5 * beta * beta * r * r
        elif RULE == 5:  # kaczmarz: a = 1/(λ + ε)
            r = 1.0 / (lam + eps)
            da_dbeta, da_dlam = zero, -r * r
        else:  # relaxed kaczmarz: a = β/(λ + ε)
            r = 1.0 / (lam + eps)
            da_dbeta, da_dlam = r, -beta * r * r
        db_dbeta, db_dlam = da_dbeta, da_dlam
    if NEG:  # a, b doubled
        da_dbeta, da_dlam = 2.0 * da_dbeta, 2.0 * da_dlam
        db_dbeta, db_dlam = 2.0 * db_dbeta, 2.0 * db_dlam
    return da_dbeta, da_dlam, db_dbeta, db_dlam


@triton.jit
def _rows(ptr, offs_t, mask_t, i_h, offs_d, mask_d, H: tl.constexpr, D: tl.constexpr):
    """Rows offs_t of head i_h of a [.., T, H, D] tensor (zeros where masked)."""
    return tl.load(
        ptr + (offs_t[:, None] * H + i_h) * D + offs_d[None, :],
        mask=mask_t[:, None] & mask_d[None, :],
        other=0.0,
    )


@triton.jit
def _gamma(g_ptr, offs_t, mask_t, i_h, H: tl.constexpr, HAS_DECAY: tl.constexpr):
    """γ_i = Σ_{j≤i} log α_j inside the chunk (0 without decay; padding adds 0)."""
    if HAS_DECAY:
        b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_g = tl.zeros([64], dtype=tl.float32)
    return tl.cumsum(b_g, axis=0)


@triton.jit
def _load_t_transposed(t_ptr, c, i_h, H):
    """Tᵀ of chunk c and head i_h, as the prepare kernel stored it (fp32)."""
    rows = tl.arange(0, 64)
    T = tl.load(t_ptr + (c * H + i_h) * 4096 + rows[:, None] * 64 + rows[None, :])
    return tl.trans(T)


@triton.jit
def chunk_states_kernel(
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
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
):
    """(4), (6) along one sequence: stores S_0 of every chunk (h) and U = Ũ − W S_0 (v_new).
    States after a chunk with a non-finite input (``first_bad`` < 64) are stored as NaN."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, 64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    state_mask = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * Dv + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    n_chunks = tl.cdiv(eos - bos, 64)
    for j in range(0, n_chunks):
        offs_t = bos + j * 64 + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        h_offs = h_ptr + (c * H + i_h) * Dk * Dv + state_offs
        tl.store(h_offs, (S + poison).to(DT), mask=state_mask)
        b_w = _rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_k = _rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_u = _rows(u_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        gamma = _gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
        gamma_last = tl.sum(tl.where(rows == 63, gamma, 0.0), axis=0)  # γ_C
        # (4) U = Ũ − W S_0
        U = b_u - tl.dot(b_w, S.to(DT), input_precision=PREC)
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        tl.store(v_new_ptr + v_offs, U.to(DT), mask=mask_t[:, None] & mask_v[None, :])
        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        k_to_end = (b_k.to(tl.float32) * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        S = tl.exp(gamma_last) * S + tl.dot(tl.trans(k_to_end), U.to(DT), input_precision=PREC)
        first_bad = tl.load(first_bad_ptr + c * H + i_h)
        poison += tl.where(first_bad < 64, float("nan"), 0.0)

    tl.store(sT_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, S + poison, mask=state_mask)


@triton.jit
def chunk_output_kernel(
    q_ptr,
    k_ptr,
    h_ptr,
    v_new_ptr,
    g_ptr,
    o_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """(5) for one chunk, head and value block: O = scale [diag(Γ) Q S_0 + P U]; rows from the
    chunk's first non-finite token on are NaN (a poison on Γ_i; P masked by selection)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty

    rows = tl.arange(0, 64)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    b_q = _rows(q_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
    b_k = _rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
    b_u = _rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    S0 = tl.load(
        h_ptr + (i_c.to(tl.int64) * H + i_h) * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :],
        mask=mask_k[:, None] & mask_v[None, :],
        other=0.0,
    )
    gamma = _gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))
    P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay, 0.0)
    first_bad = tl.load(first_bad_ptr + i_c * H + i_h)
    row_scale = tl.exp(gamma) + tl.where(rows >= first_bad, float("nan"), 0.0)
    b_o = row_scale[:, None] * tl.dot(b_q, S0, input_precision=PREC)
    b_o += tl.dot(P.to(DT), b_u, input_precision=PREC)
    tl.store(
        o_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
        (scale * b_o).to(o_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_v[None, :],
    )


@triton.jit
def chunk_dstates_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    g_ptr,
    do_ptr,
    dsT_ptr,
    dh_ptr,
    du_ptr,
    ds0_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_DST: tl.constexpr,
    PREC: tl.constexpr,
):
    """(7)–(8) along one sequence from its end, for one head and BV value columns:
    dU = scale·Pᵀ dO + K̃ G,   G ← scale·(diag(Γ) Q)ᵀ dO + Γ_C G − Wᵀ dU,
    with G the gradient of the state leaving the chunk (stored as dh) and K̃ = diag(e^{γ_C − γ}) K.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, 64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    causal = rows[:, None] >= rows[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * Dv + offs_v[None, :]
    if HAS_DST:
        G = tl.load(dsT_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, mask=state_mask, other=0.0)
    else:
        G = tl.zeros([BK, BV], dtype=tl.float32)

    n_chunks = tl.cdiv(eos - bos, 64)
    for jj in range(0, n_chunks):
        j = n_chunks - 1 - jj
        offs_t = bos + j * 64 + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        tl.store(dh_ptr + (c * H + i_h) * Dk * Dv + state_offs, G.to(DT), mask=state_mask)
        b_q = _rows(q_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_k = _rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_w = _rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_do = _rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(DT)
        gamma = _gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
        gamma_last = tl.sum(tl.where(rows == 63, gamma, 0.0), axis=0)
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))
        P = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay
        k_to_end = (b_k.to(tl.float32) * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        # (8) dU = scale·Pᵀ dO + K̃ G
        dU = scale * tl.dot(tl.trans(P.to(DT)), b_do, input_precision=PREC)
        dU += tl.dot(k_to_end, G.to(DT), input_precision=PREC)
        tl.store(
            du_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            dU.to(DT),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        # (7) G ← scale·(diag(Γ) Q)ᵀ dO + Γ_C G − Wᵀ dU
        q_gamma = (b_q.to(tl.float32) * (scale * tl.exp(gamma))[:, None]).to(DT)
        G = tl.exp(gamma_last) * G + tl.dot(tl.trans(q_gamma), b_do, input_precision=PREC)
        G -= tl.dot(tl.trans(b_w), dU.to(DT), input_precision=PREC)

    tl.store(ds0_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, G, mask=state_mask)


@triton.jit
def _chunk_keys(
    q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
):
    """What both gradient kernels load for a chunk: q, k, β, λ = ‖k‖², a, b (0 past eos), γ."""
    rows = tl.arange(0, 64)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    b_q = _rows(q_ptr, offs_t, mask_t, i_h, offs_k, offs_k < Dk, H, Dk)
    b_k = _rows(k_ptr, offs_t, mask_t, i_h, offs_k, offs_k < Dk, H, Dk)
    b_beta, b_g = _load_chunk_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    k32 = b_k.to(tl.float32)
    lam = tl.sum(k32 * k32, axis=1)
    a, b = rule_strengths(b_beta, lam, eps, RULE, NEG)
    a = tl.where(mask_t, a, 0.0)
    b = tl.where(mask_t, b, 0.0)
    return b_q, b_k, b_beta, lam, a, b, tl.cumsum(b_g, axis=0)


@triton.jit
def chunk_grads_v_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    v_new_ptr,
    du_ptr,
    do_ptr,
    dv_ptr,
    m_ptr,
    r_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    scale,
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
):
    """(9), (11) for one chunk and head, the value side: over value blocks dP = dO Uᵀ and
    dY = Tᵀ dU (so dv = b·dY, db = Σ dY ⊙ V) with dY Uᵀ; then the two C×C matrices the key side
    needs, M_P = scale·dP ⊙ e^{γ_i − γ_j} (j ≤ i) and M_A = dA ⊙ a_i e^{γ_i − γ_j} with
    dA = −dY Uᵀ on j < i, and three row vectors: da from A, dγ from the decay matrix, db."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, 64)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    # The write strength b first; q, k and the rest are loaded again after the loop (from L2)
    # rather than kept in registers across it.
    _, _, _, _, _, b, _ = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)

    dP = tl.zeros([64, 64], dtype=tl.float32)  # dO Uᵀ
    dYU = tl.zeros([64, 64], dtype=tl.float32)  # dY Uᵀ
    db = tl.zeros([64], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        b_do = _rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = _rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = _rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_v = _rows(v_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        dP += tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
        # dY = Tᵀ dU: the gradient of Ũ = T diag(b) V, through (4)
        dY = tl.dot(T_t, b_du, input_precision=PREC)
        dYU += tl.dot(dY.to(DT), tl.trans(b_u), input_precision=PREC)
        db += tl.sum(dY * b_v, axis=1)
        tl.store(
            dv_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            (b[:, None] * dY).to(dv_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )

    b_q, b_k, _, _, a, _, gamma = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))
    QK = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    KK = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    dP = scale * dP
    # (11) dA = −(Tᵀ dU)(Ũ − W S_0)ᵀ = −dY Uᵀ on j < i, with A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j
    dA = tl.where(rows[:, None] > rows[None, :], -dYU, 0.0)
    da = tl.sum(dA * decay * KK, axis=1)
    # (12) the decay matrix e^{γ_i − γ_j} enters P (5) and A (3)
    dE = (dP * QK + dA * a[:, None] * KK) * decay
    dgamma = tl.sum(dE, axis=1) - tl.sum(dE, axis=0)
    m_offs = (c * H + i_h) * 8192 + rows[:, None] * 64 + rows[None, :]
    tl.store(m_ptr + m_offs, (dP * decay).to(m_ptr.dtype.element_ty))
    tl.store(m_ptr + 4096 + m_offs, (dA * a[:, None] * decay).to(m_ptr.dtype.element_ty))
    r_offs = (c * H + i_h) * 192 + rows
    tl.store(r_ptr + r_offs, da)
    tl.store(r_ptr + 64 + r_offs, dgamma)
    tl.store(r_ptr + 128 + r_offs, db)


@triton.jit
def chunk_grads_k_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    h_ptr,
    dh_ptr,
    v_new_ptr,
    du_ptr,
    do_ptr,
    m_ptr,
    r_ptr,
    dq_ptr,
    dk_ptr,
    dbeta_ptr,
    dg_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    scale,
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
):
    """(9)–(12) for one chunk and head, the key side. Over value blocks: dO S_0ᵀ (q's part
    through diag(Γ) Q S_0), U Gᵀ (the surviving keys' part of (6)) and dX = −dY S_0ᵀ (the
    gradient of X = diag(aΓ) K in W = T X). Then dq, dk, the rule's dβ and dλ (dk += 2 dλ k),
    and d log α as a reverse cumulative sum of dγ inside the chunk."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, 64)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)

    dQS = tl.zeros([64, BK], dtype=tl.float32)  # dO S_0ᵀ
    dKte = tl.zeros([64, BK], dtype=tl.float32)  # U Gᵀ
    dX = tl.zeros([64, BK], dtype=tl.float32)  # −dY S_0ᵀ
    gs = tl.zeros([BK, BV], dtype=tl.float32)  # G ⊙ S_0, summed at the end
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        b_do = _rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = _rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = _rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        state_offs = (c * H + i_h) * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :]
        state_mask = mask_k[:, None] & mask_v[None, :]
        S0 = tl.load(h_ptr + state_offs, mask=state_mask, other=0.0)
        G = tl.load(dh_ptr + state_offs, mask=state_mask, other=0.0)
        dQS += tl.dot(b_do, tl.trans(S0), input_precision=PREC)
        dKte += tl.dot(b_u, tl.trans(G), input_precision=PREC)
        dY = tl.dot(T_t, b_du, input_precision=PREC)
        dX -= tl.dot(dY.to(DT), tl.trans(S0), input_precision=PREC)
        gs += G.to(tl.float32) * S0.to(tl.float32)

    b_q, b_k, b_beta, lam, a, b, gamma = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    Gamma = tl.exp(gamma)
    gamma_last = tl.sum(tl.where(rows == 63, gamma, 0.0), axis=0)
    to_end = tl.exp(gamma_last - gamma)
    k32 = b_k.to(tl.float32)
    r_offs = (c * H + i_h) * 192 + rows
    m_offs = (c * H + i_h) * 8192 + rows[:, None] * 64 + rows[None, :]
    M_P = tl.load(m_ptr + m_offs)
    # (9) the output (5): diag(Γ) Q S_0 and P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}
    dq = scale * Gamma[:, None] * dQS + tl.dot(M_P, b_k, input_precision=PREC)
    dk = tl.dot(tl.trans(M_P), b_q, input_precision=PREC)
    d_Gamma = scale * tl.sum(b_q.to(tl.float32) * dQS, axis=1)
    # (10) the state update (6) through K̃ = diag(e^{γ_C − γ}) K
    dk += to_end[:, None] * dKte
    t = tl.sum(dKte * k32 * to_end[:, None], axis=1)
    # (11) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j (both keys), and X = diag(aΓ) K
    M_A = tl.load(m_ptr + 4096 + m_offs)
    dk += tl.dot(M_A, b_k, input_precision=PREC)
    dk += tl.dot(tl.trans(M_A), b_k, input_precision=PREC)
    xk = tl.sum(dX * k32, axis=1)
    da = tl.load(r_ptr + r_offs) + Gamma * xk
    db = tl.load(r_ptr + 128 + r_offs)
    dk += (a * Gamma)[:, None] * dX
    # (12) dγ: the decay matrix (from the value side), Γ_i, and γ_C through (6)
    d_gamma = tl.load(r_ptr + 64 + r_offs) - t + (d_Gamma + a * xk) * Gamma
    d_gamma_last = tl.sum(t, axis=0) + tl.exp(gamma_last) * tl.sum(tl.sum(gs, axis=1), axis=0)
    d_gamma += tl.where(rows == 63, d_gamma_last, 0.0)
    d_log_alpha = tl.sum(d_gamma, axis=0) - tl.cumsum(d_gamma, axis=0) + d_gamma

    # The rule: a(β, λ), b(β, λ) with λ = ‖k‖², so dk += 2 dλ k
    da_dbeta, da_dlam, db_dbeta, db_dlam = rule_derivatives(b_beta, lam, eps, RULE, NEG)
    dk += (2.0 * (da * da_dlam + db * db_dlam))[:, None] * k32

    k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
    k_mask = mask_t[:, None] & mask_k[None, :]
    tl.store(dq_ptr + k_offs, dq.to(dq_ptr.dtype.element_ty), mask=k_mask)
    tl.store(dk_ptr + k_offs, dk.to(dk_ptr.dtype.element_ty), mask=k_mask)
    if HAS_BETA:
        dbeta = da * da_dbeta + db * db_dbeta
        tl.store(dbeta_ptr + offs_t * H + i_h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)
    if HAS_DECAY:
        tl.store(dg_ptr + offs_t * H + i_h, d_log_alpha.to(dg_ptr.dtype.element_ty), mask=mask_t)
