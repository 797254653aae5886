"""Stage 3 of the forward's two-pass form, parallel over every chunk: the outputs (5) of
docs/design.md §3 from the state entering the chunk and U, both stored by the state pass
(states.py ``chunk_states_kernel``). The two-pass form runs where the fused forward would
have fewer programs than the GPU has multiprocessors (few sequences × heads)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton.common import (
    CHUNK,
    ChunkTables,
    cdiv,
    chunk_bounds,
    chunk_gamma,
    decay_matrix,
    dot_precision,
    head_block,
    key_block,
    load_rows,
)

# Launch settings (benchmarks/NOTES.md).
OUTPUT_BV = 64
OUTPUT_WARPS = 4


@triton.jit
def chunk_output_kernel(
    q_ptr,
    k_ptr,
    h_ptr,
    v_new_ptr,
    g_ptr,
    o_ptr,
    first_bad_ptr,
    chunk_spans_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """(5) for one chunk, head and value block: O = scale [diag(Γ) Q S_0 + P U]; rows from the
    chunk's first non-finite token on are NaN (a poison on Γ_i; P masked by selection)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, eos = chunk_bounds(chunk_spans_ptr, i_c)
    DT = v_new_ptr.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    offs_t = t0 + rows
    mask_t = offs_t < eos
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    b_q = load_rows(q_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
    b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
    b_u = load_rows(v_new_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv)
    S0 = tl.load(
        h_ptr + (i_c.to(tl.int64) * H + i_h) * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :],
        mask=mask_k[:, None] & mask_v[None, :],
        other=0.0,
    )
    gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
    causal = rows[:, None] >= rows[None, :]
    decay = decay_matrix(gamma)
    P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay, 0.0)
    first_bad = tl.load(first_bad_ptr + i_c * H + i_h)
    row_scale = tl.exp(gamma) + tl.where(rows >= first_bad, float("nan"), 0.0)
    b_o = row_scale[:, None] * tl.dot(b_q, S0.to(DT), input_precision=PREC)
    b_o += tl.dot(P.to(DT), b_u, input_precision=PREC)
    tl.store(
        o_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
        (scale * b_o).to(o_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_v[None, :],
    )


def launch_outputs(
    q: Tensor,
    k: Tensor,
    *,
    h: Tensor,
    v_new: Tensor,
    log_decay: Tensor | None,
    first_bad: Tensor,
    tables: ChunkTables,
    scale: float,
    o: Tensor,
) -> None:
    """(5) for every chunk at once: ``o`` (like v) from ``h`` and ``v_new`` of the state pass."""
    if tables.n_chunks == 0:
        return
    H, Dk, Dv = q.shape[2], q.shape[3], v_new.shape[3]
    BV = min(head_block(Dv, q.dtype), OUTPUT_BV)
    chunk_output_kernel[(cdiv(Dv, BV), tables.n_chunks, H)](
        q_ptr=q,
        k_ptr=k,
        h_ptr=h,
        v_new_ptr=v_new,
        g_ptr=q if log_decay is None else log_decay,
        o_ptr=o,
        first_bad_ptr=first_bad,
        chunk_spans_ptr=tables.chunk_spans,
        scale=scale,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=key_block(Dk, Dv, q.dtype),
        BV=BV,
        HAS_DECAY=log_decay is not None,
        PREC=dot_precision(q.dtype),
        num_warps=OUTPUT_WARPS,
    )
