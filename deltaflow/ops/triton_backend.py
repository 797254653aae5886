"""The Triton backend: the kernels of ``deltaflow/ops/triton/`` assembled into a forward, a
fused backward and a decode step, run by the ``torch.library`` custom ops of
``deltaflow/ops/triton_ops.py`` (fake implementations, autograd), so that
``torch.compile(fullgraph=True)`` traces through ``delta_rule`` without graph breaks. The
algorithm and its equations: docs/design.md §3, §7.

Forward (two or three launches, chunks of ``CHUNK`` = 64 tokens):
  prepare (``triton/prepare.py``) → the fused state pass with outputs (``triton/states.py``),
  or, with fewer sequences × heads than the GPU has multiprocessors, a state pass with narrower
  value blocks, then the per-chunk outputs (``triton/outputs.py``).
Backward (five launches): W and Ũ again, by default rebuilt from the T the forward kept
(``SAVE_FOR_BACKWARD`` "t", ``triton/rebuild.py``: no solve; "none" runs the whole prepare
again, "prepare" and "states" keep more and skip a launch or two), the state pass, the reverse
state-gradient pass (``triton/dstates.py``), then the per-chunk gradients
(``triton/gradients.py``).
Decode (one launch): ``triton/decode.py``.

This module owns the buffers (so a checking script can NaN-poison every kernel output, see
``POISON_OUTPUTS``) and the switches; the launchers beside their kernels own grids and launch
settings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deltaflow.ops.triton_ops import (  # noqa: F401  (the ops re-exported, registered here)
    SAVE_MODES,
    chunk_bwd_op,
    chunk_bwd_varlen_op,
    chunk_fwd_for,
    chunk_fwd_op,
    chunk_fwd_varlen_op,
    chunk_rows,
    decode_step_op,
    dot_dtype,
    interpreting,
)
from deltaflow.rules import StepRule, get_rule

try:
    import triton

    # dstates, states: launch settings read at call time (sweepable); common: multiprocessors
    from deltaflow.ops.triton import common, dstates, pin_cache_keys, states
    from deltaflow.ops.triton import rules as rule_table
    from deltaflow.ops.triton.common import CHUNK, ChunkTables, cdiv, chunk_tables, head_block
    from deltaflow.ops.triton.decode import decode_tokens
    from deltaflow.ops.triton.dstates import launch_dstates
    from deltaflow.ops.triton.gradients import launch_gradients, scratch_matrices, scratch_rows
    from deltaflow.ops.triton.outputs import launch_outputs
    from deltaflow.ops.triton.prepare import launch_prepare, low_precision, t_dtype
    from deltaflow.ops.triton.rebuild import launch_rebuild, pass_args
    from deltaflow.ops.triton.segment_states import (
        SegmentTables,
        launch_segmented_dstates,
        launch_segmented_states,
        segment_tables,
        step_blocks,
    )
    from deltaflow.ops.triton.states import launch_forward, launch_states

    pin_cache_keys()  # one cache key per kernel in every process (pin_cache_keys says why)
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

# Checking scripts set this to fill outputs with NaN before each launch, so that any element a
# kernel fails to write shows up as NaN instead of stale memory (integer tables, which cannot
# hold NaN, get their dtype's minimum).
POISON_OUTPUTS = False
# "auto" | "fused" | "two_pass": which forward (see _use_two_pass); tests and sweeps pin it.
FORWARD_MODE = "auto"
# The backward's states (h) and their gradients (dh) in float32 rather than the dot dtype
# (H100, benchmarks/results/issue30/call6: T=1's d log α 9.2e-3 → 9.4e-4, dβ unchanged; the key
# side then takes gradients.GRADS_BV_FP32 value columns). Off: it costs state traffic.
BACKWARD_STATES_FP32 = False
# What the forward keeps for the backward, which then skips recomputing it (triton_ops.py's
# docstring; benchmarks/NOTES.md "Issue 31/32, session 16": bytes and predicted ms):
# "none": only the inputs, the backward recomputes prepare and the state pass (5 launches);
# "prepare": W, Ũ, T, first_bad (+768 B per token and head at Dk = Dv = 128 in bf16), one
# launch fewer; "states": W, T, h, U (+1280 B), two fewer (the forward then always runs its
# two-pass form, whose state pass writes h and U); "t": T and first_bad (+128 B in bf16, fla's
# own: its A), the backward rebuilds W = T X and Ũ = T Y without the solve (triton/
# rebuild.py; benchmarks/NOTES.md, "Issue 32, session 19"); that T in prepare.t_dtype (the
# dot dtype in bf16/fp16, the other modes' fp32). Kept only when autograd will need them.
# The forward's prepare then runs with the backward's roundings (prepare.BACKWARD_*): the
# gradients are the same as with "none"; bf16/fp16 outputs round like the backward's prepare.
# "t" is the default (session 20; H200 s19 call 3: −0.18 to −0.23 ms forward + backward, bf16).
SAVE_FOR_BACKWARD = "t"
SAVE_CHOICES = ("none", "prepare", "states", "t")  # what SAVE_FOR_BACKWARD may be
# The state passes split across segments of each sequence (triton/segment_states.py), so that few
# sequences x heads still fill the GPU (issue 32; benchmarks/NOTES.md, "Issue 32, session 17"):
# "off"; "on" wherever a sequence has more than one segment (the forward then takes its two-pass
# form); "auto" where the pass's programs, sequences x heads x value blocks, are fewer than the
# GPU's multiprocessors (H100, session 18 call 2: (1, 32768, 16, 128) forward + backward 9.79 →
# 6.65 ms). Dense batches need no host sync and are safe under CUDA-graph capture: their segment
# tables come from shapes (GraphSafeCache), the chain is one launch (segment_chain.py).
SEQUENCE_PARALLEL_STATES = "auto"
# Chunks a segment; 0: from the load, SEGMENT_WAVES waves of the multiprocessors for the
# per-segment state pass, at least SEGMENT_MIN_CHUNKS (every segment is a step of the chain
# across segments: two torch launches in segments.chain's form, ~1-2 µs of one kernel in
# segment_chain.py's, predicted). Tests set small values to get several segments at tiny T.
SEGMENT_CHUNKS = 0
SEGMENT_WAVES = 2
SEGMENT_MIN_CHUNKS = 4
# Where the forward runs its state pass in segments and a backward will recompute it ("none",
# "prepare", "t"), the forward keeps each segment's entering state (fp32, 18 B a token·head at
# (1, 32768, 16, 128)) and the backward starts from it (H200: 5.443 → 5.094 ms there), the same
# gradients to the bit (kept_segment_rows: only where the recompute gets the same states).
KEEP_SEGMENT_STATES = True


def _output(*shape: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    if POISON_OUTPUTS:  # NaN for floats; integers (the first_bad table) get their most negative
        # value, which a kernel that forgot to write it reads as "bad from before the chunk"
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, poison, device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def available() -> bool:
    """Triton is importable and there is a GPU, or the CPU interpreter is switched on."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


def kernel_id_of(rule: str | StepRule) -> int:
    """The Triton rule table's id for ``rule``, or a ValueError naming the rule."""
    step_rule = get_rule(rule)
    return rule_table.check_kernel_id(
        step_rule.kernel_id, step_rule.name, reads_decay=step_rule.decay_coefficients is not None
    )


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and chunk_size != CHUNK.value:
        raise ValueError(
            f"the Triton kernels compute in chunks of {CHUNK.value} tokens, got chunk_size="
            f"{chunk_size}; pass chunk_size=None (or {CHUNK.value}), or backend='torch' for "
            "another chunk length"
        )


def _inputs(q, k, v, beta, log_decay, initial_state):
    """Operands in the kernels' dtype (triton_ops.dot_dtype: bf16/fp16 as given, fp32 for fp32
    inputs and for half-precision heads narrower than HALF_MIN_HEAD), contiguous. The callers
    return outputs and gradients in the inputs' dtypes, whichever kernels ran."""
    dt = dot_dtype(q.dtype, q.shape[-1], v.shape[-1])
    q, k, v = (x.to(dt).contiguous() for x in (q, k, v))
    beta = None if beta is None else beta.contiguous()
    log_decay = None if log_decay is None else log_decay.contiguous()
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    return q, k, v, beta, log_decay, s0


def _save_mode(*inputs: Tensor | None) -> str:
    """The op's ``save`` argument: ``SAVE_FOR_BACKWARD`` where autograd will run a backward
    (grad mode on, an input that requires grad), "none" otherwise (inference keeps nothing)."""
    if SAVE_FOR_BACKWARD not in SAVE_CHOICES:
        raise ValueError(
            f"triton_backend.SAVE_FOR_BACKWARD must be one of {', '.join(SAVE_CHOICES)}, got "
            f"{SAVE_FOR_BACKWARD!r}"
        )
    needed = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if not needed:
        return "none"
    if SAVE_FOR_BACKWARD == "none":  # the segments' entering states alone, where kept
        return "segments" if KEEP_SEGMENT_STATES else "none"
    if SAVE_FOR_BACKWARD == "states" and BACKWARD_STATES_FP32:
        return "states_fp32"  # h as the backward would have stored it
    return SAVE_FOR_BACKWARD


def _use_two_pass(N: int, H: int, Dv: int, device: torch.device) -> bool:
    """The fused forward runs N·H·(Dv / its value block) programs; with fewer than the GPU has
    multiprocessors, split the state pass (more, narrower programs) from the outputs."""
    if FORWARD_MODE != "auto":
        return FORWARD_MODE == "two_pass"
    if interpreting():
        return False
    return N * H * cdiv(Dv, states.FUSED_BV) < common.multiprocessors(device)


def segment_length(
    N: int, T: int, packed: bool, n_chunks: int, H: int, Dv: int, block_v: int, sms: int
) -> int:
    """Chunks a segment of a state pass of ``block_v`` value columns over ``N`` sequences
    (``n_chunks`` chunks in all; rows of ``T`` tokens unless ``packed``) on ``sms``
    multiprocessors, 0: sequential (the decision of ``_segments`` and :func:`dense_segments`)."""
    if SEQUENCE_PARALLEL_STATES not in ("off", "on", "auto"):
        raise ValueError(
            "triton_backend.SEQUENCE_PARALLEL_STATES must be 'off', 'on' or 'auto', got "
            f"{SEQUENCE_PARALLEL_STATES!r}"
        )
    if SEQUENCE_PARALLEL_STATES == "off" or n_chunks == 0:
        return 0
    blocks = _programs(H, Dv, block_v)
    if SEQUENCE_PARALLEL_STATES == "auto" and N * blocks >= sms:
        return 0
    chunks = SEGMENT_CHUNKS or max(SEGMENT_MIN_CHUNKS, cdiv(n_chunks * blocks, SEGMENT_WAVES * sms))
    if not SEGMENT_CHUNKS and not packed:  # equal segments: 64 chunks in 2 x 32, not 63 + 1
        chunks = cdiv(cdiv(T, CHUNK.value), cdiv(cdiv(T, CHUNK.value), chunks))
    return chunks


def _programs(H: int, Dv: int, block_v: int) -> int:
    """Programs a sequence of a state pass of ``block_v`` value columns (segment_length's load)."""
    return H * cdiv(Dv, min(block_v, head_block(Dv)))


def _multiprocessors(device: torch.device) -> int:
    return 132 if interpreting() else common.multiprocessors(device)  # an H100's off the GPU


def _dense_length(B: int, T: int, H: int, Dv: int, sms: int, block_v: int) -> int:
    """:func:`segment_length` over ``B`` rows of ``T`` tokens, 0 where a row is one segment."""
    chunks = cdiv(T, CHUNK.value)
    length = segment_length(B, T, False, B * chunks, H, Dv, block_v, sms)
    return length if chunks > length > 0 else 0


def dense_segments(B: int, T: int, H: int, Dv: int, sms: int, block_v: int | None = None) -> bool:
    """Whether ``_segments`` runs the pass of ``block_v`` value columns (None: any of the op's
    three) over ``B`` rows of ``T`` tokens in segments on ``sms`` multiprocessors (a row of more
    than one), from shapes alone: benchmarks/kernels.py's warm-up asks."""
    if block_v is None:  # the forward's, the backward's recomputed and its reverse pass
        bvs = (states.TWO_PASS_BV, states.BWD_STATES_BV, dstates.DSTATES_BV)
        return any(dense_segments(B, T, H, Dv, sms, bv) for bv in bvs)
    return _dense_length(B, T, H, Dv, sms, block_v) > 0


def _segments(
    tables: ChunkTables, B: int, T: int, packed: bool, H: int, Dv: int, block_v: int
) -> SegmentTables | None:
    """The segments a state pass of ``block_v`` value columns runs in, or None: sequential."""
    sms = _multiprocessors(tables.cu_seqlens.device)
    N = tables.cu_seqlens.numel() - 1
    chunks = segment_length(N, T, packed, tables.n_chunks, H, Dv, block_v, sms)
    segments = segment_tables(tables, B, T, packed, chunks) if chunks else None
    return segments if segments is not None and segments.slots > 0 else None


def kept_segment_rows(save: str, q: Tensor, v: Tensor, cu_seqlens: Tensor | None) -> int:
    """Rows of the segments' entering states ``save`` keeps (triton_ops.kept_layout), from the
    inputs' shapes, dtype and device alone; 0: none. Kept where the forward's state pass runs in
    segments and the backward's recompute would get these very states: from the same W and Ũ
    (prepare's roundings: "t" and "prepare" run the backward's in the forward; "segments" keeps
    the forward's own, the same kernel only where it takes no low-precision dots), in the same
    segments (segment_length reads the value block through _programs), step 1 in the same
    blocks. Elsewhere the backward recomputes them, as without KEEP_SEGMENT_STATES. A dense
    batch's segments; for packed ones a bound (their count depends on the offsets' values):
    Σ max(1, ⌈c_n / L⌉) ≤ N + chunks / L, L being SEGMENT_CHUNKS, or at least both
    SEGMENT_MIN_CHUNKS and chunks · programs / (SEGMENT_WAVES · multiprocessors)."""
    (B, T, H, Dk), Dv, names = q.shape, v.shape[-1], SAVE_MODES[save]
    if not KEEP_SEGMENT_STATES or "entering" not in names:
        return 0
    dt, bv, bwd = dot_dtype(q.dtype, Dk, Dv), states.TWO_PASS_BV, states.BWD_STATES_BV
    if "t" not in names and low_precision(dt):
        return 0

    def key(b: int) -> tuple[int, tuple[int, int, int]]:  # how the block reaches the states
        return _programs(H, Dv, b), step_blocks(Dk, Dv, b, dt)

    if bwd != bv and key(bv) != key(bwd):  # the backward's recompute: other segments or blocks
        return 0
    sms = _multiprocessors(q.device)
    if cu_seqlens is None:
        length = _dense_length(B, T, H, Dv, sms, bv)
        return B * cdiv(cdiv(T, CHUNK.value), length) if length else 0
    N, n = cu_seqlens.shape[0] - 1, chunk_rows(B, T, cu_seqlens)
    if not segment_length(N, T, True, n, H, Dv, bv, sms):
        return 0
    if SEGMENT_CHUNKS:
        return N + n // SEGMENT_CHUNKS
    return N + min(n // SEGMENT_MIN_CHUNKS, SEGMENT_WAVES * sms // _programs(H, Dv, bv))


def _prepare(
    k: Tensor,
    v: Tensor,
    *,
    store_t: bool,
    t_alone: bool = False,
    rows: int | None = None,
    q: Tensor | None = None,
    **rule: Any,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """(3)–(4): W and Ũ laid out like k and v, T per chunk when asked (``t_alone``: the one
    tensor kept, in prepare.t_dtype's rounded form), and each chunk's first non-finite token
    (``rows`` per-chunk rows, default the chunk count); given ``q``, (5)'s P per chunk for the
    split fused forward (states.forward_takes_p), else None. ``rule``: launch_prepare's β, log α,
    tables, rule and its flags (the callers' ``rule`` dict)."""
    B, T, H, Dk = k.shape
    n = rows or max(rule["tables"].n_chunks, 1)
    w = _output(B, T, H, Dk, like=k, dtype=k.dtype)
    u = _output(B, T, H, v.shape[-1], like=k, dtype=k.dtype)
    t_dt = t_dtype(k.dtype, kept_alone=t_alone)
    t = _output(n, H, CHUNK.value, CHUNK.value, like=k, dtype=t_dt) if store_t else None
    first_bad = _output(n, H, like=k, dtype=torch.int32)
    p = None if q is None else _output(n, H, CHUNK.value, CHUNK.value, like=k, dtype=k.dtype)
    launch_prepare(k, v, w=w, u=u, t=t, first_bad=first_bad, q=q, p=p, **rule)
    return w, u, t, first_bad, p


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
    rows: int | None = None,
    final_state: Tensor | None = None,
    segments: SegmentTables | None = None,
    from_t: dict | None = None,
    **kept: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(4), (6): the state entering every chunk (h, in ``h_dtype``, default the dot dtype; ``rows``
    chunk rows, default the chunk count), U (v_new) and the final state (into ``final_state``
    when given); across ``segments`` (``_segments``) when given, the segments' entering states
    kept or taken as ``kept`` says (launch_segmented_states' ``keep``, ``entering``)."""
    B, T, H, Dk = k.shape
    Dv = u.shape[-1]
    N = tables.cu_seqlens.numel() - 1
    h = _output(rows or max(tables.n_chunks, 1), H, Dk, Dv, like=k, dtype=h_dtype or k.dtype)
    v_new = _output(B, T, H, Dv, like=k, dtype=k.dtype)
    if final_state is None:
        final_state = _output(N, H, Dk, Dv, like=k, dtype=torch.float32)
    kwargs = dict(w=w, u=u, log_decay=log_decay, initial_state=initial_state, h=h, v_new=v_new)
    kwargs.update(first_bad=first_bad, tables=tables, block_v=block_v, final_state=final_state)
    if segments is None:
        launch_states(k, from_t=from_t, **kwargs)
    else:
        launch_segmented_states(k, segments=segments, output=_output, **kept, **kwargs)
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
    save: str = "none",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The outputs, the final states and what ``save`` keeps for the backward (by name, as
    triton_ops.SAVE_MODES lists it)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    v_dtype = v.dtype
    q, k, v, beta, log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    log_decay = rule_table.op_log_decay(kernel_id, log_decay)
    tables = chunk_tables(cu_seqlens, B, T, q.device)
    N = tables.cu_seqlens.numel() - 1
    keep = SAVE_MODES[save]
    # Kept per-chunk tensors have the rows the fake implementation can compute from shapes.
    rows = chunk_rows(B, T, cu_seqlens) if keep else None
    # Keeping T makes this the backward's prepare (prepare.launch_prepare: T stored, and in half
    # precision the backward's roundings), so the backward gets what it would have recomputed.
    rule = dict(beta=beta, log_decay=log_decay, tables=tables, kernel_id=kernel_id)
    rule.update(negative_eigenvalues=negative_eigenvalues, eps=eps)
    segments = _segments(tables, B, T, cu_seqlens is not None, H, Dv, states.TWO_PASS_BV)
    two_pass = "h" in keep or segments is not None or _use_two_pass(N, H, Dv, q.device)
    takes_p = not two_pass and states.forward_takes_p(Dk, Dv, q.dtype)  # q: the dot dtype
    w, u, t, first_bad, p = _prepare(
        k, v, store_t="t" in keep, t_alone=save == "t", rows=rows, q=q if takes_p else None, **rule
    )
    o = _output(B, T, H, Dv, like=q, dtype=v_dtype)
    n_kept = kept_segment_rows(save, q, v, cu_seqlens)  # 0: none kept (0 rows if in keep)
    entering = (
        _output(n_kept, H, Dk, Dv, like=q, dtype=torch.float32) if "entering" in keep else None
    )
    found = {"w": w, "u": u, "t": t, "first_bad": first_bad, "entering": entering}
    outputs = dict(log_decay=log_decay, first_bad=first_bad, tables=tables, scale=scale, o=o)
    # Keeping h takes the two-pass form whatever its size: only its state pass stores h and U;
    # so does the sequence-parallel state pass (the fused forward is one pass a sequence).
    if two_pass:
        h, v_new, final_state = _state_pass(
            k,
            w=w,
            u=u,
            log_decay=log_decay,
            initial_state=s0,
            first_bad=first_bad,
            tables=tables,
            block_v=states.TWO_PASS_BV,
            h_dtype=torch.float32 if save == "states_fp32" else None,
            rows=rows,
            segments=segments,
            keep=entering if n_kept else None,
        )
        launch_outputs(q, k, h=h, v_new=v_new, **outputs)
        found.update(h=h, v_new=v_new)
    else:
        final_state = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
        launch_forward(q, k, w=w, u=u, initial_state=s0, final_state=final_state, p=p, **outputs)
    kept = {name: found[name] for name in keep}
    if rows is not None and rows > tables.n_chunks:  # packed sequences: the bound's spare rows
        for name in ("t", "first_bad", "h"):
            if name in kept:
                kept[name][tables.n_chunks :].zero_()
    n_seg = 0 if segments is None else segments.fwd_row.numel()
    if n_kept > n_seg:  # packed sequences: the bound's spare rows (all where none ran segments)
        entering[n_seg:].zero_()
    return o, final_state, kept


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
    grad_state: Tensor | None,
    kernel_id: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    kept: dict[str, Tensor] | None = None,
) -> list[Tensor | None]:
    """The fused backward: prepare (W, Ũ, T) and the state pass (h, U) recomputed from the
    inputs unless the forward ``kept`` them, then the reverse state-gradient pass and the
    per-chunk gradients. Three to five launches. ``grad_state`` None: the final state was not
    used (a zero gradient, never materialized)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    kept = kept or {}
    dtypes = [None if x is None else x.dtype for x in (q, k, v, beta, log_decay, initial_state)]
    q, k, v, beta, layer_log_decay, s0 = _inputs(q, k, v, beta, log_decay, initial_state)
    log_decay = rule_table.op_log_decay(kernel_id, layer_log_decay)
    do = grad_o.to(q.dtype).contiguous()
    dsT = None if grad_state is None else grad_state.to(torch.float32).contiguous()
    tables = chunk_tables(cu_seqlens, B, T, q.device)
    N = tables.cu_seqlens.numel() - 1
    n = max(tables.n_chunks, 1)
    packed = cu_seqlens is not None
    # The recomputed state pass's final state is not needed, nor, without an initial state, its
    # gradient: one buffer takes both (the reverse pass writes it after the state pass).
    ds0 = _output(N, H, Dk, Dv, like=q, dtype=torch.float32)
    rule = dict(beta=beta, log_decay=log_decay, tables=tables, kernel_id=kernel_id)
    rule.update(negative_eigenvalues=negative_eigenvalues, eps=eps)  # prepare's and gradients'
    segments = _segments(tables, B, T, packed, H, Dv, dstates.DSTATES_BV)  # the reverse pass's
    bwd_bv = states.BWD_STATES_BV  # the recomputed state pass's value block (none: "h" kept)
    state_segments = None if "h" in kept else _segments(tables, B, T, packed, H, Dv, bwd_bv)
    p = None  # the split reverse pass's scale·P, where the rebuild forms it (dstates.DSTATES_P)
    from_t = None  # W, Ũ formed by the state pass (states.rebuilds_w_u): rebuild.pass_args
    if "w" in kept:  # the forward's prepare (SAVE_FOR_BACKWARD "prepare" or "states")
        w, u, t, first_bad = (kept.get(name) for name in ("w", "u", "t", "first_bad"))
    elif "t" in kept:  # its T alone ("t"): W and Ũ rebuilt from it, no solve
        t, first_bad = kept["t"], kept["first_bad"]
        w = _output(B, T, H, Dk, like=k, dtype=k.dtype)
        if segments is None and dstates.dstates_takes_p(Dk, Dv, q.dtype):
            p = _output(n, H, CHUNK.value, CHUNK.value, like=k, dtype=k.dtype)
        if p is None and state_segments is None and states.rebuilds_w_u(k, v):
            u, from_t = v, pass_args(t, v, **rule)  # v: a placeholder the pass does not read
        else:
            u = _output(B, T, H, Dv, like=k, dtype=k.dtype)
            launch_rebuild(k, v, t=t, w=w, u=u, q=q, p=p, scale=scale, **rule)
    else:
        w, u, t, first_bad, _ = _prepare(k, v, store_t=True, **rule)
    if "h" in kept:  # the forward's state pass ("states")
        h, v_new = kept["h"], kept["v_new"]
    else:
        entering = kept.get("entering")
        h, v_new, _ = _state_pass(
            k,
            w=w,
            u=u,
            log_decay=log_decay,
            initial_state=s0,
            first_bad=first_bad,
            tables=tables,
            block_v=bwd_bv,
            h_dtype=torch.float32 if BACKWARD_STATES_FP32 else None,
            final_state=None if initial_state is not None else ds0,
            segments=state_segments,
            from_t=from_t,
            # the forward's, where it kept them (kept_segment_rows: the states this pass gets)
            entering=entering if entering is not None and entering.shape[0] else None,
        )
    # dh in h's dtype: float32 with BACKWARD_STATES_FP32 (or fp32 inputs), else the dot dtype
    dh = _output(n, H, Dk, Dv, like=q, dtype=h.dtype)
    du = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    kwargs = dict(w=w, log_decay=log_decay, grad_o=do, grad_final_state=dsT, tables=tables)
    kwargs.update(scale=scale, dh=dh, du=du, d_initial_state=ds0)
    if segments is None:
        launch_dstates(q, k, p=p, **kwargs)
    else:
        launch_segmented_dstates(q, k, segments=segments, output=_output, **kwargs)
    dq = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dk = _output(B, T, H, Dk, like=q, dtype=q.dtype)
    dv = _output(B, T, H, Dv, like=q, dtype=q.dtype)
    # dβ, d log α stored in their inputs' dtypes (the kernels round once from fp32, as a .to()
    # after would: no conversion launches), d log α in fp32 where the host maps it (DECAY_MAPS)
    dbeta = None if beta is None else _output(*beta.shape, like=q, dtype=dtypes[3])
    dg_dtype = torch.float32 if kernel_id in rule_table.DECAY_MAPS else dtypes[4]
    dg = None if log_decay is None else _output(*log_decay.shape, like=q, dtype=dg_dtype)
    C = CHUNK.value
    launch_gradients(
        q,
        k,
        v,
        t=t,
        h=h,
        v_new=v_new,
        dh=dh,
        du=du,
        grad_o=do,
        scale=scale,
        # value side → M_P, M_A (C×C per chunk, dot dtype) and row vectors (fp32; scratch_rows);
        # none for the fused kernel
        scratch_m=_output(n, H, scratch_matrices(Dk, Dv, q.dtype), C, C, like=q, dtype=q.dtype),
        scratch_r=_output(n, H, scratch_rows(Dk, Dv, q.dtype), C, like=q, dtype=torch.float32),
        dq=dq,
        dk=dk,
        dv=dv,
        dbeta=dbeta,
        dlog_decay=dg,
        **rule,
    )
    dg = rule_table.layer_log_decay_grad(kernel_id, dg, layer_log_decay)
    grads = [dq, dk, dv, dbeta, dg, ds0 if initial_state is not None else None]
    return [None if g is None else g.to(d) for g, d in zip(grads, dtypes)]


def _decode(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """(1)–(2) token by token (triton/decode.py): the outputs, ``state`` updated in place."""
    return decode_tokens(q, k, v, output=_output, **kwargs)


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
    # the packed sequences' op is marked unsafe for CUDA graphs (triton_ops.chunk_fwd_for)
    o, state, *_kept = chunk_fwd_for(cu_seqlens)(  # the kept tensors live on in autograd
        q, k, v, beta, log_decay, initial_state, cu_seqlens, kernel_id_of(rule),
        negative_eigenvalues, eps, scale, CHUNK.value,
        _save_mode(q, k, v, beta, log_decay, initial_state),
    )  # fmt: skip
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
