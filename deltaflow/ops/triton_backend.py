"""The Triton backend: the kernels of ``deltaflow/ops/triton/`` assembled into a forward, a
fused backward and a decode step, behind ``torch.library`` custom ops (with fake
implementations and autograd), so ``torch.compile(fullgraph=True)`` traces through
``delta_rule`` without graph breaks. The algorithm and its equations: docs/design.md §3, §7.

Forward (two or three launches, chunks of ``CHUNK`` = 64 tokens):
  prepare (``triton/prepare.py``) → the fused state pass with outputs (``triton/states.py``),
  or, with fewer sequences × heads than the GPU has multiprocessors, a state pass with narrower
  value blocks, then the per-chunk outputs (``triton/outputs.py``).
Backward (five launches), recomputing rather than storing: prepare again (also storing T), the
state pass, the reverse state-gradient pass (``triton/states.py``), then the per-chunk
gradients (``triton/gradients.py``).
Decode (one launch): ``triton/decode.py``.

This module owns the buffers (so a checking script can NaN-poison every kernel output, see
``POISON_OUTPUTS``); the launchers beside their kernels own grids and launch settings.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from deltaflow.rules import StepRule, get_rule

try:
    import triton

    from deltaflow.ops.triton import (
        pin_cache_keys,
        states,  # launch settings read at call time (sweepable)
    )
    from deltaflow.ops.triton import rules as rule_table
    from deltaflow.ops.triton.common import CHUNK, ChunkTables, chunk_tables
    from deltaflow.ops.triton.decode import launch_decode
    from deltaflow.ops.triton.gradients import launch_gradients
    from deltaflow.ops.triton.outputs import launch_outputs
    from deltaflow.ops.triton.prepare import launch_prepare
    from deltaflow.ops.triton.states import launch_dstates, launch_forward, launch_states

    pin_cache_keys()  # one cache key per kernel in every process (pin_cache_keys says why)
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

# Checking scripts set this to fill outputs with NaN before each launch, so that any element a
# kernel fails to write shows up as NaN instead of stale memory (integer tables, which cannot
# hold NaN, get their dtype's minimum).
POISON_OUTPUTS = False
# "auto" | "fused" | "two_pass": which forward (see _use_two_pass); tests and sweeps pin it.
FORWARD_MODE = "auto"
# The backward's states (S_0 of every chunk, h) and their gradients (dh) in float32 rather than
# the dot dtype. Measured (H100, benchmarks/results/issue30/call6): it brings the T=1 cases'
# d log α from 9.2e-3 / 1.2e-2 to 9.4e-4 / 1.8e-3 and leaves dβ's errors as they were (the
# emulation, benchmarks/bf16_floor.py, agrees: h and dh are d log α's floor at T=1, not dβ's).
# The key-side gradient kernel then takes narrower value blocks, so it fits Hopper's shared
# memory at every head size (gradients.GRADS_BV_FP32). Off: it costs state traffic (issue 30).
BACKWARD_STATES_FP32 = False


def _output(*shape: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    if POISON_OUTPUTS:  # NaN for floats; integers (the first_bad table) get their most negative
        # value, which a kernel that forgot to write it reads as "bad from before the chunk"
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, poison, device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Triton is importable and there is a GPU, or the CPU interpreter is switched on."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


def kernel_id_of(rule: str | StepRule) -> int:
    """The Triton rule table's id for ``rule``, or a ValueError naming the rule."""
    step_rule = get_rule(rule)
    return rule_table.check_kernel_id(step_rule.kernel_id, step_rule.name)


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and chunk_size != CHUNK.value:
        raise ValueError(
            f"the Triton kernels compute in chunks of {CHUNK.value} tokens, got chunk_size="
            f"{chunk_size}; pass chunk_size=None (or {CHUNK.value}), or backend='torch' for "
            "another chunk length"
        )


def _inputs(q, k, v, beta, log_decay, initial_state):
    """Operands in the matrix units' dtype (bf16/fp16 as given, else fp32), contiguous."""
    dot_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, k, v = (x.to(dot_dtype).contiguous() for x in (q, k, v))
    beta = None if beta is None else beta.contiguous()
    log_decay = None if log_decay is None else log_decay.contiguous()
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    return q, k, v, beta, log_decay, s0


def _use_two_pass(N: int, H: int, Dv: int, device: torch.device) -> bool:
    """The fused forward runs N·H·(Dv / its value block) programs; with fewer than the GPU has
    multiprocessors, split the state pass (more, narrower programs) from the outputs."""
    if FORWARD_MODE != "auto":
        return FORWARD_MODE == "two_pass"
    if interpreting():
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return N * H * triton.cdiv(Dv, states.FUSED_BV) < sms


def _prepare(
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    tables: ChunkTables,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    store_t: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(3)–(4): W and Ũ laid out like k and v, T per chunk when asked, and each chunk's first
    non-finite token."""
    B, T, H, Dk = k.shape
    n = max(tables.n_chunks, 1)
    w = _output(B, T, H, Dk, like=k, dtype=k.dtype)
    u = _output(B, T, H, v.shape[-1], like=k, dtype=k.dtype)
    t = _output(n, H, CHUNK.value, CHUNK.value, like=k, dtype=torch.float32) if store_t else None
    first_bad = _output(n, H, like=k, dtype=torch.int32)
    launch_prepare(
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        tables=tables,
        kernel_id=kernel_id,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        w=w,
        u=u,
        t=t,
        first_bad=first_bad,
    )
    return w, u, t, first_bad


def _state_pass(
    k: Tensor,
    *,
    w: Tensor,
    u: Tensor,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    first_bad: Tensor,
    tables: ChunkTables,
    block_v: int,
    h_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(4), (6): the state entering every chunk (h, in ``h_dtype``, default the dot dtype), U
    (v_new) and the final state."""
    B, T, H, Dk = k.shape
    Dv = u.shape[-1]
    N = tables.cu_seqlens.numel() - 1
    h = _output(max(tables.n_chunks, 1), H, Dk, Dv, like=k, dtype=h_dtype or k.dtype)
    v_new = _output(B, T, H, Dv, like=k, dtype=k.dtype)
    final_state = _output(N, H, Dk, Dv, like=k, dtype=torch.float32)
    launch_states(
        k,
        w=w,
        u=u,
        log_decay=log_decay,
        initial_state=initial_state,
        first_bad=first_bad,
        tables=tables,
        block_v=block_v,
        h=h,
        v_new=v_new,
        final_state=final_state,
    )
    return h, v_new, final_state


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
) -> tuple[Tensor, Tensor]:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    v_dtype = v.dtype
    q, k, v, beta, log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    tables = chunk_tables(cu_seqlens, B, T, q.device)
    N = tables.cu_seqlens.numel() - 1
    w, u, _, first_bad = _prepare(
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        tables=tables,
        kernel_id=kernel_id,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        store_t=False,
    )
    o = _output(B, T, H, Dv, like=q, dtype=v_dtype)
    if _use_two_pass(N, H, Dv, q.device):
        h, v_new, final_state = _state_pass(
            k,
            w=w,
            u=u,
            log_decay=log_decay,
            initial_state=s0,
            first_bad=first_bad,
            tables=tables,
            block_v=states.TWO_PASS_BV,
        )
        launch_outputs(
            q,
            k,
            h=h,
            v_new=v_new,
            log_decay=log_decay,
            first_bad=first_bad,
            tables=tables,
            scale=scale,
            o=o,
        )
        return o, final_state

    final_state = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
    launch_forward(
        q,
        k,
        w=w,
        u=u,
        log_decay=log_decay,
        initial_state=s0,
        first_bad=first_bad,
        tables=tables,
        scale=scale,
        o=o,
        final_state=final_state,
    )
    return o, final_state


def _backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    grad_o: Tensor,
    grad_state: Tensor,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
) -> list[Tensor | None]:
    """The fused backward: prepare (W, Ũ, T) and the state pass recomputed from the inputs,
    then the reverse state-gradient pass and the per-chunk gradients. Five launches."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dtypes = [None if x is None else x.dtype for x in (q, k, v, beta, log_decay, initial_state)]
    q, k, v, beta, log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    do = grad_o.to(q.dtype).contiguous()
    dsT = grad_state.to(torch.float32).contiguous()
    tables = chunk_tables(cu_seqlens, B, T, q.device)
    N = tables.cu_seqlens.numel() - 1
    n = max(tables.n_chunks, 1)
    w, u, t, first_bad = _prepare(
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        tables=tables,
        kernel_id=kernel_id,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        store_t=True,
    )
    h, v_new, _ = _state_pass(
        k,
        w=w,
        u=u,
        log_decay=log_decay,
        initial_state=s0,
        first_bad=first_bad,
        tables=tables,
        block_v=states.BWD_STATES_BV,
        h_dtype=torch.float32 if BACKWARD_STATES_FP32 else None,
    )
    dh = _output(n, H, Dk, Dv, like=q, dtype=torch.float32 if BACKWARD_STATES_FP32 else q.dtype)
    du = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    ds0 = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
    launch_dstates(
        q,
        k,
        w=w,
        log_decay=log_decay,
        grad_o=do,
        grad_final_state=dsT,
        tables=tables,
        scale=scale,
        dh=dh,
        du=du,
        d_initial_state=ds0,
    )
    dq = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dk = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dv = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    dbeta = None if beta is None else _output(*beta.shape, like=q, dtype=torch.float32)
    dg = None if log_decay is None else _output(*log_decay.shape, like=q, dtype=torch.float32)
    C = CHUNK.value
    launch_gradients(
        q,
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        t=t,
        h=h,
        v_new=v_new,
        dh=dh,
        du=du,
        grad_o=do,
        tables=tables,
        kernel_id=kernel_id,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
        # value side → M_P, M_A (C×C per chunk, dot dtype) and three row vectors (fp32)
        scratch_m=_output(n, H, 2, C, C, like=q, dtype=q.dtype),
        scratch_r=_output(n, H, 3, C, like=q, dtype=torch.float32),
        dq=dq,
        dk=dk,
        dv=dv,
        dbeta=dbeta,
        dlog_decay=dg,
    )
    grads = [dq, dk, dv, dbeta, dg, ds0 if initial_state is not None else None]
    return [None if g is None else g.to(d) for g, d in zip(grads, dtypes)]


# ---------------------------------------------------------------------------------------------
# Custom ops. Optional tensors travel as `Tensor?`; the rule as its kernel id. `chunk_size` is
# part of the schema so that a caller cannot ask for another chunk length and be ignored.


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
    _check_chunk_size(chunk_size)
    return _forward(
        q,
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        kernel_id=rule,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
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
    _check_chunk_size(chunk_size)
    grads = _backward(
        q,
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        grad_o=grad_o,
        grad_state=grad_state,
        kernel_id=rule,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
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
    # Contiguous, as the kernels write them: empty_like would copy a permuted input's strides,
    # and torch.compile would then read the real (contiguous) gradients through wrong strides.
    return [
        q.new_empty(0) if x is None else x.new_empty(x.shape)
        for x in (q, k, v, beta, log_decay, initial_state)
    ]


def _setup_context(ctx, inputs, output):
    q, k, v, beta, log_decay, initial_state, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, beta, log_decay, initial_state, cu_seqlens)
    ctx.options = options


def _chunk_fwd_backward(ctx, grad_o, grad_state):
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


chunk_fwd_op.register_autograd(_chunk_fwd_backward, setup_context=_setup_context)


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
    o = _output(B, T, H, v.shape[-1], like=q, dtype=v.dtype)
    launch_decode(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        beta=None if beta is None else beta.contiguous(),
        log_decay=None if log_decay is None else log_decay.contiguous(),
        state=state,
        kernel_id=rule,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
        o=o,
    )
    return o


@decode_step_op.register_fake
def _(q, k, v, beta, log_decay, state, rule, negative_eigenvalues, eps, scale):
    return torch.empty_like(v)


# ---------------------------------------------------------------------------------------------
# Entry points called by deltaflow.ops after argument checks.


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    *,
    rule: str | StepRule,
    log_decay: Tensor | None,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor | None]:
    """``chunk_size``: None or CHUNK (64); anything else is refused, not ignored."""
    _check_chunk_size(chunk_size)
    o, state = chunk_fwd_op(
        q,
        k,
        v,
        beta,
        log_decay,
        initial_state,
        cu_seqlens,
        kernel_id_of(rule),
        negative_eigenvalues,
        eps,
        scale,
        CHUNK.value,
    )
    return o, (state if output_final_state else None)


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    state: Tensor,
    *,
    rule: str | StepRule,
    log_decay: Tensor | None,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
) -> Tensor:
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("the Triton decode step needs a contiguous float32 state")
    return decode_step_op(
        q, k, v, beta, log_decay, state, kernel_id_of(rule), negative_eigenvalues, eps, scale
    )
