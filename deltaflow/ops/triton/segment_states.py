"""Stage 2 split across segments of a sequence: the state passes of ``states.py`` and
``dstates.py`` for batches whose sequences × heads × value blocks leave most of the GPU idle
(benchmarks/NOTES.md, "Issue 32, session 17: sequence-parallel state passes").
``triton_backend.SEQUENCE_PARALLEL_STATES`` decides when; it is off by default.

Dense batches (no ``cu_seqlens``) take tables built from their shapes alone, on the device and
cached by shape (:func:`build_dense_segment_tables`, ``common.GraphSafeCache``): no host sync,
and a CUDA-graph capture (compiled blocks' ``mode="reduce-overhead"``) finds them built by its
warm-up, so it copies nothing from the host (benchmarks/NOTES.md, "Issue 32, session 18").
Packed sequences build theirs from the offsets read on the host (ops marked cudagraph_unsafe).

Every sequence is cut into segments of ``L`` chunks. The state entering a segment acts on the
state leaving it through a Dk × Dk transition: ``S_end = P S_in + S_loc`` (forward),
``G_in = Pᵀ G_out + G_loc`` (reverse), the algebra of ``deltaflow/ops/segments.py``. Three steps:

1. ``segment_states_kernel`` / ``segment_dstates_kernel``: every segment at once computes
   ``[P | S_loc]`` (``[Pᵀ | G_loc]``) by running the state pass's own chunk step on the
   augmented state ``[I | 0]`` with values ``[0 | Ũ]`` (dO ``[0 | dO]``): the Dk transition
   columns start as the identity and see no values, so they end as P. Only the segments whose
   transition someone needs run: not a sequence's last (first, in reverse) segment, whose end is
   the sequence's final state (initial state's gradient), written by step 3.
2. The chain over the segments, ``X_{r+1} = P_r X_r + S_r`` (``segments.chain``'s math): the
   state entering every segment (the gradient leaving it), in one launch
   (``segment_chain.py``; ``segment_chain.SEGMENT_CHAIN = "torch"``: ``segments.chain`` itself).
3. ``states.launch_states`` / ``dstates.launch_dstates`` unchanged, with the segments as the
   sequences: each walks its own chunks from its true entering state, writing h, U (dh, dU)
   where the sequential pass writes them (in their own blocks and register cap:
   ``SEGMENT_STATES_*``, ``SEGMENT_DSTATES_*``).

The forward may keep step 2's entering states (``triton_backend.KEEP_SEGMENT_STATES``): the
backward's recompute of the same pass then runs step 3 alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import dstates, states  # launch settings read at call time (sweepable)
from deltaflow.ops.triton.common import (
    CHUNK,
    ChunkTables,
    GraphSafeCache,
    cdiv,
    chunk_gamma,
    dot_precision,
    gamma_and_next,
    head_block,
    key_block,
    load_rows,
    log_alpha_ahead,
    log_alpha_rows,
    scaled_grad_o,
)
from deltaflow.ops.triton.dstates import (
    dstate_add_outputs,
    dstate_finish,
    du_add_outputs,
    du_from_state,
    launch_dstates,
)
from deltaflow.ops.triton.segment_chain import chain_segments
from deltaflow.ops.triton.states import chunk_state_update, chunk_u, launch_states


# ---------------------------------------------------------------------------- the tables (host)
class SegmentTables(NamedTuple):
    """Where the segments of a batch lie. Segment ``r`` of sequence ``n`` (``R_n`` of them, one
    for an empty sequence) starts at chunk ``r·L`` of it. Step 1 runs ``slots`` rows of ``N``
    segment slots, row-major like ``chain``'s ``[R, N, ...]`` input: forward row ``r`` holds
    segment ``r`` (rows ``r ≥ R_n − 1`` empty), reverse row ``r`` segment ``R_n − 1 − r``."""

    chunks: int  # L, chunks per segment
    slots: int  # max R_n − 1: rows of step 1 and of the chain
    fwd_bounds: Tensor  # int32 [slots·N, 3]: first token, end token, first chunk (empty: 0 0 0)
    rev_bounds: Tensor  # int32 [slots·N, 3]: the same in reverse order
    segments: ChunkTables  # the segments as the sequences of step 3
    fwd_row: Tensor  # int64 [segments]: the chain's row (r·N + n) of the state entering it
    rev_row: Tensor  # int64 [segments]: the reverse chain's row of the gradient leaving it
    first: Tensor  # int64 [N]: each sequence's first segment
    last: Tensor  # int64 [N]: each sequence's last segment


def build_segment_tables(
    cu: list[int], segment_chunks: int, tables: ChunkTables, device: torch.device
) -> SegmentTables:
    """The segments of ``L = segment_chunks`` chunks of the sequences at host offsets ``cu``
    (``tables``: their chunk tables, whose per-chunk entries the segments share)."""
    C, L, N = CHUNK.value, segment_chunks, len(cu) - 1
    n_chunks = [cdiv(e - s, C) for s, e in zip(cu, cu[1:])]
    R = [max(1, cdiv(c, L)) for c in n_chunks]
    slots = max(R) - 1
    chunk_first = [0]
    for c in n_chunks:
        chunk_first.append(chunk_first[-1] + c)
    starts, chunk_starts, fwd_row, rev_row, first, last = [], [], [], [], [], []
    fwd = [[0, 0, 0] for _ in range(slots * N)]
    rev = [[0, 0, 0] for _ in range(slots * N)]
    for n in range(N):
        first.append(len(starts))
        for r in range(R[n]):
            start, c0 = cu[n] + r * L * C, chunk_first[n] + r * L
            starts.append(start)
            chunk_starts.append(c0)
            fwd_row.append(r * N + n)
            rev_row.append((R[n] - 1 - r) * N + n)
            bounds = [start, min(start + L * C, cu[n + 1]), c0]
            if r < R[n] - 1:  # the forward's step 1 skips the last segment
                fwd[r * N + n] = bounds
            if r > 0:  # the reverse's skips the first
                rev[(R[n] - 1 - r) * N + n] = bounds
        last.append(len(starts) - 1)

    def ints(x: list, dtype: torch.dtype = torch.int32) -> Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    segments = ChunkTables(
        ints(starts + [cu[-1]]),
        ints(chunk_starts + [chunk_first[-1]]),
        tables.chunk_spans,
        tables.n_chunks,
        tables.placeholder,
    )
    return SegmentTables(
        L,
        slots,
        ints(fwd).reshape(-1, 3),
        ints(rev).reshape(-1, 3),
        segments,
        ints(fwd_row, torch.int64),
        ints(rev_row, torch.int64),
        ints(first, torch.int64),
        ints(last, torch.int64),
    )


def build_dense_segment_tables(
    B: int, T: int, segment_chunks: int, tables: ChunkTables, device: torch.device
) -> SegmentTables:
    """:func:`build_segment_tables` of ``B`` rows of ``T`` tokens from their shapes alone, with
    device ops only: no host list copied to the GPU (a blocking copy: a sync) and nothing read
    back, so that it may also run inside a CUDA-graph capture. Every row has the same ``R``
    segments, so every slot of step 1 is a real segment and the tables are arithmetic in
    (row ``n``, segment ``r``). ``tests/test_segment_graph_safety.py`` checks it equals the host
    build."""
    C, L, N = CHUNK.value, segment_chunks, B
    chunks = cdiv(T, C)
    R = max(1, cdiv(chunks, L))

    def ints(n: int) -> Tensor:
        return torch.arange(n, device=device, dtype=torch.int64)

    n, r = ints(N)[:, None], ints(R)[None, :]
    start = n * T + r * (L * C)  # [N, R]: segment (n, r)'s first token, its chunk and end
    c0 = n * chunks + r * L
    bounds = torch.stack([start, torch.minimum(start + L * C, (n + 1) * T), c0], dim=-1)
    bounds = bounds.to(torch.int32)
    # step 1's slots, rows first: forward row r·N + n holds segment r < R − 1, reverse row
    # j·N + n segment R − 1 − j > 0
    fwd = bounds[:, : R - 1].transpose(0, 1).reshape(-1, 3).contiguous()
    rev = bounds[:, 1:].flip(1).transpose(0, 1).reshape(-1, 3).contiguous()

    def with_end(x: Tensor, end: int) -> Tensor:  # [N·R + 1]: every segment's, then the end
        return torch.cat([x.reshape(-1), torch.full((1,), end, device=device, dtype=x.dtype)])

    segments = ChunkTables(
        with_end(bounds[..., 0], N * T),
        with_end(bounds[..., 2], N * chunks),
        tables.chunk_spans,
        tables.n_chunks,
        tables.placeholder,
    )
    return SegmentTables(
        L,
        R - 1,
        fwd,
        rev,
        segments,
        (r * N + n).reshape(-1),
        ((R - 1 - r) * N + n).reshape(-1),
        n[:, 0] * R,
        n[:, 0] * R + R - 1,
    )


# Segment tables of packed sequences per chunk-table object and segment length: chunk_tables
# caches its tables per batch layout, so the same object comes back every layer and step.
# Building waits for the GPU once per layout: packed offsets are read on the host (as
# build_chunk_tables' chunk count already is) and the tables are copied from host lists. Their
# ops are cudagraph_unsafe (triton_ops.py): never captured.
SEGMENT_CACHE_SIZE = 16
_segment_cache: OrderedDict[tuple[int, int], tuple[ChunkTables, SegmentTables]] = OrderedDict()
# Dense batches' tables per shape and segment length (common.GraphSafeCache: built outside the
# graph pools, pinned once a CUDA-graph capture has used them, built inside on a capture's miss).
_dense_cache: GraphSafeCache[SegmentTables] = GraphSafeCache(SEGMENT_CACHE_SIZE)


def segment_tables(
    tables: ChunkTables, B: int, T: int, packed: bool, segment_chunks: int
) -> SegmentTables:
    """The segment tables of a batch (``B`` rows of ``T`` tokens unless ``packed``), cached:
    dense ones by shape (:func:`build_dense_segment_tables`: no sync, safe under CUDA-graph
    capture), packed ones by the chunk tables' identity (:func:`build_segment_tables`)."""
    device = tables.cu_seqlens.device
    if not packed:
        return _dense_cache.get(
            (B, T, segment_chunks, device),
            lambda: build_dense_segment_tables(B, T, segment_chunks, tables, device),
            device,
        )
    key = (id(tables), segment_chunks)
    hit = _segment_cache.get(key)
    if hit is not None and hit[0] is tables:
        _segment_cache.move_to_end(key)
        return hit[1]
    built = build_segment_tables(tables.cu_seqlens.tolist(), segment_chunks, tables, device)
    _segment_cache[key] = (tables, built)
    while len(_segment_cache) > SEGMENT_CACHE_SIZE:
        _segment_cache.popitem(last=False)
    return built


# Step 3 of the reverse pass (dstates.launch_dstates over the segments): key rows per state
# block (0: the pass's own) and a register cap (0: the pass's). Its launches hold many more
# programs than a sequence-long pass (segments × heads × value blocks), so three an SM beat two
# with fewer spills. Measured (H200, session 21 call 3, bf16, forward + backward, every reverse
# pass at 64 rows capped at 168 registers): (1, 32768, 16, 128), segmented, 5.050 → 4.850 ms,
# while the sequence-long passes lost (8, 4096, 16, 128) 3.228 → 3.494, D = 256 10.99 → 11.54:
# hence for step 3 alone.
SEGMENT_DSTATES_SPLIT_K = 64
SEGMENT_DSTATES_MAXNREG = 168
# The same for the forward-side pass's step 3 (the forward's and the backward's recompute: one
# setting, so both compute the same h). Untimed (session 21: no device time left): off.
SEGMENT_STATES_SPLIT_K = 0
SEGMENT_STATES_MAXNREG = 0


# ---------------------------------------------------------------------------- step 1 (kernels)
@triton.jit
def _slot(
    bounds_ptr,
    i_v,
    i_sh,
    N,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BV: tl.constexpr,
    NKB: tl.constexpr,
):
    """A step-1 program's segment slot, head and columns of ``[P | S]``: blocks ``i_v < NKB``
    are transition columns (of Dk), the others value columns (of Dv)."""
    i_slot, i_h = i_sh // H, i_sh % H
    start = tl.load(bounds_ptr + 3 * i_slot)
    end = tl.load(bounds_ptr + 3 * i_slot + 1)
    c_first = tl.load(bounds_ptr + 3 * i_slot + 2)
    is_value = i_v >= NKB
    col = tl.where(is_value, i_v - NKB, i_v) * BV + tl.arange(0, BV)
    mask_col = col < tl.where(is_value, Dv, Dk)
    # the chain's first row: the forward's first segment, the reverse's last
    outer = i_slot < N
    return i_slot % N, i_h, start, end, c_first, is_value, col, mask_col, outer


@triton.jit
def _start_state(
    s_ptr,
    i_n,
    i_h,
    offs_k,
    mask_k,
    col,
    mask_col,
    is_value,
    outer,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    HAS_S: tl.constexpr,
):
    """``[I | 0]``; in the chain's first row ``[0 | S]``, S the sequence's initial state (the
    forward) or its final state's gradient (the reverse) where given, else 0. That row's
    transition multiplies the chain's X_0 = 0: it stays 0 (and its walk is skipped)."""
    mask = mask_k[:, None] & mask_col[None, :]
    eye = tl.where((offs_k[:, None] == col[None, :]) & mask, 1.0, 0.0)
    S = tl.where(is_value | outer, 0.0, eye)
    if HAS_S:
        offs = (i_n * H + i_h).to(tl.int64) * Dk * Dv + offs_k[:, None] * Dv + col[None, :]
        # a bool block and a scalar flag: combined by comparison (the interpreter's & of the two
        # is an int block, which a mask refuses)
        rows = tl.where(is_value & outer, Dk, 0)
        S += tl.load(s_ptr + offs, mask=(offs_k < rows)[:, None] & mask_col[None, :], other=0.0)
    return S


@triton.jit
def segment_states_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    trans_ptr,
    first_bad_ptr,
    bounds_ptr,
    N,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NKB: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
    G_AHEAD: tl.constexpr,
):
    """Step 1 forward: ``[P | S_loc]`` of one segment, head and BV columns, stored at the
    segment's end (fp32; NaN after a chunk with a non-finite input, as the state pass's states)."""
    i_sh, i_v = tl.program_id(0), tl.program_id(1)  # rows first: grid dim 0 has no 65535 cap
    i_n, i_h, start, end, c_first, is_value, col, mask_col, outer = _slot(
        bounds_ptr, i_v, i_sh, N, H, Dk, Dv, BV, NKB
    )
    DT = w_ptr.dtype.element_ty
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    state_mask = mask_k[:, None] & mask_col[None, :]
    S = _start_state(
        s0_ptr, i_n, i_h, offs_k, mask_k, col, mask_col, is_value, outer, H, Dk, Dv, HAS_S0
    )
    n_chunks = tl.where(outer & (i_v < NKB), 0, tl.cdiv(end - start, CHUNK))
    mask_u = col < tl.where(is_value, Dv, 0)  # the transition columns' values are 0
    poison = 0.0
    g_next = log_alpha_rows(g_ptr, start + rows, start, end, i_h, H, HAS_DECAY and G_AHEAD)
    for j in range(0, n_chunks):
        offs_t = start + j * CHUNK + rows
        mask_t = offs_t < end
        b_w = load_rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_u = load_rows(u_ptr, offs_t, mask_t, i_h, col, mask_u, H, Dv).to(tl.float32)
        gamma, g_next = gamma_and_next(g_next, g_ptr, offs_t, mask_t, CHUNK, start, end, i_h, H,
                                       HAS_DECAY, G_AHEAD)  # fmt: skip
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
        U = chunk_u(b_u, b_w, S, DT, PREC)
        S = chunk_state_update(S, U, b_k, gamma, gamma_last, DT, PREC)
        first_bad = tl.load(first_bad_ptr + (c_first + j).to(tl.int64) * H + i_h)
        poison += tl.where(first_bad < CHUNK, float("nan"), 0.0)
    out_col = tl.where(is_value, Dk, 0) + col
    out_offs = (i_sh.to(tl.int64) * Dk + offs_k[:, None]) * (Dk + Dv) + out_col[None, :]
    tl.store(trans_ptr + out_offs, S + poison, mask=state_mask)


@triton.jit
def segment_dstates_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    g_ptr,
    do_ptr,
    dsT_ptr,
    trans_ptr,
    bounds_ptr,
    scale,
    N,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NKB: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_DST: tl.constexpr,
    PREC: tl.constexpr,
):
    """Step 1 reverse: ``[Pᵀ | G_loc]`` of one segment, head and BV columns, from its last chunk
    to its first (the reverse pass's chunk step, (7)–(8); the transition columns have dO = 0,
    so they skip the products with Q and dO), stored at the segment's start in fp32."""
    i_sh, i_v = tl.program_id(0), tl.program_id(1)  # rows first: grid dim 0 has no 65535 cap
    i_n, i_h, start, end, c_first, is_value, col, mask_col, outer = _slot(
        bounds_ptr, i_v, i_sh, N, H, Dk, Dv, BV, NKB
    )
    DT = w_ptr.dtype.element_ty
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    state_mask = mask_k[:, None] & mask_col[None, :]
    G = _start_state(
        dsT_ptr, i_n, i_h, offs_k, mask_k, col, mask_col, is_value, outer, H, Dk, Dv, HAS_DST
    )
    n_chunks = tl.where(outer & (i_v < NKB), 0, tl.cdiv(end - start, CHUNK))
    for jj in range(0, n_chunks):
        offs_t = start + (n_chunks - 1 - jj) * CHUNK + rows
        mask_t = offs_t < end
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_w = load_rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
        dU = du_from_state(G, b_k, gamma, gamma_last, DT, PREC)
        G_carry = tl.exp(gamma_last) * G
        if is_value:  # a runtime branch: the transition blocks skip three of the five dots
            b_q = load_rows(q_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
            b_do = load_rows(do_ptr, offs_t, mask_t, i_h, col, mask_col, H, Dv).to(DT)
            dU = du_add_outputs(dU, b_q, b_k, b_do, gamma, scale, DT, PREC)
            do_gamma = scaled_grad_o(b_do, gamma, scale)
            G_carry = dstate_add_outputs(G_carry, b_q, do_gamma, DT, PREC)
        G = dstate_finish(G_carry, b_w, dU, DT, PREC)
    out_col = tl.where(is_value, Dk, 0) + col
    out_offs = (i_sh.to(tl.int64) * Dk + offs_k[:, None]) * (Dk + Dv) + out_col[None, :]
    tl.store(trans_ptr + out_offs, G, mask=state_mask)


# ---------------------------------------------------------------------------- the launchers
def step_blocks(Dk: int, Dv: int, block_v: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Step 1's (BV, transition blocks, value blocks) at ``block_v``: one width for both kinds
    of columns, with the floors every launcher's blocks take for ``dtype`` (common.head_block)."""
    BV = min(block_v, head_block(Dk, dtype), head_block(Dv, dtype))
    return BV, cdiv(Dk, BV), cdiv(Dv, BV)


def launch_segmented_states(
    k: Tensor,
    *,
    w: Tensor,
    u: Tensor,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    first_bad: Tensor,
    tables: ChunkTables,
    segments: SegmentTables,
    block_v: int,
    h: Tensor,
    v_new: Tensor,
    final_state: Tensor,
    output: Callable[..., Tensor],
    keep: Tensor | None = None,
    entering: Tensor | None = None,
) -> None:
    """``states.launch_states`` (same outputs) in three steps over ``segments``; ``output``
    allocates the intermediate buffers (``triton_backend._output``). ``keep``: fp32
    ``[rows, H, Dk, Dv]``, rows at least the segments', into which the chain writes the state
    entering each segment (the forward keeps them: ``triton_backend.KEEP_SEGMENT_STATES``).
    ``entering``: such states, kept by a forward whose steps 1 and 2 the caller knows to give
    these very states (the backward's recompute): only step 3 runs."""
    H, Dk, Dv = k.shape[2], k.shape[3], u.shape[3]
    N = tables.cu_seqlens.numel() - 1
    n_seg = segments.fwd_row.numel()
    for name, x in (("keep", keep), ("entering", entering)):
        if x is not None and x.shape[0] < n_seg:  # a shape bound (kept_segment_rows) too low
            raise ValueError(f"{name} has {x.shape[0]} rows for {n_seg} segments")
    common = dict(first_bad=first_bad, block_v=block_v, h=h, v_new=v_new)
    if segments.slots == 0:  # every sequence is one segment: the sequential pass
        launch_states(
            k,
            w=w,
            u=u,
            log_decay=log_decay,
            initial_state=initial_state,
            tables=tables,
            final_state=final_state,
            **common,
        )
        return
    if entering is None:  # steps 1 and 2
        BV, NKB, NVB = step_blocks(Dk, Dv, block_v, k.dtype)
        trans = output(segments.slots, N, H, Dk, Dk + Dv, like=k, dtype=torch.float32)
        segment_states_kernel[(segments.slots * N * H, NKB + NVB)](
            k_ptr=k,
            w_ptr=w,
            u_ptr=u,
            g_ptr=k if log_decay is None else log_decay,
            s0_ptr=k if initial_state is None else initial_state,
            trans_ptr=trans,
            first_bad_ptr=first_bad,
            bounds_ptr=segments.fwd_bounds,
            N=N,
            H=H,
            Dk=Dk,
            Dv=Dv,
            BK=key_block(Dk, Dv, k.dtype),
            BV=BV,
            NKB=NKB,
            HAS_DECAY=log_decay is not None,
            HAS_S0=initial_state is not None,
            PREC=dot_precision(k.dtype),
            G_AHEAD=log_alpha_ahead(),
            num_warps=states.STATES_WARPS,
            num_stages=states.pass_stages(key_block(Dk, Dv, k.dtype), split=False),
        )
        entering = chain_segments(
            trans,
            initial_state,
            first=segments.first,
            last=segments.last,
            rows=segments.fwd_row,
            reverse=False,
            output=output,
            out=None if keep is None else keep[:n_seg],
        )
    ends = output(n_seg, H, Dk, Dv, like=k, dtype=torch.float32)
    launch_states(
        k,
        w=w,
        u=u,
        log_decay=log_decay,
        initial_state=entering[:n_seg],
        tables=segments.segments,
        final_state=ends,
        split_k=SEGMENT_STATES_SPLIT_K,
        maxnreg=SEGMENT_STATES_MAXNREG,
        **common,
    )
    torch.index_select(ends, 0, segments.last, out=final_state)


def launch_segmented_dstates(
    q: Tensor,
    k: Tensor,
    *,
    w: Tensor,
    log_decay: Tensor | None,
    grad_o: Tensor,
    grad_final_state: Tensor | None,
    tables: ChunkTables,
    segments: SegmentTables,
    scale: float,
    dh: Tensor,
    du: Tensor,
    d_initial_state: Tensor,
    output: Callable[..., Tensor],
) -> None:
    """``dstates.launch_dstates`` (same outputs) in three steps over ``segments``."""
    H, Dk, Dv = q.shape[2], q.shape[3], grad_o.shape[3]
    N = tables.cu_seqlens.numel() - 1
    n_seg = segments.rev_row.numel()
    common = dict(w=w, log_decay=log_decay, grad_o=grad_o, scale=scale, dh=dh, du=du)
    if segments.slots == 0:
        launch_dstates(
            q,
            k,
            grad_final_state=grad_final_state,
            tables=tables,
            d_initial_state=d_initial_state,
            **common,
        )
        return
    BV, NKB, NVB = step_blocks(Dk, Dv, dstates.DSTATES_BV, q.dtype)
    trans = output(segments.slots, N, H, Dk, Dk + Dv, like=q, dtype=torch.float32)
    segment_dstates_kernel[(segments.slots * N * H, NKB + NVB)](
        q_ptr=q,
        k_ptr=k,
        w_ptr=w,
        g_ptr=q if log_decay is None else log_decay,
        do_ptr=grad_o,
        dsT_ptr=tables.placeholder if grad_final_state is None else grad_final_state,
        trans_ptr=trans,
        bounds_ptr=segments.rev_bounds,
        scale=scale,
        N=N,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=key_block(Dk, Dv, q.dtype),
        BV=BV,
        NKB=NKB,
        HAS_DECAY=log_decay is not None,
        HAS_DST=grad_final_state is not None,
        PREC=dot_precision(q.dtype),
        num_warps=dstates.DSTATES_WARPS,
        num_stages=dstates.dstates_stages(key_block(Dk, Dv, q.dtype), split=False),
    )
    leaving = chain_segments(
        trans,
        grad_final_state,
        first=segments.first,
        last=segments.last,
        rows=segments.rev_row,
        reverse=True,
        output=output,
    )
    starts = output(n_seg, H, Dk, Dv, like=q, dtype=torch.float32)
    launch_dstates(
        q,
        k,
        grad_final_state=leaving,
        tables=segments.segments,
        d_initial_state=starts,
        split_k=SEGMENT_DSTATES_SPLIT_K,
        maxnreg=SEGMENT_DSTATES_MAXNREG,
        **common,
    )
    torch.index_select(starts, 0, segments.first, out=d_initial_state)
