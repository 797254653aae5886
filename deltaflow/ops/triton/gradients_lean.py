"""The backward's gradient kernels with fewer live registers (issue 32; benchmarks/NOTES.md,
"Issue 32, session 18"): the same (9)–(12) of docs/design.md §7 as ``gradients.py``, selected
by ``gradients.GRADS_LEAN`` ("auto": at key blocks of 128 or more, where the H100 measured
them faster; session 18, call 2).

What differs, all to lower the register peak (the math and the roundings to the dot dtype are
the same; fp32 sums are reassociated):

- No product of the key side reads another's result. Triton (AccelerateMatmul's
  ``warpsPerTileV3``) gives a product whose result reaches another product the wgmma layout of
  warps [num_warps, 1], for attention; at 64 rows and 8 warps that covers 128 rows, so both
  warp groups hold (and compute) the same accumulator: 64 registers a thread for a C×128 fp32
  tile instead of 32. The plain key side had three such products after its loop (dX's hi part,
  dk's M_Pᵀ Q and M_A K). Here dk's C×C products are one, ``[M_Pᵀ | M_A + M_Aᵀ] [Q; K]``
  (K = 2C; M_A is strictly lower triangular, so the sum rounds nothing), and dX's hi + lo pair
  is one, ``[Tᵀ | Tᵀ] [hi; lo]``.
- The rule table runs in the value-side kernel, at its end where only row vectors are live, and
  the key side reads the result from the row scratch: its strength a, and dβ, dλ, d log α's
  rule terms as ``c0 + c1·Γ·xk`` (the value side knows da up to the key side's Γ·kᵀdX). On
  sm_90 the plain key side's spills sat in the table's branches, three C×BK tiles live.
- The key side sums ⟨G, S_0⟩ to a scalar per value block instead of a BK×BV fp32 tile carried
  through the loop (BK·BV/256 registers a thread at 8 warps: 32 at D = 128), and retires each
  C×BK accumulator in place: dq accumulates onto scale·Γ ⊙ dO S_0ᵀ (stored at once), dk onto
  e^{γ_C − γ} ⊙ U Gᵀ, each row sum taken just before; k is loaded again (L2) for the last terms.
- The value side forms Q Kᵀ and K Kᵀ one after the other, each folded into dγ, M_P or M_A
  before the next (the plain kernel holds dP, dA, D, Q Kᵀ, K Kᵀ and dE together).
- For rules whose c1 is 0 (``rules.ERASE_FREE_OF_NORM``) the key side splits over key blocks
  (:func:`key_blocks`, session 26): nothing else in dq or dk couples key columns, and dβ and
  d log α, row sums over them, are summed from each block's fp32 part.

Row scratch (``[chunks, H, LEAN_ROWS, C]`` fp32), by row: dγ from the decay matrix, a,
c0 and c1 of dλ (dk's ``2 (da ∂a/∂λ + db ∂b/∂λ) k``), of dβ and of the rule's d log α term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import rules as rule_table
from deltaflow.ops.triton.common import (
    CHUNK,
    cdiv,
    chunk_bounds,
    decay_matrix,
    dot_split,
    load_rows,
    log_alpha_ahead,
    log_alpha_rows,
    prefetch_block,
    prefetch_on,
    prefetch_rows,
)
from deltaflow.ops.triton.gradients import (
    _chunk_keys,
    _load_t_transposed,
    pointer_params,
    take,
)

LEAN_ROWS = tl.constexpr(8)  # rows of the row scratch (module docstring)
# The key side split over key blocks of K_SPLIT_BK columns (0: never), each block a program of
# K_SPLIT_WARPS warps (0: the unsplit side's) and K_SPLIT_STAGES stages (0: Triton's), for the
# rules whose dk has no kᵀdX term (rules.ERASE_FREE_OF_NORM) in half precision: at 128 key
# columns the unsplit side is one 8-warp program an SM (255 registers, 139 KB of shared
# memory), its epilogue (the C×C products' and dX's loads and products) exposed; split, each
# program holds three C×64 accumulators and two share an SM. Measured (H200, bf16, session 26
# call 1, kernel_times): the key side 2.79 → 2.15 ms at (8, 2048, 32, 256) (forward + backward
# 9.67 → 9.04), 0.94 → 0.915 at (8, 4096, 16, 128). 2 stages, 8 warps, register caps: slower;
# 32-column blocks: wrong on the GPU at 4 warps (an illegal address after), slower at 8 (call 3),
# so 32 is for the interpreter's tests only (benchmarks/NOTES.md, issue 32, session 26).
K_SPLIT_BK = 64
K_SPLIT_WARPS = 4
K_SPLIT_STAGES = 0
# The key side asks L2 for its epilogue's tiles (M, T, the rows, q and k) as it starts
# (common.prefetch_block, prefetch_rows) where its value loop is at most K_PREFETCH_MAX_TRIPS
# trips: the epilogue's loads wait on DRAM otherwise. H200, bf16, session 27 call 1: the split
# side 0.911 → 0.848 ms at (8, 4096, 16, 128) (two trips), 2.146 → 2.20 at D = 256 (four).
K_PREFETCH = True
K_PREFETCH_MAX_TRIPS = 2


@triton.jit(do_not_specialize=["rule", "neg"])  # every rule: one compiled kernel (rules.py)
def chunk_grads_v_lean_kernel(
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
    chunk_spans_ptr,
    scale,
    eps,
    rule,
    neg,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """``gradients.chunk_grads_v_kernel``'s value side (dv; M_P, M_A), then the rule's
    derivatives folded with da, db into the key side's rows (module docstring)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    _, _, _, _, _, b, _, _ = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)

    dP = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dO Uᵀ
    dUU = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dU Uᵀ
    db = tl.zeros([CHUNK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = load_rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_v = load_rows(v_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        dP += tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
        dY = tl.dot(T_t, b_du, input_precision=PREC)  # Tᵀ dU
        dUU += tl.dot(b_du, tl.trans(b_u), input_precision=PREC)
        db += tl.sum(dY * b_v, axis=1)
        tl.store(
            dv_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            (b[:, None] * dY).to(dv_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )
    # dA = −dY Uᵀ = −Tᵀ (dU Uᵀ) on j < i, dU Uᵀ as a hi + lo pair (gradients.py says why)
    dYU = dot_split(T_t, dUU, tl.zeros([CHUNK, CHUNK], dtype=tl.float32), DT, PREC)
    dA = tl.where(rows[:, None] > rows[None, :], -dYU, 0.0)
    b_q, b_k, b_beta, lam, a, _, gamma, b_g = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    decay = decay_matrix(gamma)
    m_offs = (c * H + i_h) * (2 * CHUNK * CHUNK) + rows[:, None] * CHUNK + rows[None, :]
    # (12) dE = (dP ⊙ QKᵀ + dA ⊙ a KKᵀ) ⊙ D, its row sums minus its column sums: one C×C
    # product at a time, each folded in and dropped before the next is formed
    dP = (scale * dP) * decay  # M_P
    tl.store(m_ptr + m_offs, dP.to(m_ptr.dtype.element_ty))
    E = dP * tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    dgamma = tl.sum(E, axis=1) - tl.sum(E, axis=0)
    # (11) da_i = Σ_j dA_ij D_ij k_iᵀk_j; M_A = dA ⊙ a_i D
    dA = dA * decay
    E = dA * tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    da = tl.sum(E, axis=1)
    dgamma += a * da - tl.sum(a[:, None] * E, axis=0)
    tl.store(m_ptr + CHUNK * CHUNK + m_offs, (a[:, None] * dA).to(m_ptr.dtype.element_ty))
    # The rule, with only row vectors live: dx = c0 + c1·(Γ kᵀdX), the key side's da term
    da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg = rule_table.derivatives(
        b_beta, lam, b_g, eps, rule, neg
    )
    r_offs = (c * H + i_h) * (LEAN_ROWS * CHUNK) + rows
    tl.store(r_ptr + r_offs, dgamma)
    tl.store(r_ptr + CHUNK + r_offs, a)
    tl.store(r_ptr + 2 * CHUNK + r_offs, 2.0 * (da * da_dlam + db * db_dlam))
    tl.store(r_ptr + 3 * CHUNK + r_offs, 2.0 * da_dlam)
    if HAS_BETA:
        tl.store(r_ptr + 4 * CHUNK + r_offs, da * da_dbeta + db * db_dbeta)
        tl.store(r_ptr + 5 * CHUNK + r_offs, da_dbeta)
    if HAS_DECAY:
        if rule_table.reads_decay(rule):  # gated_efla: log α also enters a and b
            tl.store(r_ptr + 6 * CHUNK + r_offs, da * da_dg + db * db_dg)
            tl.store(r_ptr + 7 * CHUNK + r_offs, da_dg)


@triton.jit
def _lean_rows(g_row, g_ptr, offs_t, t0, eos, i_h, H, HAS_DECAY: tl.constexpr,
               G_EARLY: tl.constexpr):  # fmt: skip
    """The chunk's decay rows the key side reads: γ, Γ = e^γ, γ_C and e^{γ_C − γ}, from its log
    α ``g_row`` (G_EARLY: loaded before the value loop, common.log_alpha_rows) or loaded here."""
    if not G_EARLY:
        g_row = log_alpha_rows(g_ptr, offs_t, t0, eos, i_h, H, HAS_DECAY)
    rows = tl.arange(0, CHUNK)
    gamma = tl.cumsum(g_row, axis=0)  # chunk_gamma's
    gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
    return gamma, tl.exp(gamma), gamma_last, tl.exp(gamma_last - gamma)


@triton.jit
def _lean_dq(dQS, q_ptr, k_ptr, m_c, dq_ptr, k_offs, k_mask, Gamma, scale, PREC: tl.constexpr):
    """(9) dq = scale·diag(Γ) dO S_0ᵀ + M_P K, onto dO S_0ᵀ's registers, stored at once;
    returns the row sums scale·Σ q ⊙ dO S_0ᵀ (dγ's Γ term) and the keys it loaded."""
    rows = tl.arange(0, CHUNK)
    b_q = tl.load(q_ptr + k_offs, mask=k_mask, other=0.0)
    b_k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0)
    M_P = tl.load(m_c + rows[:, None] * CHUNK + rows[None, :])
    d_Gamma = scale * tl.sum(b_q.to(tl.float32) * dQS, axis=1)
    dq = tl.dot(M_P, b_k, acc=(scale * Gamma)[:, None] * dQS, input_precision=PREC)
    tl.store(dq_ptr + k_offs, dq.to(dq_ptr.dtype.element_ty), mask=k_mask)
    return d_Gamma, b_k


@triton.jit(do_not_specialize=["rule", "neg"])
def chunk_grads_k_lean_kernel(
    q_ptr,
    k_ptr,
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
    chunk_spans_ptr,
    scale,
    rule,
    split_stride,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
    DQ_FIRST: tl.constexpr,
    NK: tl.constexpr,
    PREFETCH: tl.constexpr,
    G_EARLY: tl.constexpr,
):
    """``gradients.chunk_grads_k_kernel``'s key side (dq, dk, dβ, d log α) without the rule
    table (its terms come from the value side's rows) and with each accumulator retired in
    place (module docstring). NK > 1 (:func:`key_blocks`): the chunk's NK programs (adjacent
    in the grid, so that they share its value-side tiles in L2) each take BK key columns, and
    store their parts of dβ and d log α at ``dbeta_ptr``, ``dg_ptr`` + i_k·``split_stride``
    (fp32, summed on the host)."""
    i_c, i_h = tl.program_id(0) // NK, tl.program_id(1)
    i_k = tl.program_id(0) % NK
    first = i_k == 0  # the block that adds the value side's terms of dβ and d log α
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < Dk
    # This chunk's blocks of the per-chunk tensors as scalar pointers, so that the tile offsets
    # added to them are 32-bit (a 64-bit offset tile takes twice the registers)
    ch = c * H + i_h
    h_c = h_ptr + ch * (Dk * Dv)
    dh_c = dh_ptr + ch * (Dk * Dv)
    m_c = m_ptr + ch * (2 * CHUNK * CHUNK)
    r_c = r_ptr + ch * (LEAN_ROWS * CHUNK)
    # G_EARLY: log α now, in a register, for the epilogue (a plain 2-byte load otherwise waited
    # on after the loop: common.LOG_ALPHA_AHEAD)
    g_row = log_alpha_rows(g_ptr, offs_t, t0, eos, i_h, H, HAS_DECAY and G_EARLY)
    if PREFETCH:  # the epilogue's tiles into L2 while the value loop runs (common.prefetch_*)
        prefetch_block(m_c, 2 * CHUNK * CHUNK)
        prefetch_block(t_ptr + ch * (CHUNK * CHUNK), CHUNK * CHUNK)
        prefetch_block(r_c, LEAN_ROWS * CHUNK)
        prefetch_rows(q_ptr, offs_t, eos - 1, i_h, i_k * BK, H, Dk, BK)
        prefetch_rows(k_ptr, offs_t, eos - 1, i_h, i_k * BK, H, Dk, BK)
    # fp32 inputs: dX = −dY S_0ᵀ per value block, as in gradients.py
    PER_BLOCK: tl.constexpr = DT == tl.float32
    if PER_BLOCK:
        T_t = _load_t_transposed(t_ptr, c, i_h, H)
    dQS = tl.zeros([CHUNK, BK], dtype=tl.float32)  # dO S_0ᵀ
    dKte = tl.zeros([CHUNK, BK], dtype=tl.float32)  # U Gᵀ
    dUS = tl.zeros([CHUNK, BK], dtype=tl.float32)  # dU S_0ᵀ (fp32: dX itself)
    gs = tl.full([], 0.0, dtype=tl.float32)  # ⟨G, S_0⟩: a scalar, not a BK×BV tile
    if DQ_FIRST:
        k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
        k_mask = mask_t[:, None] & mask_k[None, :]
        # dq in a loop of its own (S_0 read twice, the second time from L2), so that two
        # [C, BK] fp32 accumulators are live in the loop below rather than three: at
        # BK = 256 and 8 warps the three alone are 192 registers a thread
        for i_v in range(0, tl.cdiv(Dv, BV)):
            offs_v = i_v * BV + tl.arange(0, BV)
            mask_v = offs_v < Dv
            b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
            S0 = tl.load(h_c + offs_k[:, None] * Dv + offs_v[None, :],
                         mask=mask_k[:, None] & mask_v[None, :], other=0.0)  # fmt: skip
            dQS += tl.dot(b_do, tl.trans(S0.to(DT)), input_precision=PREC)
        gamma, Gamma, gamma_last, to_end = _lean_rows(g_row, g_ptr, offs_t, t0, eos, i_h, H,
                                                      HAS_DECAY, G_EARLY)  # fmt: skip
        d_Gamma, _ = _lean_dq(dQS, q_ptr, k_ptr, m_c, dq_ptr, k_offs, k_mask, Gamma, scale, PREC)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        if not DQ_FIRST:
            b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = load_rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        state_offs = offs_k[:, None] * Dv + offs_v[None, :]
        state_mask = mask_k[:, None] & mask_v[None, :]
        S0 = tl.load(h_c + state_offs, mask=state_mask, other=0.0)
        G = tl.load(dh_c + state_offs, mask=state_mask, other=0.0)
        if not DQ_FIRST:
            dQS += tl.dot(b_do, tl.trans(S0.to(DT)), input_precision=PREC)
        dKte += tl.dot(b_u, tl.trans(G.to(DT)), input_precision=PREC)
        if PER_BLOCK:
            dY = tl.dot(T_t, b_du, input_precision=PREC)
            dUS -= tl.dot(dY, tl.trans(S0), input_precision=PREC)  # (dX itself)
        else:
            dUS += tl.dot(b_du, tl.trans(S0.to(DT)), input_precision=PREC)
        gs += tl.sum(G.to(tl.float32) * S0.to(tl.float32))

    if not DQ_FIRST:  # (the offsets a [C, BK] tile: not live across the loop)
        k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
        k_mask = mask_t[:, None] & mask_k[None, :]
        gamma, Gamma, gamma_last, to_end = _lean_rows(g_row, g_ptr, offs_t, t0, eos, i_h, H,
                                                      HAS_DECAY, G_EARLY)  # fmt: skip
        d_Gamma, b_k = _lean_dq(dQS, q_ptr, k_ptr, m_c, dq_ptr, k_offs, k_mask, Gamma, scale, PREC)
    else:
        b_k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0)  # again: not held across the loop
    # (10), (11) dk's C×C products as one, [M_Pᵀ | M_A + M_Aᵀ] [Q; K] (K = 2C), onto
    # diag(e^{γ_C − γ}) U Gᵀ's registers (M_A is strictly lower triangular: M_A + M_Aᵀ adds
    # each entry to a zero, no rounding). No product here reads another's result: Triton gives
    # such a product the wgmma layout of warps [num_warps, 1] (AccelerateMatmul's chained dots,
    # for attention), which at 64 rows and 8 warps holds its accumulator twice over.
    t = to_end * tl.sum(dKte * b_k.to(tl.float32), axis=1)
    cols = tl.arange(0, 2 * CHUNK)
    right = cols[None, :] >= CHUNK
    j = cols[None, :] % CHUNK
    A = tl.load(m_c + tl.where(right, CHUNK * CHUNK, 0) + j * CHUNK + rows[:, None])
    A_lower = tl.load(m_c + CHUNK * CHUNK + rows[:, None] * CHUNK + j, mask=right, other=0.0)
    A = (A.to(tl.float32) + A_lower.to(tl.float32)).to(A.dtype)
    tok = t0 + cols % CHUNK
    qk_ptr = tl.where(cols < CHUNK, q_ptr, k_ptr)
    QK = tl.load(
        qk_ptr[:, None] + (tok[:, None] * H + i_h) * Dk + offs_k[None, :],
        mask=(tok < eos)[:, None] & mask_k[None, :],
        other=0.0,
    )
    dk = tl.dot(A, QK, acc=to_end[:, None] * dKte, input_precision=PREC)
    # (11) dX = −Tᵀ (dU S_0ᵀ), dU S_0ᵀ a hi + lo pair (gradients.py), as one product too:
    # [Tᵀ | Tᵀ] [hi; lo]
    if PER_BLOCK:
        dX = dUS
    else:
        T_cat = tl.load(t_ptr + ch * (CHUNK * CHUNK) + j * CHUNK + rows[:, None]).to(DT)
        hi = dUS.to(DT)
        lo = (dUS - hi.to(tl.float32)).to(DT)
        hilo = tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), (2 * CHUNK, BK))
        dX = -tl.dot(T_cat, hilo, input_precision=PREC)
    # k again (L2) rather than held in registers across both products
    k32 = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
    xk = tl.sum(dX * k32, axis=1)
    # the rule's 2 dλ k with da = da(value side) + Γ kᵀdX (module docstring). Split (NK > 1),
    # xk is this block's part of kᵀdX: only rules whose a does not read λ split (c1 = 2∂a/∂λ
    # = 0, gradients.key_blocks), and their dk takes c0 alone
    a = tl.load(r_c + CHUNK + rows)
    da_x = Gamma * xk
    c_lam = tl.load(r_c + 2 * CHUNK + rows)
    if NK == 1:
        c_lam += tl.load(r_c + 3 * CHUNK + rows) * da_x
    dk += (a * Gamma)[:, None] * dX + c_lam[:, None] * k32
    tl.store(dk_ptr + k_offs, dk.to(dk_ptr.dtype.element_ty), mask=k_mask)
    part = offs_t * H + i_h + i_k * split_stride  # dβ, d log α (or this block's parts of them)
    if HAS_BETA:
        dbeta = tl.load(r_c + 5 * CHUNK + rows) * da_x
        dbeta += tl.where(first, tl.load(r_c + 4 * CHUNK + rows), 0.0)
        tl.store(dbeta_ptr + part, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)
    if HAS_DECAY:
        # (12) dγ: the decay matrix (value side), Γ_i, and γ_C through (6)
        d_gamma = tl.where(first, tl.load(r_c + rows), 0.0) - t + (d_Gamma + a * xk) * Gamma
        d_gamma_last = tl.sum(t, axis=0) + tl.exp(gamma_last) * gs
        d_gamma += tl.where(rows == CHUNK - 1, d_gamma_last, 0.0)
        d_log_alpha = tl.sum(d_gamma, axis=0) - tl.cumsum(d_gamma, axis=0) + d_gamma
        if rule_table.reads_decay(rule):  # gated_efla: log α also enters a and b
            d_log_alpha += tl.where(first, tl.load(r_c + 6 * CHUNK + rows), 0.0)
            d_log_alpha += tl.load(r_c + 7 * CHUNK + rows) * da_x
        tl.store(dg_ptr + part, d_log_alpha.to(dg_ptr.dtype.element_ty), mask=mask_t)


# Each kernel's tensors, from its signature (gradients.pointer_params)
V_LEAN_POINTERS = pointer_params(chunk_grads_v_lean_kernel)
K_LEAN_POINTERS = pointer_params(chunk_grads_k_lean_kernel)


def key_blocks(Dk: int, dtype: torch.dtype, kernel_id: int) -> int:
    """How many key blocks of K_SPLIT_BK columns the lean key side splits heads of ``Dk`` key
    columns into (1: unsplit), for inputs of ``dtype`` under rule ``kernel_id``."""
    half = dtype in (torch.bfloat16, torch.float16)
    if not (K_SPLIT_BK and half and kernel_id in rule_table.ERASE_FREE_OF_NORM):
        return 1
    return cdiv(Dk, K_SPLIT_BK)


def launch_lean(
    pointers: dict[str, Tensor], value_side: dict, key_side: dict, grid: tuple[int, int]
) -> None:
    """Both lean kernels over ``grid`` (chunks, heads): ``pointers``, ``value_side`` and
    ``key_side`` are ``gradients.launch_gradients``' tensors and the launch settings of its two
    kernels (the key side's kernel takes no β, ε or negative-eigenvalue flag: the value side's
    rows carry the rule). Split (:func:`key_blocks`), each key block's parts of dβ and d log α
    go to fp32 buffers summed into theirs after the launch (:func:`sum_parts`, one launch for
    both, in a fixed order: deterministic)."""
    chunk_grads_v_lean_kernel[grid](**take(pointers, V_LEAN_POINTERS), **value_side)
    key_side = {n: x for n, x in key_side.items() if n not in ("eps", "neg")}
    key_pointers = take(pointers, K_LEAN_POINTERS)
    q = pointers["q_ptr"]
    nk = key_blocks(key_side["Dk"], q.dtype, key_side["rule"])
    parts = {}
    if nk > 1:
        key_side.update(BK=K_SPLIT_BK, DQ_FIRST=False)
        key_side.update({"num_warps": K_SPLIT_WARPS} if K_SPLIT_WARPS else {})
        key_side.update({"num_stages": K_SPLIT_STAGES} if K_SPLIT_STAGES else {})
        for name, flag in (("dbeta_ptr", "HAS_BETA"), ("dg_ptr", "HAS_DECAY")):
            if key_side[flag]:
                out = key_pointers[name]
                part = out.new_empty((nk, *out.shape), dtype=torch.float32)
                parts[name] = key_pointers[name] = part
    trips = cdiv(key_side["Dv"], key_side["BV"])  # the value loop's
    chunk_grads_k_lean_kernel[(grid[0] * nk, grid[1])](
        **key_pointers,
        **key_side,
        NK=nk,
        split_stride=q.numel() // key_side["Dk"],
        PREFETCH=prefetch_on() and K_PREFETCH and trips <= K_PREFETCH_MAX_TRIPS,
        G_EARLY=log_alpha_ahead(),
    )
    if parts:
        sum_parts(parts, pointers)


SUM_BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def sum_parts_kernel(a_ptr, b_ptr, out_a_ptr, out_b_ptr, n, NK: tl.constexpr,
                     HAS_A: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """out = ((part 0 + part 1) + part 2) + … of ``n`` fp32 entries a part, rounded once to out's
    dtype, for one or two tensors (dβ's and d log α's parts) in one launch."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_A:
        _sum_into(a_ptr, out_a_ptr, offs, mask, n, NK)
    if HAS_B:
        _sum_into(b_ptr, out_b_ptr, offs, mask, n, NK)


@triton.jit
def _sum_into(part_ptr, out_ptr, offs, mask, n, NK: tl.constexpr):
    """Entries ``offs`` of one tensor's NK parts summed in block order, stored rounded once."""
    total = tl.load(part_ptr + offs, mask=mask)
    for i in tl.static_range(1, NK):
        total += tl.load(part_ptr + i * n + offs, mask=mask)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_parts(parts: dict[str, Tensor], pointers: dict[str, Tensor]) -> None:
    """Each ``parts[name]`` ([key blocks, *shape], fp32) summed over its first dimension in
    block order into ``pointers[name]``: :func:`launch_lean`'s dβ and d log α in one launch
    (H200, session 29 call 4: a torch add per tensor took 0.0087 ms at two key blocks, this
    0.005; forward + backward −0.004 ms at (8, 4096, 16, 128), −0.025 at (8, 2048, 32, 256))."""
    a, b = parts.get("dbeta_ptr"), parts.get("dg_ptr")
    some = a if a is not None else b
    n = some[0].numel()
    sum_parts_kernel[(cdiv(n, SUM_BLOCK),)](
        a_ptr=some if a is None else a,
        b_ptr=some if b is None else b,
        out_a_ptr=pointers["dbeta_ptr"] if a is not None else some,
        out_b_ptr=pointers["dg_ptr"] if b is not None else some,
        n=n,
        NK=some.shape[0],
        HAS_A=a is not None,
        HAS_B=b is not None,
        BLOCK=SUM_BLOCK,
    )
