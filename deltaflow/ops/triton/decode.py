"""Stage 4, generation: a few tokens applied to an fp32 state in place, token by token,
(1)–(2) of docs/design.md §1. One program per (sequence, head, block of value columns); no
host sync, so a model's decode step can be captured in a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import rules as rule_table
from deltaflow.ops.triton.common import cdiv, head_block

# Launch settings.
DECODE_BV = 32
DECODE_WARPS = 4


@triton.jit(do_not_specialize=["rule", "neg"])  # every rule: one compiled kernel (rules.py)
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
    rule,
    neg,
    T,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_DECAY: tl.constexpr,
):
    """T tokens of one sequence, for one head and BV value columns: (1)–(2) token by token on
    the fp32 state, which is read once and written back once."""
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
        if HAS_DECAY:
            b_g = tl.load(g_ptr + tok * H + i_h).to(tl.float32)
        else:
            b_g = 0.0
        lam = tl.sum(b_k * b_k, axis=0)
        a, b = rule_table.strengths(b_beta, lam, b_g, eps, rule, neg)
        kS = tl.sum(b_k[:, None] * S, axis=0)  # prediction kᵀS
        # (1) S_t = α_t (S − a k (kᵀS)) + b k vᵀ
        S = S - a * b_k[:, None] * kS[None, :]
        if HAS_DECAY:
            S = tl.exp(b_g) * S
        S = S + b * b_k[:, None] * b_v[None, :]
        b_o = scale * tl.sum(b_q[:, None] * S, axis=0)  # (2) o_t = scale·S_tᵀq_t
        tl.store(o_ptr + (tok * H + i_h) * Dv + offs_v, b_o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_ptr + state_offs, S, mask=state_mask)


def launch_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    state: Tensor,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    o: Tensor,
) -> None:
    """Apply the T tokens of q, k, v ([B, T, H, D], contiguous) to ``state`` ([B, H, Dk, Dv]
    fp32, contiguous) in place, writing ``o``."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    # No dtype floor (common.HALF_MIN_BLOCK) and no fp32 routing of narrow half-precision heads
    # (triton_ops.HALF_MIN_HEAD), unlike the chunked kernels: this kernel has no tl.dot, hence
    # none of the mma.sync/wgmma layouts Triton 3.6 miscompiled at 16-column half blocks, and it
    # converts q, k, v to fp32 as it loads them, so every product and sum is fp32 whatever the
    # inputs' dtype (elementwise products and tl.sum reductions on an fp32 state).
    BV = min(head_block(Dv), DECODE_BV)
    decode_kernel[(cdiv(Dv, BV), B * H)](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        beta_ptr=q if beta is None else beta,
        g_ptr=q if log_decay is None else log_decay,
        state_ptr=state,
        o_ptr=o,
        scale=scale,
        eps=eps,
        T=T,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=head_block(Dk),
        BV=BV,
        rule=kernel_id,
        neg=int(negative_eigenvalues),
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        num_warps=DECODE_WARPS,
    )


def decode_tokens(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    state: Tensor,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    output: Callable[..., Tensor],
) -> Tensor:
    """The decode op's body: the layer's inputs made contiguous and its log decay the op's
    (rules.op_log_decay), then :func:`launch_decode` into an ``output(B, T, H, Dv, like=q,
    dtype=v.dtype)`` buffer (the backend's allocator, which poisons it in checking runs)."""
    B, T, H, _ = q.shape
    o = output(B, T, H, v.shape[-1], like=q, dtype=v.dtype)
    launch_decode(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        beta=None if beta is None else beta.contiguous(),
        log_decay=rule_table.op_log_decay(
            kernel_id, None if log_decay is None else log_decay.contiguous()
        ),
        state=state,
        kernel_id=kernel_id,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
        o=o,
    )
    return o
