"""Stage 3 of the backward, parallel over every chunk: every gradient but the state's,
(9)–(12) of docs/design.md §7, from what the backward's prepare (T), state pass (S_0, U) and
reverse pass (G, dU) stored.

Two kernels rather than one (one spilled registers): ``chunk_grads_v_kernel``, the value side
(dv, and two C×C matrices and three row vectors for the key side), then
``chunk_grads_k_kernel``: dq, dk, dβ and dλ through the rule table's derivatives, and d log α
by a reverse cumulative sum in the chunk (plus, for a rule whose strengths read the decay, its
part through a and b).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import rules as rule_table
from deltaflow.ops.triton.common import (
    CHUNK,
    ChunkTables,
    chunk_bounds,
    decay_matrix,
    dot_precision,
    dot_split,
    head_block,
    key_block,
    load_chunk_square,
    load_gates,
    load_rows,
)

# Launch settings (benchmarks/NOTES.md; benchmarks/tune_backward.py sweeps them). fp32 operands
# take twice the shared memory: GRADS_BV_FP32 value columns there, and in the key-side kernel
# also when the states (h, dh) are fp32 (triton_backend.BACKWARD_STATES_FP32: sm_90, Triton 3.6,
# bf16, 64 columns need 352 KB of shared memory at D = 256; 32 need 180 KB, 98 KB at D = 128).
GRADS_BV = 64
GRADS_BV_FP32 = 32
GRADS_WARPS = 8
# The plain key-side kernel's warps in half precision (the lean pair keeps GRADS_WARPS: at 4 its
# key side fails register allocation at D = 256 and runs 1.8x slower at D = 128). Measured (H200,
# session 19 call 1, bf16, (16, 2048, 32, 64)): chunk_grads_k_kernel 1.463 → 0.821 ms at 4 warps,
# while the value side went 0.657 → 0.729 ms, so it keeps GRADS_WARPS. 0: GRADS_WARPS. fp32
# launches keep GRADS_WARPS (untimed at 4).
GRADS_K_HALF_WARPS = 4
# The value-side kernel's register cap per thread: 128 lets two programs of 8 warps share an SM
# (AOT sm_90: 138-239 registers uncapped; capped, 8-240 B of spill stack). 0 or None: no cap.
GRADS_V_MAXNREG: int | None = 128
# fp32 operands as tf32x3 (common.dot_precision) stage each dot operand twice, its tf32 part and
# its remainder: at a key block wider than this the key-side kernel then asks for 256-304 KB of
# shared memory (Hopper has 227 KB; AOT sm_90, benchmarks/NOTES.md issue 30) whatever the value
# block or stages, so there it multiplies exactly ("ieee": 200 KB, 21 KB of spill stack).
GRADS_K_TF32X3_MAX_BK = 128
# The lean pair of gradient kernels (gradients_lean.py; issue 32, benchmarks/NOTES.md "Issue
# 32, session 18"): the rule table on the value side, and on the key side ⟨G, S_0⟩ as a scalar,
# each accumulator retired in place, no product reading another's result. The same math; on
# sm_90 (Triton 3.6, AOT) the key side spills 16 B instead of 400 at D = 128. "off" | "on" |
# "auto": lean where the key block is at least LEAN_MIN_KEY_BLOCK. Measured (H100, bf16, session
# 18 call 2, forward + backward): (8, 4096, 16, 128) 4.153 → 3.936 ms, (8, 2048, 32, 256) 20.19 →
# 16.07 ms, but (16, 2048, 32, 64) 4.384 → 4.541 ms (its plain kernels do not spill there).
GRADS_LEAN = "auto"
LEAN_MIN_KEY_BLOCK = 128
# The lean value side's register cap (0: none; 213 registers uncapped at D = 128, no spills:
# one program an SM instead of two) at key blocks of at most GRADS_LEAN_V_MAXNREG_MAX_BK
# (H200, session 23 call 1, bf16, forward + backward uncapped: (8, 4096, 16, 128) 3.224 → 3.434
# ms, (8, 2048, 32, 256) 10.495 → 10.418), and both lean kernels' pipeline stages (0: Triton's
# own, 3 on Hopper; the key side's shared memory is 139 KB at D = 128 with 3, 82 KB with 2).
GRADS_LEAN_V_MAXNREG = 128
GRADS_LEAN_V_MAXNREG_MAX_BK = 128
GRADS_LEAN_STAGES = 0
# The lean key side forms dq in a loop of its own at key blocks of at least this many columns
# (0: never): two [C, BK] fp32 accumulators live in its main loop instead of three (AOT sm_90,
# bf16, D = 256, 8 warps: spill stack 1160 → 960 B, LDL + STL 556 → 470). Measured (H200,
# session 23 call 1, bf16, (8, 2048, 32, 256)): the key side 3.01 → 2.80 ms, forward + backward
# 11.050 → 10.495 ms; at D = 128 (min 128) +0.03. The lean key side's warps (0: GRADS_WARPS;
# 16 lost +0.31 ms at D = 256, +0.11 at D = 128) and register cap (0: none; 128 with dq first
# and 2 stages, two programs an SM at D = 128, lost +0.40).
GRADS_LEAN_DQ_FIRST_MIN_BK = 256
GRADS_LEAN_K_WARPS = 0
GRADS_LEAN_K_MAXNREG = 0  # the lean key side's register cap (0: none)
# The lean value side in half precision at this many warps, uncapped (0: the cap above): two
# programs an SM (AOT bf16 D = 128: 255 registers, 72 B of stack; fp32 would spill 1.3-2.6 KB);
# H200, session 26 call 5: 0.556 → 0.516 ms at (8, 4096, 16, 128), 1.19 → 1.03 at D = 256.
GRADS_LEAN_V_HALF_WARPS = 4
# The fused gradient kernel (gradients_fused.py; issue 32, benchmarks/NOTES.md "Issue 32, session
# 19"): both sides in one program per (chunk, head), whole heads in one block each, no scratch.
# "off" | "on" (every launch: any dtype and head width, for tests and trials) | "auto": the
# half-precision launches whose key and value blocks are both at most FUSED_MAX_BLOCK ((16, 2048,
# 32, 64) bf16 is the shape it is for). "auto" at 4 warps since session 20: forward + backward
# there 3.187 → 3.083 ms (H200, call 2, with "t"; call 1: 3.375 → 3.264), and 3.155 → 3.051 with
# the rebuild at 8 warps; 8 warps lost +0.76 ms (session 19, call 3: 320 B of spills).
GRADS_FUSED = "auto"
FUSED_MAX_BLOCK = 64
# Its launch settings (0: Triton's own stages, 3 on Hopper; no register cap). AOT sm_90 counts
# at D = 64 bf16 in the NOTES section above.
GRADS_FUSED_WARPS = 4
GRADS_FUSED_STAGES = 0
GRADS_FUSED_MAXNREG = 0


def use_lean(Dk: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether a launch over heads of ``Dk`` / ``Dv`` columns (``dtype``: its dot dtype) takes
    the lean kernels (``GRADS_LEAN``)."""
    if GRADS_LEAN not in ("off", "on", "auto"):
        raise ValueError(f"gradients.GRADS_LEAN must be 'off', 'on' or 'auto', got {GRADS_LEAN!r}")
    if GRADS_LEAN == "auto":
        return key_block(Dk, Dv, dtype) >= LEAN_MIN_KEY_BLOCK
    return GRADS_LEAN == "on"


def use_fused(Dk: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether a launch over heads of ``Dk`` / ``Dv`` columns (``dtype``: its dot dtype) takes
    the fused kernel (``GRADS_FUSED``)."""
    if GRADS_FUSED not in ("off", "on", "auto"):
        raise ValueError(f"gradients.GRADS_FUSED must be 'off', 'on' or 'auto', "
                         f"got {GRADS_FUSED!r}")  # fmt: skip
    if GRADS_FUSED == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        blocks = (key_block(Dk, Dv, dtype), head_block(Dv, dtype))
        return half and max(blocks) <= FUSED_MAX_BLOCK
    return GRADS_FUSED == "on"


def scratch_matrices(Dk: int, Dv: int, dtype: torch.dtype) -> int:
    """C×C matrices per chunk and head of the scratch (``launch_gradients``' ``scratch_m``) the
    kernels in use take: M_P and M_A, none for the fused kernel."""
    return 0 if use_fused(Dk, Dv, dtype) else 2


def scratch_rows(Dk: int, Dv: int, dtype: torch.dtype) -> int:
    """Rows of the row scratch (``launch_gradients``' ``scratch_r``) the kernels in use take."""
    if use_fused(Dk, Dv, dtype):
        return 0
    if use_lean(Dk, Dv, dtype):
        from deltaflow.ops.triton.gradients_lean import LEAN_ROWS

        return LEAN_ROWS.value
    return 3


@triton.jit
def _load_t_transposed(t_ptr, c, i_h, H):
    """Tᵀ of chunk c and head i_h, as the prepare kernel stored it (prepare.t_dtype)."""
    return tl.trans(load_chunk_square(t_ptr, c, i_h, H))


@triton.jit
def _chunk_keys(
    q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
):
    """What both gradient kernels load for a chunk: q, k, β, λ = ‖k‖², a, b (0 past eos), γ,
    log α."""
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    b_q = load_rows(q_ptr, offs_t, mask_t, i_h, offs_k, offs_k < Dk, H, Dk)
    b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, offs_k < Dk, H, Dk)
    b_beta, b_g = load_gates(beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA, HAS_DECAY)
    k32 = b_k.to(tl.float32)
    lam = tl.sum(k32 * k32, axis=1)
    a, b = rule_table.strengths(b_beta, lam, b_g, eps, rule, neg)
    a = tl.where(mask_t, a, 0.0)
    b = tl.where(mask_t, b, 0.0)
    return b_q, b_k, b_beta, lam, a, b, tl.cumsum(b_g, axis=0), b_g


# The math of (9)-(12) in pieces that both plain kernels and the fused one
# (gradients_fused.py) call: inlined, so the plain kernels compile to what they did when the
# pieces were written in them (their SASS is unchanged, benchmarks/NOTES.md issue 32 session 19).


@triton.jit
def _value_block(T_t, b_do, b_u, b_du, b_v, b, dP, dUU, db, PREC: tl.constexpr):
    """One value block of the value side: dP += dO Uᵀ, dU Uᵀ and db (Σ dY ⊙ V, ``b_v`` fp32)
    with dY = Tᵀ dU; returns them and the block's dv = b·dY."""
    dP += tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
    # dY = Tᵀ dU: the gradient of Ũ = T diag(b) V, through (4)
    dY = tl.dot(T_t, b_du, input_precision=PREC)
    dUU += tl.dot(b_du, tl.trans(b_u), input_precision=PREC)
    db += tl.sum(dY * b_v, axis=1)
    return dP, dUU, db, b[:, None] * dY


@triton.jit
def _value_tail(dP, dYU, b_q, b_k, a, gamma, scale, PREC: tl.constexpr):
    """The value side after its value blocks (dP = dO Uᵀ, dYU = dY Uᵀ): M_P = scale·dP ⊙ D,
    M_A = dA ⊙ a_i D (fp32; the key side takes them in the dot dtype), da from A and dγ from
    the decay matrix D."""
    rows = tl.arange(0, CHUNK)
    decay = decay_matrix(gamma)
    QK = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    KK = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    dP = scale * dP
    # (11) dA = −(Tᵀ dU)(Ũ − W S_0)ᵀ = −dY Uᵀ on j < i, with A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j
    dA = tl.where(rows[:, None] > rows[None, :], -dYU, 0.0)
    da = tl.sum(dA * decay * KK, axis=1)
    # (12) the decay matrix e^{γ_i − γ_j} enters P (5) and A (3)
    dE = (dP * QK + dA * a[:, None] * KK) * decay
    dgamma = tl.sum(dE, axis=1) - tl.sum(dE, axis=0)
    return dP * decay, dA * a[:, None] * decay, da, dgamma


@triton.jit
def _state_block(b_do, b_u, S0, G, dQS, dKte, DT: tl.constexpr, PREC: tl.constexpr):
    """One value block of the key side's state products: dO S_0ᵀ and U Gᵀ accumulated."""
    dQS += tl.dot(b_do, tl.trans(S0.to(DT)), input_precision=PREC)
    dKte += tl.dot(b_u, tl.trans(G.to(DT)), input_precision=PREC)
    return dQS, dKte


@triton.jit
def _dx_block(b_du, S0, T_t, dUS, DT: tl.constexpr, PREC: tl.constexpr):
    """One value block of dX's product: dU S_0ᵀ accumulated (fp32 inputs: dX = −dY S_0ᵀ
    itself, dY = Tᵀ dU with ``T_t``; else ``T_t`` is unused)."""
    if DT == tl.float32:
        dY = tl.dot(T_t, b_du, input_precision=PREC)
        dUS -= tl.dot(dY, tl.trans(S0), input_precision=PREC)  # (dX itself)
    else:
        dUS += tl.dot(b_du, tl.trans(S0.to(DT)), input_precision=PREC)
    return dUS


@triton.jit
def _key_block(
    b_do, b_u, b_du, S0, G, T_t, dQS, dKte, dUS, gs, DT: tl.constexpr, PREC: tl.constexpr
):
    """One value block of the key side: dO S_0ᵀ, U Gᵀ, dU S_0ᵀ (or dX, :func:`_dx_block`) and
    G ⊙ S_0 accumulated."""
    dQS, dKte = _state_block(b_do, b_u, S0, G, dQS, dKte, DT, PREC)
    dUS = _dx_block(b_du, S0, T_t, dUS, DT, PREC)
    gs += G.to(tl.float32) * S0.to(tl.float32)
    return dQS, dKte, dUS, gs


@triton.jit
def _key_tail(
    dQS, dKte, dX, gs, b_q, b_k, b_beta, lam, a, b, gamma, b_g, M_P, M_A, da_v, dgamma_v, db,
    m_ptr, r_ptr, c, dq_ptr, dk_ptr, dbeta_ptr, dg_ptr, offs_t, mask_t, i_h, scale, eps, rule, neg,
    H: tl.constexpr, Dk: tl.constexpr, BK: tl.constexpr, HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr, PREC: tl.constexpr, SCRATCH: tl.constexpr,
):  # fmt: skip
    """The key side after its value blocks (dO S_0ᵀ, U Gᵀ, dX, G ⊙ S_0; the chunk's keys):
    dq, dk, dβ and d log α, stored. The value side's M_P, M_A (dot dtype) and da, dγ, db rows
    come as arguments, or with ``SCRATCH`` from the scratch (``m_ptr``, ``r_ptr``; chunk ``c``),
    each loaded where it is first used (the arguments are then None)."""
    rows = tl.arange(0, CHUNK)
    # the rule's derivatives while few registers are live (the rule is a runtime branch)
    da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg = rule_table.derivatives(
        b_beta, lam, b_g, eps, rule, neg
    )
    Gamma = tl.exp(gamma)
    gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
    to_end = tl.exp(gamma_last - gamma)
    k32 = b_k.to(tl.float32)
    if SCRATCH:
        r_offs = (c * H + i_h) * (3 * CHUNK) + rows
        m_offs = (c * H + i_h) * (2 * CHUNK * CHUNK) + rows[:, None] * CHUNK + rows[None, :]
        M_P = tl.load(m_ptr + m_offs)
    # (9) the output (5): diag(Γ) Q S_0 and P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}. dq is stored at
    # once: it and dO S_0ᵀ are dead before dk's terms are formed (at D = 64 the fused kernel's
    # key tail spilled [C, BK] fp32 tiles with both live; issue 32, session 22)
    d_Gamma = scale * tl.sum(b_q.to(tl.float32) * dQS, axis=1)
    dq = scale * Gamma[:, None] * dQS + tl.dot(M_P, b_k, input_precision=PREC)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
    k_mask = mask_t[:, None] & mask_k[None, :]
    tl.store(dq_ptr + k_offs, dq.to(dq_ptr.dtype.element_ty), mask=k_mask)
    dk = tl.dot(tl.trans(M_P), b_q, input_precision=PREC)
    # (10) the state update (6) through K̃ = diag(e^{γ_C − γ}) K
    dk += to_end[:, None] * dKte
    t = tl.sum(dKte * k32 * to_end[:, None], axis=1)
    # (11) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j (both keys), and X = diag(aΓ) K
    if SCRATCH:
        M_A = tl.load(m_ptr + CHUNK * CHUNK + m_offs)
    dk += tl.dot(M_A, b_k, input_precision=PREC)
    dk += tl.dot(tl.trans(M_A), b_k, input_precision=PREC)
    xk = tl.sum(dX * k32, axis=1)
    if SCRATCH:
        da_v = tl.load(r_ptr + r_offs)
    da = da_v + Gamma * xk
    if SCRATCH:
        db = tl.load(r_ptr + 2 * CHUNK + r_offs)
    dk += (a * Gamma)[:, None] * dX
    # (12) dγ: the decay matrix (from the value side), Γ_i, and γ_C through (6)
    if SCRATCH:
        dgamma_v = tl.load(r_ptr + CHUNK + r_offs)
    d_gamma = dgamma_v - t + (d_Gamma + a * xk) * Gamma
    d_gamma_last = tl.sum(t, axis=0) + tl.exp(gamma_last) * tl.sum(tl.sum(gs, axis=1), axis=0)
    d_gamma += tl.where(rows == CHUNK - 1, d_gamma_last, 0.0)
    d_log_alpha = tl.sum(d_gamma, axis=0) - tl.cumsum(d_gamma, axis=0) + d_gamma
    if rule_table.reads_decay(rule):  # gated_efla: log α also enters its strengths a and b
        d_log_alpha += da * da_dg + db * db_dg

    # The rule: a(β, λ), b(β, λ) with λ = ‖k‖², so dk += 2 dλ k
    dk += (2.0 * (da * da_dlam + db * db_dlam))[:, None] * k32

    tl.store(dk_ptr + k_offs, dk.to(dk_ptr.dtype.element_ty), mask=k_mask)
    if HAS_BETA:
        dbeta = da * da_dbeta + db * db_dbeta
        tl.store(dbeta_ptr + offs_t * H + i_h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)
    if HAS_DECAY:
        tl.store(dg_ptr + offs_t * H + i_h, d_log_alpha.to(dg_ptr.dtype.element_ty), mask=mask_t)


@triton.jit(do_not_specialize=["rule", "neg"])  # every rule: one compiled kernel (rules.py)
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
    """(9), (11) for one chunk and head, the value side: over value blocks dP = dO Uᵀ and
    dY = Tᵀ dU (so dv = b·dY, db = Σ dY ⊙ V) with dY Uᵀ; then the two C×C matrices the key side
    needs, M_P = scale·dP ⊙ e^{γ_i − γ_j} (j ≤ i) and M_A = dA ⊙ a_i e^{γ_i − γ_j} with
    dA = −dY Uᵀ on j < i, and three row vectors: da from A, dγ from the decay matrix, db."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    # The write strength b first; q, k and the rest are loaded again after the loop (from L2)
    # rather than kept in registers across it.
    _, _, _, _, _, b, _, _ = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)

    dP = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dO Uᵀ
    dUU = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dU Uᵀ (dY Uᵀ = Tᵀ dU Uᵀ after the loop)
    db = tl.zeros([CHUNK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = load_rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_v = load_rows(v_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        dP, dUU, db, dv = _value_block(T_t, b_do, b_u, b_du, b_v, b, dP, dUU, db, PREC)
        tl.store(
            dv_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            dv.to(dv_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )
    # dY Uᵀ as Tᵀ (dU Uᵀ): the same product with dY not rounded to DT (fla keeps it fp32; issue
    # 30 item 4): dU Uᵀ enters as a hi + lo pair, two C³ dots once rather than two per value
    # block (and no split dY live in the loop: 128 registers, not 181, at D = 64)
    dYU = dot_split(T_t, dUU, tl.zeros([CHUNK, CHUNK], dtype=tl.float32), DT, PREC)
    b_q, b_k, _, _, a, _, gamma, _ = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    M_P, M_A, da, dgamma = _value_tail(dP, dYU, b_q, b_k, a, gamma, scale, PREC)
    m_offs = (c * H + i_h) * (2 * CHUNK * CHUNK) + rows[:, None] * CHUNK + rows[None, :]
    tl.store(m_ptr + m_offs, M_P.to(m_ptr.dtype.element_ty))
    tl.store(m_ptr + CHUNK * CHUNK + m_offs, M_A.to(m_ptr.dtype.element_ty))
    r_offs = (c * H + i_h) * (3 * CHUNK) + rows
    tl.store(r_ptr + r_offs, da)
    tl.store(r_ptr + CHUNK + r_offs, dgamma)
    tl.store(r_ptr + 2 * CHUNK + r_offs, db)


@triton.jit(do_not_specialize=["rule", "neg"])
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
    """(9)–(12) for one chunk and head, the key side. Over value blocks: dO S_0ᵀ (q's part
    through diag(Γ) Q S_0), U Gᵀ (the surviving keys' part of (6)) and dX = −dY S_0ᵀ (the
    gradient of X = diag(aΓ) K in W = T X). Then dq, dk, the rule's dβ and dλ (dk += 2 dλ k),
    and d log α as a reverse cumulative sum of dγ inside the chunk."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    # fp32 inputs: dX = −dY S_0ᵀ per value block (dY = Tᵀ dU), as fp32 as the reassociated
    # form below, whose final fp32 product would need 240 KB of shared memory at D = 256
    PER_BLOCK: tl.constexpr = DT == tl.float32
    T_t = None
    if PER_BLOCK:
        T_t = _load_t_transposed(t_ptr, c, i_h, H)
    dQS = tl.zeros([CHUNK, BK], dtype=tl.float32)  # dO S_0ᵀ
    dKte = tl.zeros([CHUNK, BK], dtype=tl.float32)  # U Gᵀ
    dUS = tl.zeros([CHUNK, BK], dtype=tl.float32)  # dU S_0ᵀ (dX = −Tᵀ dU S_0ᵀ after; fp32: dX)
    gs = tl.zeros([BK, BV], dtype=tl.float32)  # G ⊙ S_0, summed at the end
    for i_v in range(0, tl.cdiv(Dv, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < Dv
        b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        b_du = load_rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
        state_offs = (c * H + i_h) * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :]
        state_mask = mask_k[:, None] & mask_v[None, :]
        S0 = tl.load(h_ptr + state_offs, mask=state_mask, other=0.0)
        G = tl.load(dh_ptr + state_offs, mask=state_mask, other=0.0)
        dQS, dKte, dUS, gs = _key_block(b_do, b_u, b_du, S0, G, T_t, dQS, dKte, dUS, gs, DT, PREC)
    # dX = −dY S_0ᵀ as −Tᵀ (dU S_0ᵀ), dU S_0ᵀ a hi + lo pair (as the value side's dY Uᵀ)
    if PER_BLOCK:
        dX = dUS
    else:
        T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)
        dX = -dot_split(T_t, dUS, tl.zeros([CHUNK, BK], dtype=tl.float32), DT, PREC)

    b_q, b_k, b_beta, lam, a, b, gamma, b_g = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    _key_tail(
        dQS, dKte, dX, gs, b_q, b_k, b_beta, lam, a, b, gamma, b_g, None, None, None, None, None,
        m_ptr, r_ptr, c, dq_ptr, dk_ptr, dbeta_ptr, dg_ptr, offs_t, mask_t, i_h, scale, eps, rule,
        neg, H, Dk, BK, HAS_BETA, HAS_DECAY, PREC, True,
    )  # fmt: skip


def pointer_params(kernel: Any) -> tuple[str, ...]:
    """``kernel``'s tensor parameters (its ``*_ptr`` arguments; a ``triton.jit`` function, or the
    interpreter's), in its signature's order: the entries of ``launch_gradients``' ``pointers``
    it takes, so that each gradient kernel's list of tensors is its signature and nowhere else.
    Read once, at import: a test may stand a recorder in for the kernel afterwards."""
    return tuple(name for name in kernel.arg_names if name.endswith("_ptr"))


def take(pointers: dict[str, Tensor], params: tuple[str, ...]) -> dict[str, Tensor]:
    """The launch keywords of the tensors ``params`` (``pointer_params``) names."""
    return {name: pointers[name] for name in params}


# Each kernel's tensors, from its signature
V_POINTERS = pointer_params(chunk_grads_v_kernel)
K_POINTERS = pointer_params(chunk_grads_k_kernel)


def launch_gradients(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    t: Tensor,
    h: Tensor,
    v_new: Tensor,
    dh: Tensor,
    du: Tensor,
    grad_o: Tensor,
    tables: ChunkTables,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    scratch_m: Tensor,
    scratch_r: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dbeta: Tensor | None,
    dlog_decay: Tensor | None,
) -> None:
    """(9)–(12) for every chunk: ``dq``, ``dk``, ``dv`` and, where given, ``dbeta`` and
    ``dlog_decay``. ``scratch_m`` ([chunks, H, scratch_matrices(), CHUNK, CHUNK], dot dtype) and
    ``scratch_r`` ([chunks, H, scratch_rows(), CHUNK], fp32) carry the value side's results to
    the key side (both empty for the fused kernel, which keeps them in registers)."""
    if tables.n_chunks == 0:
        return
    H, Dk, Dv = q.shape[2], q.shape[3], v.shape[3]
    fp32 = q.dtype == torch.float32
    # Every gradient kernel's tensors by parameter name, each kernel taking those its signature
    # names (pointer_params); the rest of a launch's keywords are its settings below
    pointers = dict(
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        beta_ptr=q if beta is None else beta,  # absent pointers are never read: flags say so
        g_ptr=q if log_decay is None else log_decay,
        t_ptr=t,
        h_ptr=h,
        dh_ptr=dh,
        v_new_ptr=v_new,
        du_ptr=du,
        do_ptr=grad_o,
        m_ptr=scratch_m,
        r_ptr=scratch_r,
        dq_ptr=dq,
        dk_ptr=dk,
        dv_ptr=dv,
        dbeta_ptr=q if dbeta is None else dbeta,
        dg_ptr=q if dlog_decay is None else dlog_decay,
        chunk_spans_ptr=tables.chunk_spans,
    )
    common = dict(
        scale=scale,
        eps=eps,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=key_block(Dk, Dv, q.dtype),
        BV=min(head_block(Dv, q.dtype), GRADS_BV_FP32 if fp32 else GRADS_BV),
        rule=kernel_id,
        neg=int(negative_eigenvalues),
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        PREC=dot_precision(q.dtype),
        num_warps=GRADS_WARPS,
    )
    key_side = dict(common)  # the key side's exact fp32 dots at wide key blocks (see above)
    if fp32 and common["BK"] > GRADS_K_TF32X3_MAX_BK:
        key_side["PREC"] = "ieee"
    grid = (tables.n_chunks, H)
    v_options = {"maxnreg": GRADS_V_MAXNREG} if GRADS_V_MAXNREG else {}  # 0 or None: no cap
    if use_fused(Dk, Dv, q.dtype):  # whole heads: one value block
        from deltaflow.ops.triton.gradients_fused import launch_fused

        options = {**key_side, "BV": head_block(Dv, q.dtype), "num_warps": GRADS_FUSED_WARPS}
        options.update({"num_stages": GRADS_FUSED_STAGES} if GRADS_FUSED_STAGES else {})
        options.update({"maxnreg": GRADS_FUSED_MAXNREG} if GRADS_FUSED_MAXNREG else {})
        launch_fused(pointers, options, grid)
        return
    if h.dtype == torch.float32:  # fp32 states: narrower value blocks (shared memory)
        key_side["BV"] = min(head_block(Dv, q.dtype), GRADS_BV_FP32)
    if use_lean(Dk, Dv, q.dtype):
        from deltaflow.ops.triton.gradients_lean import LEAN_ROWS, launch_lean

        if scratch_r.shape[2] != LEAN_ROWS.value:  # a buffer sized before the switch flipped
            raise ValueError(f"scratch_r has {scratch_r.shape[2]} rows, the lean kernels "
                             f"take {LEAN_ROWS.value} (scratch_rows)")  # fmt: skip
        stages = {"num_stages": GRADS_LEAN_STAGES} if GRADS_LEAN_STAGES else {}
        capped = GRADS_LEAN_V_MAXNREG and common["BK"] <= GRADS_LEAN_V_MAXNREG_MAX_BK
        v_options = {"maxnreg": GRADS_LEAN_V_MAXNREG} if capped else {}
        if not fp32 and GRADS_LEAN_V_HALF_WARPS:  # half precision: these warps, no cap
            v_options = {"num_warps": GRADS_LEAN_V_HALF_WARPS}
        min_bk = GRADS_LEAN_DQ_FIRST_MIN_BK
        key_side["DQ_FIRST"] = bool(min_bk) and key_side["BK"] >= min_bk
        key_side["num_warps"] = GRADS_LEAN_K_WARPS or key_side["num_warps"]
        key_side.update({"maxnreg": GRADS_LEAN_K_MAXNREG} if GRADS_LEAN_K_MAXNREG else {})
        launch_lean(pointers, {**common, **stages, **v_options}, {**key_side, **stages}, grid)
        return
    if not fp32 and GRADS_K_HALF_WARPS:  # the plain key side (the lean pair returned above)
        key_side["num_warps"] = GRADS_K_HALF_WARPS
    chunk_grads_v_kernel[grid](**take(pointers, V_POINTERS), **common, **v_options)
    chunk_grads_k_kernel[grid](**take(pointers, K_POINTERS), **key_side)
