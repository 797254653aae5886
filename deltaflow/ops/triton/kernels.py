"""Triton kernels for the delta-rule op. Equation numbers refer to deltaflow/ops/README.md.

Forward = two launches, chunks of 64 tokens:

1. ``chunk_prepare_kernel`` (parallel over every chunk and head): the rule's strengths ``a, b``
   from ``β`` and ``λ = ‖k‖²``, the in-chunk decay ``γ``, ``A`` (3), and ``W = T diag(aΓ) K``,
   ``Ũ = T diag(b) V`` (4) by block forward substitution over four 16-token blocks.
2. ``chunk_forward_kernel`` (one program per sequence, head and block of value columns): walks
   the chunks in order with the state ``S`` in registers: ``U = Ũ − W S``, the output (5) and
   the state update (6). It never sees β or the rule.

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
def chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c):
    """First token of chunk i_c (64 tokens) and the end of its sequence, from the chunk table."""
    i_n = tl.load(chunk_indices_ptr + 2 * i_c)
    i_j = tl.load(chunk_indices_ptr + 2 * i_c + 1)
    return tl.load(cu_seqlens_ptr + i_n) + i_j * 64, tl.load(cu_seqlens_ptr + i_n + 1)


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
def _load_block(
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
    """16 tokens from t0: keys, the rule's strengths a and b, log α (0 beyond eos), and which
    tokens are finite. A token whose k, β, a, b or log α is NaN or ±inf gets zeros instead
    (``finite`` says which): the chunk's products over tokens then stay finite, and the caller
    poisons the outputs from that token on (the 0 · NaN of a masked product would reach back)."""
    offs_t = t0 + tl.arange(0, 16)
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    b_k = tl.load(
        k_ptr + (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :],
        mask=mask_t[:, None] & (offs_k[None, :] < Dk),
        other=0.0,
    ).to(tl.float32)
    b_beta, b_g = _load_chunk_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    lam = tl.sum(b_k * b_k, axis=1)  # λ_i = ‖k_i‖² (NaN or inf when any entry of k_i is)
    a, b = rule_strengths(b_beta, lam, eps, RULE, NEG)
    finite = (lam * 0.0 + a * 0.0 + b * 0.0 + b_g * 0.0) == 0.0  # x·0 is NaN unless x is finite
    keep = mask_t & finite
    return (
        tl.where(finite[:, None], b_k, 0.0),
        tl.where(keep, a, 0.0),
        tl.where(keep, b, 0.0),
        tl.where(finite, b_g, 0.0),
        finite,
    )


@triton.jit
def _load_values(v_ptr, t0, eos, i_h, H: tl.constexpr, Dv: tl.constexpr, BV: tl.constexpr):
    """16 value rows from t0 with NaN and ±inf entries zeroed, and which rows were finite."""
    offs_t = t0 + tl.arange(0, 16)
    offs_v = tl.arange(0, BV)
    b_v = tl.load(
        v_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
        mask=(offs_t[:, None] < eos) & (offs_v[None, :] < Dv),
        other=0.0,
    ).to(tl.float32)
    finite = b_v * 0.0 == 0.0
    return tl.where(finite, b_v, 0.0), tl.sum(tl.where(finite, 0, 1), axis=1) == 0


@triton.jit
def _first_bad(finite, block: tl.constexpr):
    """Index in the chunk of the first token of a 16-token block that is not finite (64: none)."""
    return tl.min(tl.where(finite, 64, block * 16 + tl.arange(0, 16)), axis=0)


@triton.jit
def _store_rows(ptr, x, t0, eos, i_h, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    offs_t = t0 + tl.arange(0, 16)
    offs_d = tl.arange(0, BD)
    tl.store(
        ptr + (offs_t[:, None] * H + i_h) * D + offs_d[None, :],
        x.to(ptr.dtype.element_ty),
        mask=(offs_t[:, None] < eos) & (offs_d[None, :] < D),
    )


@triton.jit
def _mm(x, y, PREC: tl.constexpr, DT: tl.constexpr):
    """x @ y with operands in DT, accumulated in fp32."""
    return tl.dot(x.to(DT), y.to(DT), input_precision=PREC)


@triton.jit
def _a_block(k_i, k_j, a_i, gamma_i, gamma_j, PREC: tl.constexpr, DT: tl.constexpr):
    """(3) off-diagonal block A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j (every j before every i)."""
    kk = tl.dot(k_i.to(DT), tl.trans(k_j.to(DT)), input_precision=PREC)
    return a_i[:, None] * tl.exp(gamma_i[:, None] - gamma_j[None, :]) * kk


@triton.jit
def _diag_a(k_i, a_i, gamma_i, PREC: tl.constexpr, DT: tl.constexpr):
    """(3) diagonal block of A: a_i e^{γ_i − γ_j} k_iᵀk_j for j < i inside one 16-token block."""
    rows = tl.arange(0, 16)
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, gamma_i[:, None] - gamma_i[None, :], -float("inf")))
    kk = tl.dot(k_i.to(DT), tl.trans(k_i.to(DT)), input_precision=PREC)
    return tl.where(strict, a_i[:, None] * decay * kk, 0.0)


@triton.jit
def _pick(x3, b: tl.constexpr):
    """Block b of a [4, 16, 16] stack."""
    blocks = tl.arange(0, 4)
    return tl.sum(tl.where(blocks[:, None, None] == b, x3, 0.0), axis=0)


@triton.jit
def _diag_inverses(A0, A1, A2, A3):
    """(I + A_bb)^{-1} for the four 16×16 diagonal blocks at once, by forward substitution
    T_i = e_i − Σ_{j<i} A_ij T_j on a [4, 16, 16] stack: 15 serial steps for all four."""
    blocks = tl.arange(0, 4)[:, None, None]
    A = tl.where(
        blocks == 0,
        A0[None, :, :],
        tl.where(
            blocks == 1, A1[None, :, :], tl.where(blocks == 2, A2[None, :, :], A3[None, :, :])
        ),
    )
    rows = tl.arange(0, 16)
    row3 = rows[None, :, None]
    Tm = tl.where(row3 == rows[None, None, :], 1.0, 0.0) + tl.zeros([4, 16, 16], tl.float32)
    for i in range(1, 16):
        a_row = tl.sum(tl.where(row3 == i, A, 0.0), axis=1)  # [4, 16]: row i of each A_bb
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
    """(3)–(4) for one 64-token chunk and head, in four 16-token blocks:
    W = T diag(aΓ) K and Ũ = T diag(b) V with T = (I + A)^{-1} by block forward substitution
    X_b ← D_b (X_b − Σ_{j<b} A_bj X_j), D_b = (I + A_bb)^{-1}. Written in k's and v's layout.
    Also the chunk's first token with a non-finite input (64: none), for the output kernels."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens_ptr, chunk_indices_ptr, i_c)
    k0, a0, b0, g0, ok0 = _load_block(
        k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    k1, a1, b1, g1, ok1 = _load_block(
        k_ptr, beta_ptr, g_ptr, t0 + 16, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    k2, a2, b2, g2, ok2 = _load_block(
        k_ptr, beta_ptr, g_ptr, t0 + 32, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
    k3, a3, b3, g3, ok3 = _load_block(
        k_ptr, beta_ptr, g_ptr, t0 + 48, eos, i_h, eps, H, Dk, BK, RULE, NEG, HAS_BETA, HAS_DECAY
    )
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
    w0 = _mm(D0, (a0 * tl.exp(c0))[:, None] * k0, PREC, DT)
    w1 = _mm(D1, (a1 * tl.exp(c1))[:, None] * k1 - _mm(A10, w0, PREC, DT), PREC, DT)
    w2 = _mm(
        D2,
        (a2 * tl.exp(c2))[:, None] * k2 - _mm(A20, w0, PREC, DT) - _mm(A21, w1, PREC, DT),
        PREC,
        DT,
    )
    w3 = _mm(
        D3,
        (a3 * tl.exp(c3))[:, None] * k3
        - _mm(A30, w0, PREC, DT)
        - _mm(A31, w1, PREC, DT)
        - _mm(A32, w2, PREC, DT),
        PREC,
        DT,
    )
    _store_rows(w_ptr, w0, t0, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w1, t0 + 16, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w2, t0 + 32, eos, i_h, H, Dk, BK)
    _store_rows(w_ptr, w3, t0 + 48, eos, i_h, H, Dk, BK)

    # Ũ = T diag(b) V, the same substitution (each value block loaded where it is used)
    v0, fin0 = _load_values(v_ptr, t0, eos, i_h, H, Dv, BV)
    u0 = _mm(D0, b0[:, None] * v0, PREC, DT)
    first_bad = _first_bad(ok0 & fin0, 0)
    v1, fin1 = _load_values(v_ptr, t0 + 16, eos, i_h, H, Dv, BV)
    u1 = _mm(D1, b1[:, None] * v1 - _mm(A10, u0, PREC, DT), PREC, DT)
    first_bad = tl.minimum(first_bad, _first_bad(ok1 & fin1, 1))
    v2, fin2 = _load_values(v_ptr, t0 + 32, eos, i_h, H, Dv, BV)
    u2 = _mm(D2, b2[:, None] * v2 - _mm(A20, u0, PREC, DT) - _mm(A21, u1, PREC, DT), PREC, DT)
    first_bad = tl.minimum(first_bad, _first_bad(ok2 & fin2, 2))
    v3, fin3 = _load_values(v_ptr, t0 + 48, eos, i_h, H, Dv, BV)
    u3 = _mm(
        D3,
        b3[:, None] * v3 - _mm(A30, u0, PREC, DT) - _mm(A31, u1, PREC, DT) - _mm(A32, u2, PREC, DT),
        PREC,
        DT,
    )
    first_bad = tl.minimum(first_bad, _first_bad(ok3 & fin3, 3))
    _store_rows(u_ptr, u0, t0, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u1, t0 + 16, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u2, t0 + 32, eos, i_h, H, Dv, BV)
    _store_rows(u_ptr, u3, t0 + 48, eos, i_h, H, Dv, BV)
    tl.store(first_bad_ptr + i_c * H + i_h, first_bad)

    if STORE_T:  # T itself (fp32, [chunk, head, 64, 64]) for the backward: the same substitution
        _store_t(t_ptr, i_c, i_h, H, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, PREC)


@triton.jit
def _store_t(t_ptr, i_c, i_h, H, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, PREC: tl.constexpr):
    """T = (I + A)^{-1} row block by row block: T_b = D_b (E_b − Σ_{j<b} A_bj T_j), E_b the rows
    of I, in fp32 (the backward's dY = Tᵀ dU rounds it to the dot dtype only once)."""
    F32: tl.constexpr = tl.float32
    rows = tl.arange(0, 16)
    cols = tl.arange(0, 64)
    t0 = _mm(D0, tl.where(rows[:, None] == cols[None, :], 1.0, 0.0), PREC, F32)
    t1 = _mm(
        D1,
        tl.where(rows[:, None] + 16 == cols[None, :], 1.0, 0.0) - _mm(A10, t0, PREC, F32),
        PREC,
        F32,
    )
    t2 = _mm(
        D2,
        tl.where(rows[:, None] + 32 == cols[None, :], 1.0, 0.0)
        - _mm(A20, t0, PREC, F32)
        - _mm(A21, t1, PREC, F32),
        PREC,
        F32,
    )
    t3 = _mm(
        D3,
        tl.where(rows[:, None] + 48 == cols[None, :], 1.0, 0.0)
        - _mm(A30, t0, PREC, F32)
        - _mm(A31, t1, PREC, F32)
        - _mm(A32, t2, PREC, F32),
        PREC,
        F32,
    )
    base = t_ptr + (i_c.to(tl.int64) * H + i_h) * 4096 + rows[:, None] * 64 + cols[None, :]
    tl.store(base, t0)
    tl.store(base + 16 * 64, t1)
    tl.store(base + 32 * 64, t2)
    tl.store(base + 48 * 64, t3)


@triton.jit
def chunk_forward_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    o_ptr,
    sT_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
):
    """(4)–(6) along one sequence for one head and BV value columns, state S in registers.

    From the first token with a non-finite input on (the prepare kernel's ``first_bad``),
    outputs and the final state are NaN: a poison added to the rows' scale Γ_i, never a product
    with a masked future (P is masked by selection: 0 · NaN would reach back in time)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty  # matrix-unit operand dtype (bf16/fp16, or fp32 exactly)

    rows = tl.arange(0, 64)
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

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    n_chunks = tl.cdiv(eos - bos, 64)
    for j in range(0, n_chunks):
        offs_t = bos + j * 64 + rows
        mask_t = offs_t < eos
        first_bad = tl.load(first_bad_ptr + (c_first + j) * H + i_h)
        row_poison = poison + tl.where(rows >= first_bad, float("nan"), 0.0)
        k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
        k_mask = mask_t[:, None] & mask_k[None, :]
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        v_mask = mask_t[:, None] & mask_v[None, :]
        b_w = tl.load(w_ptr + k_offs, mask=k_mask, other=0.0)
        b_u = tl.load(u_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0)
        b_q = tl.load(q_ptr + k_offs, mask=k_mask, other=0.0)
        if HAS_DECAY:
            b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
        else:
            b_g = tl.zeros([64], dtype=tl.float32)
        gamma = tl.cumsum(b_g, axis=0)  # γ_i
        gamma_last = tl.sum(b_g, axis=0)  # γ_C (padding adds log α = 0)

        # (4) U = Ũ − W S_0   (critical path: this dot and the state update below)
        U = b_u - tl.dot(b_w.to(DT), S.to(DT), input_precision=PREC)
        # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))
        P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay, 0.0)
        row_scale = tl.exp(gamma) + row_poison
        b_o = row_scale[:, None] * tl.dot(b_q.to(DT), S.to(DT), input_precision=PREC)
        b_o += tl.dot(P.to(DT), U.to(DT), input_precision=PREC)
        tl.store(o_ptr + v_offs, (scale * b_o).to(o_ptr.dtype.element_ty), mask=v_mask)
        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        k_to_end = (b_k.to(tl.float32) * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        S = tl.exp(gamma_last) * S + tl.dot(tl.trans(k_to_end), U.to(DT), input_precision=PREC)
        poison += tl.where(first_bad < 64, float("nan"), 0.0)

    tl.store(sT_ptr + state_offs, S + poison, mask=state_mask)


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
