"""The Triton backend: launches the kernels of ``ops/triton/kernels.py`` behind ``torch.library``
custom ops (with fake implementations and autograd), so ``torch.compile(fullgraph=True)`` traces
through ``delta_rule`` without graph breaks.

Backward: an opaque custom op recomputes the chunked PyTorch algorithm (``ops/chunk.py``) from
the saved inputs and applies its hand-derived chunked backward through ``torch.func.vjp``. It is
exact but not fused; a fused Triton backward is the next step (benchmarks/NOTES.md).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton

    from deltaflow.ops.triton import backward, kernels
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    kernels = backward = None

RULE_CODES = {
    "linear": 0,
    "delta": 1,
    "efla": 2,
    "longhorn": 3,
    "trapezoid": 4,
    "kaczmarz": 5,
    "relaxed_kaczmarz": 6,
}
RULE_NAMES = {code: name for name, code in RULE_CODES.items()}

# Checking scripts set this to fill outputs with NaN before each launch, so that any element a
# kernel fails to write shows up as NaN instead of stale memory.
POISON_OUTPUTS = False


def _output(*shape, like: Tensor, dtype: torch.dtype) -> Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Triton is importable and there is a GPU, or the CPU interpreter is switched on."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _sequences(cu_seqlens: Tensor | None, B: int, T: int, C: int, device) -> tuple:
    """Offsets of the sequences in the flattened [B·T] token axis, and their chunk tables."""
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        per_seq = torch.full((B,), triton.cdiv(T, C), device=device, dtype=torch.int32)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        per_seq = (cu[1:] - cu[:-1] + C - 1) // C
    chunk_offsets = torch.zeros(per_seq.numel() + 1, device=device, dtype=torch.int32)
    chunk_offsets[1:] = per_seq.cumsum(0)
    # (sequence, chunk-in-sequence) for every chunk: the prepare kernel's grid.
    n_chunks = B * triton.cdiv(T, C) if cu_seqlens is None else int(chunk_offsets[-1])
    seq_of_chunk = torch.repeat_interleave(
        torch.arange(per_seq.numel(), device=device, dtype=torch.int32),
        per_seq.long(),
        output_size=n_chunks,
    )
    chunk_in_seq = torch.arange(n_chunks, device=device, dtype=torch.int32) - chunk_offsets[
        :-1
    ].long()[seq_of_chunk.long()].to(torch.int32)
    chunk_indices = torch.stack([seq_of_chunk, chunk_in_seq], dim=1).contiguous()
    return cu, chunk_offsets, chunk_indices, n_chunks


def _launch_prepare(k, v, beta, log_decay, cu, chunk_indices, n_chunks, rule, neg, eps, store_t):
    """(3)–(4): W and Ũ laid out like k and v, and T = (I + A)^{-1} per chunk when asked."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dot_dtype = k.dtype
    # W = T diag(aΓ) K and Ũ = T diag(b) V (rows past a sequence's end are never written nor read)
    w = _output(B, T, H, Dk, like=k, dtype=dot_dtype)
    u = _output(B, T, H, Dv, like=k, dtype=dot_dtype)
    t = _output(max(n_chunks, 1) if store_t else 1, H, 64, 64, like=k, dtype=torch.float32)
    # per chunk and head: the first token with a non-finite input (64: none)
    first_bad = _output(max(n_chunks, 1), H, like=k, dtype=torch.int32)
    if n_chunks > 0:
        kernels.chunk_prepare_kernel[(n_chunks, H)](
            k,
            v,
            k if beta is None else beta,  # absent pointers are never read: the flags say so
            k if log_decay is None else log_decay,
            w,
            u,
            t,
            first_bad,
            cu,
            chunk_indices,
            eps,
            H=H,
            Dk=Dk,
            Dv=Dv,
            BK=_block(Dk),
            BV=_block(Dv),
            RULE=rule,
            NEG=bool(neg),
            HAS_BETA=beta is not None,
            HAS_DECAY=log_decay is not None,
            PREC=_precision(dot_dtype),
            LOW_PRECISION_DOTS=PREPARE_LOW_PRECISION_DOTS and dot_dtype != torch.float32,
            STORE_T=store_t,
            num_warps=PREPARE_WARPS,
        )
    return w, u, t, first_bad


def _precision(dot_dtype) -> str:
    return "ieee" if dot_dtype == torch.float32 else "tf32"


def _launch_states(k, w, u, log_decay, s0, first_bad, cu, chunk_offsets, n_chunks, N, BV):
    """(4), (6) sequentially per sequence: S_0 of every chunk (h), U = Ũ − W S_0, final state."""
    B, T, H, Dk = k.shape
    Dv = u.shape[-1]
    h = _output(max(n_chunks, 1), H, Dk, Dv, like=k, dtype=k.dtype)
    v_new = _output(B, T, H, Dv, like=k, dtype=k.dtype)
    final_state = _output(N, H, Dk, Dv, like=k, dtype=torch.float32)
    backward.chunk_states_kernel[(triton.cdiv(Dv, BV), N * H)](
        k,
        w,
        u,
        k if log_decay is None else log_decay,
        k if s0 is None else s0,
        h,
        v_new,
        final_state,
        first_bad,
        cu,
        chunk_offsets,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=_block(Dk),
        BV=BV,
        HAS_DECAY=log_decay is not None,
        HAS_S0=s0 is not None,
        PREC=_precision(k.dtype),
        num_warps=STATES_WARPS,
        num_stages=STATES_STAGES,
    )
    return h, v_new, final_state


def _inputs(q, k, v, beta, log_decay, initial_state):
    """Operands in the matrix units' dtype (bf16/fp16 as given, else fp32), contiguous."""
    dot_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, k, v = (x.to(dot_dtype).contiguous() for x in (q, k, v))
    beta = None if beta is None else beta.contiguous()
    log_decay = None if log_decay is None else log_decay.contiguous()
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    return q, k, v, beta, log_decay, s0


def _use_two_pass(N: int, H: int, Dv: int, device) -> bool:
    """The fused sequential kernel runs N·H·(Dv/64) programs; with fewer than the GPU has
    multiprocessors, split the state pass (more, narrower programs) from the output."""
    if FORWARD_MODE != "auto":
        return FORWARD_MODE == "two_pass"
    if interpreting():
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return N * H * triton.cdiv(Dv, 64) < sms


def _forward(
    q,
    k,
    v,
    beta,
    log_decay,
    initial_state,
    cu_seqlens,
    rule,
    negative_eigenvalues,
    eps,
    scale,
    chunk_size,
) -> tuple[Tensor, Tensor]:
    # The kernels use chunks of 64 tokens whatever `chunk_size` says: the result is the same
    # function, and 64 is what the 16-row block substitution of the prepare kernel is built for.
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    v_dtype = v.dtype
    q, k, v, beta, log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    cu, chunk_offsets, chunk_indices, n_chunks = _sequences(cu_seqlens, B, T, 64, q.device)
    N = cu.numel() - 1
    BK = _block(Dk)
    w, u, _, first_bad = _launch_prepare(
        k, v, beta, log_decay, cu, chunk_indices, n_chunks, rule, negative_eigenvalues, eps, False
    )
    o = _output(B, T, H, Dv, like=q, dtype=v_dtype)
    if _use_two_pass(N, H, Dv, q.device):
        BV = min(_block(Dv), TWO_PASS_BV)
        h, v_new, final_state = _launch_states(
            k, w, u, log_decay, s0, first_bad, cu, chunk_offsets, n_chunks, N, BV
        )
        if n_chunks > 0:
            BVo = min(_block(Dv), 64)
            backward.chunk_output_kernel[(triton.cdiv(Dv, BVo), n_chunks, H)](
                q,
                k,
                h,
                v_new,
                q if log_decay is None else log_decay,
                o,
                first_bad,
                cu,
                chunk_indices,
                scale,
                H=H,
                Dk=Dk,
                Dv=Dv,
                BK=BK,
                BV=BVo,
                HAS_DECAY=log_decay is not None,
                PREC=_precision(q.dtype),
                num_warps=4,
            )
        return o, final_state

    final_state = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
    # 64 value columns, 4 warps (benchmarks/NOTES.md). Triton 3.6 on Hopper miscompiles this
    # kernel with 16/32 columns in bf16 (compute-sanitizer: invalid __shared__ read).
    BV = min(_block(Dv), 32 if q.dtype == torch.float32 else 64)
    kernels.chunk_forward_kernel[(triton.cdiv(Dv, BV), N * H)](
        q,
        k,
        w,
        u,
        q if log_decay is None else log_decay,
        q if s0 is None else s0,
        o,
        final_state,
        first_bad,
        cu,
        chunk_offsets,
        scale,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BV,
        HAS_DECAY=log_decay is not None,
        HAS_S0=s0 is not None,
        PREC=_precision(q.dtype),
        num_warps=4,
        num_stages=1,
    )
    return o, final_state


def _backward_fused(
    q, k, v, beta, log_decay, initial_state, cu_seqlens, grad_o, grad_state, rule, neg, eps, scale
) -> list[Tensor | None]:
    """The fused backward: prepare (W, Ũ, T) and state pass recomputed from the inputs, then the
    reverse state-gradient pass and the parallel per-chunk gradients. Four launches."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dtypes = [None if x is None else x.dtype for x in (q, k, v, beta, log_decay, initial_state)]
    q, k, v, beta, log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    do = grad_o.to(q.dtype).contiguous()
    dsT = grad_state.to(torch.float32).contiguous()
    cu, chunk_offsets, chunk_indices, n_chunks = _sequences(cu_seqlens, B, T, 64, q.device)
    N = cu.numel() - 1
    BK = _block(Dk)
    w, u, t, first_bad = _launch_prepare(
        k, v, beta, log_decay, cu, chunk_indices, n_chunks, rule, neg, eps, True
    )
    h, v_new, _ = _launch_states(
        k,
        w,
        u,
        log_decay,
        s0,
        first_bad,
        cu,
        chunk_offsets,
        n_chunks,
        N,
        min(_block(Dv), BWD_STATES_BV),
    )
    dummy = q
    dh = _output(max(n_chunks, 1), H, Dk, Dv, like=q, dtype=q.dtype)
    du = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    ds0 = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
    BVd = min(_block(Dv), DSTATES_BV)
    backward.chunk_dstates_kernel[(triton.cdiv(Dv, BVd), N * H)](
        q,
        k,
        w,
        dummy if log_decay is None else log_decay,
        do,
        dsT,
        dh,
        du,
        ds0,
        cu,
        chunk_offsets,
        scale,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BVd,
        HAS_DECAY=log_decay is not None,
        HAS_DST=True,
        PREC=_precision(q.dtype),
        num_warps=DSTATES_WARPS,
        num_stages=DSTATES_STAGES,
    )
    dq = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dk = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dv = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    dbeta = None if beta is None else _output(*beta.shape, like=q, dtype=torch.float32)
    dg = None if log_decay is None else _output(*log_decay.shape, like=q, dtype=torch.float32)
    if n_chunks > 0:
        common = dict(
            H=H,
            Dk=Dk,
            Dv=Dv,
            BK=BK,
            # fp32 operands take twice the shared memory: 32 value columns there
            BV=min(_block(Dv), GRADS_BV if q.dtype != torch.float32 else 32),
            RULE=rule,
            NEG=bool(neg),
            HAS_BETA=beta is not None,
            HAS_DECAY=log_decay is not None,
            PREC=_precision(q.dtype),
            num_warps=GRADS_WARPS,
        )
        beta_arg = dummy if beta is None else beta
        g_arg = dummy if log_decay is None else log_decay
        # Value side → M_P, M_A (C×C per chunk, dot dtype) and three row vectors (fp32).
        m = _output(n_chunks, H, 2, 64, 64, like=q, dtype=q.dtype)
        r = _output(n_chunks, H, 3, 64, like=q, dtype=torch.float32)
        backward.chunk_grads_v_kernel[(n_chunks, H)](
            q,
            k,
            v,
            beta_arg,
            g_arg,
            t,
            v_new,
            du,
            do,
            dv,
            m,
            r,
            cu,
            chunk_indices,
            scale,
            eps,
            **common,
        )
        backward.chunk_grads_k_kernel[(n_chunks, H)](
            q,
            k,
            beta_arg,
            g_arg,
            t,
            h,
            dh,
            v_new,
            du,
            do,
            m,
            r,
            dq,
            dk,
            dummy if dbeta is None else dbeta,
            dummy if dg is None else dg,
            cu,
            chunk_indices,
            scale,
            eps,
            **common,
        )
    grads = [dq, dk, dv, dbeta, dg, ds0 if initial_state is not None else None]
    return [None if g is None else g.to(d) for g, d in zip(grads, dtypes)]


# Launch settings (benchmarks/NOTES.md). Low-precision dots: the prepare kernel's small products
# take bf16/fp16 operands (as fla does) instead of tf32; accumulation stays fp32.
PREPARE_LOW_PRECISION_DOTS = True
PREPARE_WARPS = 2
FORWARD_MODE = "auto"  # "auto" | "fused" | "two_pass"
TWO_PASS_BV = 64  # 32 crashes in bf16 on Hopper with Triton 3.6 (illegal memory access)
STATES_WARPS = 4
STATES_STAGES = 1
BWD_STATES_BV = 64
DSTATES_BV = 64
DSTATES_WARPS = 4
DSTATES_STAGES = 1
GRADS_BV = 64
GRADS_WARPS = 8


# ---------------------------------------------------------------------------------------------
# Custom ops. Optional tensors travel as `Tensor?`; the rule as its integer code.


@torch.library.custom_op("deltaflow::chunk_fwd", mutates_args=())
def chunk_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    rule: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    return _forward(
        q,
        k,
        v,
        beta,
        log_decay,
        initial_state,
        cu_seqlens,
        rule,
        negative_eigenvalues,
        eps,
        scale,
        chunk_size,
    )


@chunk_fwd_op.register_fake
def _(
    q,
    k,
    v,
    beta,
    log_decay,
    initial_state,
    cu_seqlens,
    rule,
    negative_eigenvalues,
    eps,
    scale,
    chunk_size,
):
    B, T, H, Dk = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (
        q.new_empty(B, T, H, v.shape[-1], dtype=v.dtype),
        q.new_empty(N, H, Dk, v.shape[-1], dtype=torch.float32),
    )


@torch.library.custom_op("deltaflow::chunk_bwd", mutates_args=())
def chunk_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    grad_o: Tensor,
    grad_state: Tensor,
    rule: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    chunk_size: int,
) -> list[Tensor]:
    grads = _backward_fused(
        q,
        k,
        v,
        beta,
        log_decay,
        initial_state,
        cu_seqlens,
        grad_o,
        grad_state,
        rule,
        negative_eigenvalues,
        eps,
        scale,
    )
    return [q.new_empty(0) if g is None else g for g in grads]


@chunk_bwd_op.register_fake
def _(
    q,
    k,
    v,
    beta,
    log_decay,
    initial_state,
    cu_seqlens,
    grad_o,
    grad_state,
    rule,
    negative_eigenvalues,
    eps,
    scale,
    chunk_size,
):
    return [
        q.new_empty(0) if x is None else torch.empty_like(x)
        for x in (q, k, v, beta, log_decay, initial_state)
    ]


def _setup_context(ctx, inputs, output):
    q, k, v, beta, log_decay, initial_state, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, beta, log_decay, initial_state, cu_seqlens)
    ctx.options = options


def _backward(ctx, grad_o, grad_state):
    q, k, v, beta, log_decay, initial_state, cu_seqlens = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    if grad_state is None:
        B, _, H, Dk = q.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        grad_state = q.new_zeros(N, H, Dk, v.shape[-1], dtype=torch.float32)
    grads = chunk_bwd_op(
        q, k, v, beta, log_decay, initial_state, cu_seqlens, grad_o, grad_state, *ctx.options
    )
    present = [q, k, v, beta, log_decay, initial_state]
    grads = [None if x is None else g for x, g in zip(present, grads)]
    return (*grads, None, None, None, None, None, None)


chunk_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("deltaflow::decode_step", mutates_args=("state",))
def decode_step_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    log_decay: Tensor | None,
    state: Tensor,
    rule: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
) -> Tensor:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = _output(B, T, H, Dv, like=q, dtype=v.dtype)
    BK, BV = _block(Dk), min(_block(Dv), 32)
    kernels.decode_kernel[(triton.cdiv(Dv, BV), B * H)](
        q,
        k,
        v,
        q if beta is None else beta.contiguous(),
        q if log_decay is None else log_decay.contiguous(),
        state,
        o,
        scale,
        eps,
        T,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BV,
        RULE=rule,
        NEG=negative_eigenvalues,
        HAS_BETA=beta is not None,
        HAS_DECAY=log_decay is not None,
        num_warps=4,
    )
    return o


@decode_step_op.register_fake
def _(q, k, v, beta, log_decay, state, rule, negative_eigenvalues, eps, scale):
    return torch.empty_like(v)


# ---------------------------------------------------------------------------------------------
# Entry points called by deltaflow.ops after argument checks.


def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    rule: str,
    log_decay,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    initial_state,
    output_final_state: bool,
    cu_seqlens,
    chunk_size: int,
) -> tuple[Tensor, Tensor | None]:
    o, state = chunk_fwd_op(
        q,
        k,
        v,
        beta,
        log_decay,
        initial_state,
        cu_seqlens,
        RULE_CODES[rule],
        negative_eigenvalues,
        eps,
        scale,
        chunk_size,
    )
    return o, (state if output_final_state else None)


def delta_rule_step(
    q,
    k,
    v,
    beta,
    state,
    *,
    rule: str,
    log_decay,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
) -> Tensor:
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("the Triton decode step needs a contiguous float32 state")
    return decode_step_op(
        q, k, v, beta, log_decay, state, RULE_CODES[rule], negative_eigenvalues, eps, scale
    )
