"""Triton kernels for the delta-rule op. Equation numbers refer to deltaflow/ops/README.md.

Forward = two launches:

1. ``chunk_prepare_kernel`` (parallel over every chunk and head): the rule's strengths ``a, b``
   from ``β`` and ``λ = ‖k‖²``, the in-chunk decay ``γ``, ``A`` (3) and ``T = (I + A)^{-1}`` by
   forward substitution; writes only ``T`` (C×C per chunk and head).
2. ``chunk_forward_kernel`` (one program per sequence, head and block of value columns): walks
   the chunks in order with the state ``S`` in registers, applying (4)–(6); reads q, k, v, β,
   log α and T once, writes o once (and the final state).

``decode_kernel`` applies a few tokens to an fp32 state in place (1)–(2), one program per
(sequence, head, value block).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rule codes shared with triton_backend.RULE_CODES.
LINEAR, DELTA, EFLA, LONGHORN, TRAPEZOID, KACZMARZ, RELAXED_KACZMARZ = range(7)


@triton.jit
def rule_strengths(beta, lam, eps, RULE: tl.constexpr, NEG: tl.constexpr):
    """Erase and write strengths (a, b) of DESIGN.md §2 from β and λ = ‖k‖² (elementwise)."""
    if RULE == 0:  # linear: a = 0, b = β
        a = lam * 0.0
        b = beta
    elif RULE == 1:  # delta: a = b = β
        a = beta
        b = beta
    elif RULE == 2:  # efla: a = (1 − e^{−h})/λ = β·(1 − e^{−h})/h, series near h = 0
        h = beta * lam
        small = h < 1e-2
        h_safe = tl.where(small, 1.0, h)
        series = 1.0 - h * (0.5 - h * (1.0 / 6.0 - h * (1.0 / 24.0 - h * (1.0 / 120.0))))
        a = beta * tl.where(small, series, (1.0 - tl.exp(-h_safe)) / h_safe)
        b = a
    elif RULE == 3:  # longhorn: β / (1 + h)
        a = beta / (1.0 + beta * lam)
        b = a
    elif RULE == 4:  # trapezoid: β / (1 + h/2)
        a = beta / (1.0 + 0.5 * beta * lam)
        b = a
    elif RULE == 5:  # kaczmarz: 1 / (λ + ε)
        a = 1.0 / (lam + eps)
        b = a
    else:  # relaxed kaczmarz: β / (λ + ε)
        a = beta / (lam + eps)
        b = a
    if NEG:  # negative eigenvalues: μ → 2μ − 1
        a = 2.0 * a
        b = 2.0 * b
    return a, b


@triton.jit
def _load_chunk_gates(
    beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr
):
    if HAS_BETA:
        b_beta = tl.load(beta_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_beta = tl.where(mask_t, 1.0, 0.0)
    if HAS_DECAY:
        b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_g = tl.zeros_like(b_beta)
    return b_beta, b_g


@triton.jit
def chunk_prepare_kernel(
    k_ptr,
    beta_ptr,
    g_ptr,
    T_ptr,
    cu_seqlens_ptr,
    chunk_indices_ptr,
    eps,
    H: tl.constexpr,
    Dk: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    RULE: tl.constexpr,
    NEG: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices_ptr + 2 * i_c)  # sequence of this chunk
    i_j = tl.load(chunk_indices_ptr + 2 * i_c + 1)  # chunk index inside that sequence
    bos = tl.load(cu_seqlens_ptr + i_n) + i_j * C
    eos = tl.load(cu_seqlens_ptr + i_n + 1)

    rows = tl.arange(0, C)
    offs_t = bos + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    b_k = tl.load(
        k_ptr + (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :],
        mask=mask_t[:, None] & (offs_k[None, :] < Dk),
        other=0.0,
    ).to(tl.float32)
    b_beta, b_g = _load_chunk_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    lam = tl.sum(b_k * b_k, axis=1)  # λ_i = ‖k_i‖²
    a, _ = rule_strengths(b_beta, lam, eps, RULE, NEG)
    a = tl.where(mask_t, a, 0.0)  # padding rows are identity steps
    gamma = tl.cumsum(b_g, axis=0)  # γ_i

    # (3) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, gamma[:, None] - gamma[None, :], -float("inf")))
    KK = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
    A = tl.where(strict, a[:, None] * decay * KK, 0.0)

    # T = (I + A)^{-1} by forward substitution: T_i = e_i − Σ_{j<i} A_ij T_j (stable for any A).
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    Tm = eye
    for i in range(1, C):
        a_row = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # row i of A
        t_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * Tm, axis=0)
        Tm = tl.where(rows[:, None] == i, t_row[None, :], Tm)
    T_base = T_ptr + (i_c * H + i_h).to(tl.int64) * C * C
    tl.store(T_base + rows[:, None] * C + rows[None, :], Tm.to(T_ptr.dtype.element_ty))


@triton.jit
def chunk_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    T_ptr,
    s0_ptr,
    o_ptr,
    sT_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    eps,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    RULE: tl.constexpr,
    NEG: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    first_chunk = tl.load(chunk_offsets_ptr + i_n)
    DT = q_ptr.dtype.element_ty  # matrix-unit operand dtype (bf16/fp16, or fp32 exactly)

    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    causal = rows[:, None] >= rows[None, :]

    state_offs = (i_nh.to(tl.int64) * Dk + offs_k[:, None]) * Dv + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    n_chunks = tl.cdiv(eos - bos, C)
    for j in range(0, n_chunks):
        offs_t = bos + j * C + rows
        mask_t = offs_t < eos
        qk_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
        qk_mask = mask_t[:, None] & mask_k[None, :]
        b_k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
        b_q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        v_mask = mask_t[:, None] & mask_v[None, :]
        b_v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        b_beta, b_g = _load_chunk_gates(
            beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY
        )
        b_kf = b_k.to(tl.float32)
        lam = tl.sum(b_kf * b_kf, axis=1)
        a, b = rule_strengths(b_beta, lam, eps, RULE, NEG)
        a = tl.where(mask_t, a, 0.0)
        b = tl.where(mask_t, b, 0.0)
        gamma = tl.cumsum(b_g, axis=0)  # γ_i (padding rows add log α = 0)
        Gamma = tl.exp(gamma)  # Γ_i
        gamma_last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), axis=0)  # γ_C

        T_base = T_ptr + ((first_chunk + j) * H + i_h).to(tl.int64) * C * C
        b_T = tl.load(T_base + rows[:, None] * C + rows[None, :])

        # (4) U = T (diag(b) V − diag(aΓ) K S_0)
        KS = tl.dot(b_k.to(DT), S.to(DT), input_precision=DOT_PRECISION)
        rhs = b[:, None] * b_v - (a * Gamma)[:, None] * KS
        U = tl.dot(b_T.to(DT), rhs.to(DT), input_precision=DOT_PRECISION)

        # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))
        P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * decay
        b_o = Gamma[:, None] * tl.dot(b_q.to(DT), S.to(DT), input_precision=DOT_PRECISION)
        b_o += tl.dot(P.to(DT), U.to(DT), input_precision=DOT_PRECISION)
        tl.store(o_ptr + v_offs, (scale * b_o).to(o_ptr.dtype.element_ty), mask=v_mask)

        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        k_to_end = (b_kf * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        S = tl.exp(gamma_last) * S + tl.dot(
            tl.trans(k_to_end), U.to(DT), input_precision=DOT_PRECISION
        )

    tl.store(sT_ptr + state_offs, S, mask=state_mask)


@triton.jit
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    state_ptr,
    o_ptr,
    scale,
    eps,
    T,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    RULE: tl.constexpr,
    NEG: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    state_offs = (i_bh.to(tl.int64) * Dk + offs_k[:, None]) * Dv + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    S = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0)
    for t in range(0, T):
        tok = i_b * T + t
        b_k = tl.load(k_ptr + (tok * H + i_h) * Dk + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_q = tl.load(q_ptr + (tok * H + i_h) * Dk + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + (tok * H + i_h) * Dv + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        if HAS_BETA:
            b_beta = tl.load(beta_ptr + tok * H + i_h).to(tl.float32)
        else:
            b_beta = 1.0
        lam = tl.sum(b_k * b_k, axis=0)
        a, b = rule_strengths(b_beta, lam, eps, RULE, NEG)
        kS = tl.sum(b_k[:, None] * S, axis=0)  # prediction kᵀS
        # (1) S_t = α_t (S − a k (kᵀS)) + b k vᵀ
        S = S - a * b_k[:, None] * kS[None, :]
        if HAS_DECAY:
            S = tl.exp(tl.load(g_ptr + tok * H + i_h).to(tl.float32)) * S
        S = S + b * b_k[:, None] * b_v[None, :]
        b_o = scale * tl.sum(b_q[:, None] * S, axis=0)  # (2) o_t = scale·S_tᵀq_t
        tl.store(o_ptr + (tok * H + i_h) * Dv + offs_v, b_o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_ptr + state_offs, S, mask=state_mask)
