"""Step 2 of the segmented state passes (``segment_states.py``) in one launch: the chain across
segments ``X_{r+1} = P_r X_r + S_r`` for every sequence and head at once, with each ``X_r``
written straight into the per-segment layout the third step reads.

The math is :func:`deltaflow.ops.segments.chain`'s (the context-parallel chain), which stays the
reference and the fallback (``SEGMENT_CHAIN = "torch"``): that form costs ``2·(R − 1) + 3`` small
torch launches a pass (a matmul and an add per segment, the zeros, the stack and the gather; the
first row's copy where there is an initial state), 17 at the model's R = 8, on a host that is
already the model step's bottleneck, and as many nodes in a CUDA graph; this kernel is one
(benchmarks/NOTES.md, "Issue 32, session 18"). ``tests/test_segment_graph_safety.py`` checks the
two against each other.

Only the value columns of ``X`` depend on the chain: a segment's third step needs the state
entering it, never the composite transition, so the ``Dk`` transition columns of step 1's
``[P | S]`` are read as the matrix and not chained. A program owns one (sequence, head) and
``CHAIN_BV`` columns of ``X``, holds ``X`` in registers (fp32) and walks the sequence's
segments: per step one ``Dk × Dk`` by ``Dk × BV`` product. ``P`` and ``S`` do not depend on
``X``, so the loop's loads pipeline ahead of the products (``CHAIN_STAGES``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.segments import chain
from deltaflow.ops.triton.common import cdiv, dot_precision, head_block

# "triton": this module's kernel; "torch": segments.chain, R − 1 batched matmuls (the reference,
# kept as the fallback, and taken for key heads wider than CHAIN_MAX_DK and for transitions not
# in fp32, which step 1 never writes).
SEGMENT_CHAIN = "triton"
# Value columns of X a program: 32 gives N·H·⌈Dv/32⌉ programs (64 at the model's B=2, H=8,
# Dv=128), each step a [Dk, Dk] x [Dk, 32] product; the chain's latency is its R steps whatever
# the width, so narrower blocks only spread the P reads over more multiprocessors.
CHAIN_BV = 32
CHAIN_WARPS = 8  # P is a [128, 128] fp32 tile at Dk = 128 (64 KB): 8 warps hold it
CHAIN_STAGES = 2
# The widest key head the kernel takes: P's tile grows as Dk²; wider heads use the torch chain.
CHAIN_MAX_DK = 128


@triton.jit
def segment_chain_kernel(
    trans_ptr,
    outer_ptr,
    out_ptr,
    first_ptr,
    last_ptr,
    N,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    REVERSE: tl.constexpr,
    HAS_OUTER: tl.constexpr,
    PREC: tl.constexpr,
):
    """``X`` entering every segment of one sequence and head, BV columns: ``X_0`` = the outer
    state (the initial state forward, the final state's gradient in reverse; 0 where absent),
    then ``X_{j+1} = P_j X_j + S_j`` from row ``j·N + n`` of ``trans`` ([rows, N, H, Dk,
    Dk + Dv], fp32: step 1's layout, segments.chain's input). Chain position ``j`` is segment
    ``first + j`` forward and ``last − j`` in reverse; its ``X_j`` goes to ``out`` ([segments,
    H, Dk, Dv])."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    first = tl.load(first_ptr + i_n)
    last = tl.load(last_ptr + i_n)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < Dk
    col = i_v * BV + tl.arange(0, BV)
    mask_x = mask_k[:, None] & (col < Dv)[None, :]
    x_offs = offs_k[:, None] * Dv + col[None, :]
    if REVERSE:
        seg = last
    else:
        seg = first
    head_x = (seg * H + i_h) * Dk * Dv
    if HAS_OUTER:
        outer = tl.load(outer_ptr + (i_n * H + i_h).to(tl.int64) * Dk * Dv + x_offs, mask=mask_x)
        tl.store(out_ptr + head_x + x_offs, outer, mask=mask_x)
    else:
        tl.store(out_ptr + head_x + x_offs, tl.zeros([BK, BV], dtype=tl.float32), mask=mask_x)
    # segments.chain starts from X_0 = 0 and the caller puts the outer state in the first row
    # afterwards: row 0's P is 0 (step 1 skips that walk) and S already holds the outer state's
    # effect, so the outer state never enters a product (no 0 · inf for a non-finite one).
    X = tl.zeros([BK, BV], dtype=tl.float32)
    width = Dk + Dv
    p_offs = offs_k[:, None] * width + offs_k[None, :]
    s_offs = offs_k[:, None] * width + Dk + col[None, :]
    mask_p = mask_k[:, None] & mask_k[None, :]
    for j in range(0, last - first):
        row = ((j * N + i_n) * H + i_h).to(tl.int64) * Dk * width
        P = tl.load(trans_ptr + row + p_offs, mask=mask_p, other=0.0)
        S = tl.load(trans_ptr + row + s_offs, mask=mask_x, other=0.0)
        X = tl.dot(P, X, acc=S, input_precision=PREC)
        if REVERSE:
            seg = last - j - 1
        else:
            seg = first + j + 1
        tl.store(out_ptr + (seg * H + i_h) * Dk * Dv + x_offs, X, mask=mask_x)


def chain_segments(
    transitions: Tensor,
    outer: Tensor | None,
    *,
    first: Tensor,
    last: Tensor,
    rows: Tensor,
    reverse: bool,
    output: Callable[..., Tensor],
    out: Tensor | None = None,
) -> Tensor:
    """The state entering every segment (forward) or the gradient leaving it (reverse),
    ``[segments, H, Dk, Dv]`` fp32, from step 1's ``transitions`` (``[R − 1, N, H, Dk, Dk + Dv]``)
    and ``outer`` (``[N, H, Dk, Dv]`` fp32 or None: 0). ``first`` / ``last``: each sequence's
    first and last segment; ``rows``: the chain row of every segment (the torch form's gather).
    Written into ``out`` where given (a contiguous buffer of that shape: the forward's kept
    states, segment_states.launch_segmented_states), else into one ``output`` allocates
    (``triton_backend._output``)."""
    _, N, H, Dk, width = transitions.shape
    Dv = width - Dk
    if SEGMENT_CHAIN not in ("triton", "torch"):
        raise ValueError(
            f"segment_chain.SEGMENT_CHAIN must be 'triton' or 'torch', got {SEGMENT_CHAIN!r}"
        )
    if SEGMENT_CHAIN == "torch" or Dk > CHAIN_MAX_DK or transitions.dtype != torch.float32:
        X = torch_chain(transitions, outer, rows)
        return X if out is None else out.copy_(X)
    if out is None:
        out = output(rows.numel(), H, Dk, Dv, like=transitions, dtype=torch.float32)
    BV = min(CHAIN_BV, head_block(Dv))
    segment_chain_kernel[(N * H, cdiv(Dv, BV))](
        trans_ptr=transitions,
        outer_ptr=transitions if outer is None else outer,
        out_ptr=out,
        first_ptr=first,
        last_ptr=last,
        N=N,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=head_block(Dk),
        BV=BV,
        REVERSE=reverse,
        HAS_OUTER=outer is not None,
        PREC=dot_precision(torch.float32),
        num_warps=CHAIN_WARPS,
        num_stages=CHAIN_STAGES,
    )
    return out


def torch_chain(transitions: Tensor, outer: Tensor | None, rows: Tensor) -> Tensor:
    """:func:`chain_segments` in torch: ``segments.chain`` of ``transitions`` with ``outer``
    (None: 0) as its first row, gathered to the segments by their chain ``rows``."""
    with torch.autocast(transitions.device.type, enabled=False):  # the chain stays in fp32
        X = chain(transitions)
    if outer is not None:
        X[0].copy_(outer)
    return X.flatten(0, 1).index_select(0, rows)
