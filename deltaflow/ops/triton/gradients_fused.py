"""The backward's gradient kernels as one, for small heads (issue 32; benchmarks/NOTES.md, "Issue
32, session 19"): (9)–(12) of docs/design.md §7 in one program per (chunk, head), selected by
``gradients.GRADS_FUSED`` ("auto": half-precision launches whose key and value heads each fit
one block of at most ``gradients.FUSED_MAX_BLOCK`` columns).

The pair in ``gradients.py`` runs the value side, writes M_P, M_A (two C×C tiles in the dot
dtype) and three fp32 rows to a scratch, and the key side reads them back; both load q, k, T,
dO, U and dU. Here every input is loaded once and the value side's results stay in registers.
The math is the pair's own jit pieces (``_value_block``, ``_value_tail``, ``_key_block``,
``_key_tail``), called in the pair's order, so the roundings are theirs: M_P and M_A enter the
key side's products rounded to the dot dtype exactly as the scratch stored them, and the
gradients agree with the pair's to fp32 summation order (bit for bit on the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton.common import (
    CHUNK,
    chunk_bounds,
    dot_split,
    load_rows,
    store_rows,
)
from deltaflow.ops.triton.gradients import (
    _chunk_keys,
    _dx_block,
    _key_tail,
    _load_t_transposed,
    _state_block,
    _value_block,
    _value_tail,
    pointer_params,
    take,
)


@triton.jit(do_not_specialize=["rule", "neg"])  # every rule: one compiled kernel (rules.py)
def chunk_grads_fused_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    h_ptr,
    dh_ptr,
    v_new_ptr,
    du_ptr,
    do_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
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
    """(9)–(12) for one chunk and head, whole heads (``BK`` ≥ Dk, ``BV`` ≥ Dv): the value side
    (dv; M_P, M_A, da, dγ, db kept), then the key side (dq, dk, dβ, d log α) on them."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty
    c = i_c.to(tl.int64)
    offs_t = t0 + tl.arange(0, CHUNK)
    mask_t = offs_t < eos
    offs_v = tl.arange(0, BV)
    mask_v = offs_v < Dv
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    b_q, b_k, b_beta, lam, a, b, gamma, b_g = _chunk_keys(
        q_ptr, k_ptr, beta_ptr, g_ptr, t0, eos, i_h, eps, H, Dk, BK, rule, neg, HAS_BETA, HAS_DECAY
    )
    T_t = _load_t_transposed(t_ptr, c, i_h, H).to(DT)
    b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    b_du = load_rows(du_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    b_v = load_rows(v_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)

    # the value side, its one value block
    zeros_cc = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dP, dUU, db, dv = _value_block(
        T_t, b_do, b_u, b_du, b_v, b, zeros_cc, zeros_cc, tl.zeros([CHUNK], dtype=tl.float32), PREC
    )
    store_rows(dv_ptr, dv, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    dYU = dot_split(T_t, dUU, zeros_cc, DT, PREC)  # dY Uᵀ = Tᵀ (dU Uᵀ), gradients.py says why
    # dX before the value side's C×C tail, so that Tᵀ is not live across it; ⟨G, S_0⟩ summed at
    # once (as the plain kernel sums its one-block tile: the same fp32 order)
    state_offs = (c * H + i_h) * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    S0 = tl.load(h_ptr + state_offs, mask=state_mask, other=0.0)
    G = tl.load(dh_ptr + state_offs, mask=state_mask, other=0.0)
    zeros_ck = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dX = _dx_block(b_du, S0, T_t, zeros_ck, DT, PREC)
    if DT != tl.float32:  # dX = −Tᵀ (dU S_0ᵀ), dU S_0ᵀ a hi + lo pair (as the key-side kernel)
        dX = -dot_split(T_t, dX, zeros_ck, DT, PREC)
    gs = tl.sum(G.to(tl.float32) * S0.to(tl.float32), axis=1, keep_dims=True)
    gs = tl.sum(gs, axis=0, keep_dims=True)
    M_P, M_A, da, dgamma = _value_tail(dP, dYU, b_q, b_k, a, gamma, scale, PREC)
    # rounded to the dot dtype at once, as the pair's scratch stores them
    M_P = M_P.to(DT)
    M_A = M_A.to(DT)
    dQS, dKte = _state_block(b_do, b_u, S0, G, zeros_ck, zeros_ck, DT, PREC)
    # the keys again (L1/L2) for the key side: a new value, so the compiler does not keep the
    # first load's fp32 copy (‖k‖²'s) live across the value side (spilled at D = 64)
    b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
    _key_tail(
        dQS, dKte, dX, gs, b_q, b_k, b_beta, lam, a, b, gamma, b_g, M_P, M_A, da,
        dgamma, db, None, None, c, dq_ptr, dk_ptr, dbeta_ptr, dg_ptr, offs_t, mask_t, i_h, scale,
        eps, rule, neg, H, Dk, BK, HAS_BETA, HAS_DECAY, PREC, False,
    )  # fmt: skip


# Its tensors, from its signature (both sides' but the scratch; gradients.pointer_params)
FUSED_POINTERS = pointer_params(chunk_grads_fused_kernel)


def launch_fused(pointers: dict[str, Tensor], options: dict, grid: tuple[int, int]) -> None:
    """The fused kernel over ``grid`` (chunks, heads); ``pointers``, ``options``:
    ``gradients.launch_gradients``' tensors and its launch settings for it (whole-head blocks,
    the fused launch settings)."""
    chunk_grads_fused_kernel[grid](**take(pointers, FUSED_POINTERS), **options)
