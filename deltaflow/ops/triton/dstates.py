"""Stage 2 of the backward, per sequence: the reverse state-gradient pass, (7)–(8) of
docs/design.md §7. One program per sequence, head and block of value columns walks the chunks
from the last to the first with the state's gradient G in registers:

- ``chunk_dstates_kernel``: dU = scale·Pᵀ dO + K̃ G and G ← scale·(diag(Γ) Q)ᵀ dO + Γ_C G − Wᵀ dU,
  storing G leaving every chunk (dh, for the gradients of gradients.py) and dU.

Its chunk step is four jit helpers, shared with ``segment_states.py`` (the same pass split
across segments of a sequence), and a launch whose key block is wider than the reverse pass's
rows per block (``dstates_split_k``) runs ``states_split.split_dstates_kernel`` instead (the
state in row blocks), which may read scale·P from the backward's rebuild instead of forming
Q Kᵀ in every value block's program (``DSTATES_P``). What it shares with the forward's
passes stays in ``states.py``: the split kernels' rows and launch (``split_rows``,
``split_launch``, ``STATES_SPLIT_K``).

No poison (docs/design.md §8): gradients are not made causal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import states  # STATES_SPLIT_K read at call time (sweepable)
from deltaflow.ops.triton.common import (
    CHUNK,
    ChunkTables,
    cdiv,
    decay_matrix,
    dot_precision,
    dot_split,
    gamma_and_next,
    head_block,
    key_block,
    load_rows,
    log_alpha_ahead,
    log_alpha_rows,
    scaled_grad_o,
)
from deltaflow.ops.triton.states import split_launch, split_rows
from deltaflow.ops.triton.states_split import split_dstates_kernel

# Launch settings (benchmarks/NOTES.md; benchmarks/tune_backward.py sweeps them): value columns
# and warps of a program.
DSTATES_BV = 64
DSTATES_WARPS = 4
# Its pipeline stages at key blocks up to DSTATES_STAGES_MAX_BK (dstates_stages; H200, sessions
# 20-21 call 1: 3 stages gain at D = 64, 2 lose 0.2 ms at D = 128, D = 256 out of shared memory).
DSTATES_STAGES = 3
DSTATES_STAGES_MAX_BK = 64
# The reverse pass's own rows per block (0: STATES_SPLIT_K's) above DSTATES_SPLIT_ABOVE_BK rows
# (0: wherever it splits): D = 256 in four blocks (−0.15 ms), D = 128 whole (benchmarks/NOTES.md).
DSTATES_SPLIT_K = 64
DSTATES_SPLIT_ABOVE_BK = 128
# A register cap for the reverse pass (0: none): ptxas fills 246-255 a thread at 4 warps
# whatever the blocks (AOT sm_90), two programs an SM; 168 leaves room for three.
DSTATES_MAXNREG = 0
# The split kernel reads scale·P from the backward's rebuild (SAVE_FOR_BACKWARD "t"), once a
# chunk, rather than each value block's program forming Q Kᵀ, as the split forward reads P from
# the prepare (states.SPLIT_FORWARD_P). H200, session 24 call 3, (8, 2048, 32, 256) bf16:
# split_dstates 2.475 → 1.955 ms, the rebuild 0.41 → 0.60, forward + backward −0.33 ms. Not in
# fp16, as the forward's (its fp16 fault on the H200 unexplained: benchmarks/NOTES.md).
DSTATES_P = True
DSTATES_P_SKIP = (torch.float16,)


# The reverse pass's chunk step in four parts: the segments' reverse pass (segment_states.py)
# runs the two that see dO only on its value columns (its transition columns have dO = 0).
@triton.jit
def du_from_state(G, b_k, gamma, gamma_last, DT: tl.constexpr, PREC: tl.constexpr):
    """(8)'s K̃ G = diag(e^{γ_C − γ}) (K G): the row scale after the product, so the keys enter
    it exact rather than rounded to DT as K̃ (benchmarks/bf16_floor.py, knob rev_K: with fwd_K,
    the D=256 dβ tail; issue 30)."""
    return tl.exp(gamma_last - gamma)[:, None] * tl.dot(b_k, G.to(DT), input_precision=PREC)


@triton.jit
def du_add_outputs(dU, b_q, b_k, b_do, gamma, scale, DT: tl.constexpr, PREC: tl.constexpr):
    """dU + scale·Pᵀ dO of (8), P = (Q Kᵀ) ⊙ D, accumulated into dU (one accumulator live)."""
    P = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay_matrix(gamma)
    return tl.dot(tl.trans((scale * P).to(DT)), b_do, acc=dU, input_precision=PREC)


@triton.jit
def dstate_add_outputs(G_carry, b_q, do_gamma, DT: tl.constexpr, PREC: tl.constexpr):
    """G_carry + scale·(diag(Γ) Q)ᵀ dO of (7), computed as Qᵀ (scale·diag(Γ) dO) with the
    scaled dO (``scaled_grad_o``, fp32) not rounded to DT: it enters as hi + lo, as fla keeps
    Γq in fp32 (a rounding there was noise the bf16 floor does not have; issue 30 item 4). The
    row scale sits on dO's [C, BV] rather than Q's [C, BK] (issue 32, session 22): the same sum
    and accuracy class (Q exact, the scaled side to ~16 bits), half the fp32 registers at
    D = 128 and one split for all of a split pass's row blocks."""
    return dot_split(tl.trans(b_q), do_gamma, G_carry, DT, PREC)


@triton.jit
def dstate_finish(G_carry, b_w, dU, DT: tl.constexpr, PREC: tl.constexpr):
    """(7)'s last term: the gradient of S_0, G_carry − Wᵀ dU (G_carry: Γ_C G + the outputs')."""
    return G_carry - tl.dot(tl.trans(b_w), dU.to(DT), input_precision=PREC)


@triton.jit
def chunk_dstates_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    g_ptr,
    do_ptr,
    dsT_ptr,
    dh_ptr,
    du_ptr,
    ds0_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_DST: tl.constexpr,
    PREC: tl.constexpr,
    G_AHEAD: tl.constexpr,
):
    """(7)–(8) along one sequence from its end, for one head and BV value columns:
    dU = scale·Pᵀ dO + K̃ G,   G ← scale·(diag(Γ) Q)ᵀ dO + Γ_C G − Wᵀ dU,
    with G the gradient of the state leaving the chunk (stored as dh) and K̃ = diag(e^{γ_C − γ}) K.
    G_AHEAD: the next chunk's (the one before) log α loaded a step early (LOG_ALPHA_AHEAD).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    state_mask = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * Dv + offs_v[None, :]
    if HAS_DST:
        G = tl.load(dsT_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, mask=state_mask, other=0.0)
    else:
        G = tl.zeros([BK, BV], dtype=tl.float32)

    n_chunks = tl.cdiv(eos - bos, CHUNK)
    last_rows = bos + (n_chunks - 1) * CHUNK + rows
    g_next = log_alpha_rows(g_ptr, last_rows, bos, eos, i_h, H, HAS_DECAY and G_AHEAD)
    for jj in range(0, n_chunks):
        j = n_chunks - 1 - jj
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        tl.store(
            dh_ptr + (c * H + i_h) * Dk * Dv + state_offs,
            G.to(dh_ptr.dtype.element_ty),
            mask=state_mask,
        )
        b_q = load_rows(q_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_w = load_rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        b_do = load_rows(do_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(DT)
        gamma, g_next = gamma_and_next(g_next, g_ptr, offs_t, mask_t, -CHUNK, bos, eos, i_h, H,
                                       HAS_DECAY, G_AHEAD)  # fmt: skip
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)
        # (8) dU = K̃ G + scale·Pᵀ dO
        dU = du_from_state(G, b_k, gamma, gamma_last, DT, PREC)
        dU = du_add_outputs(dU, b_q, b_k, b_do, gamma, scale, DT, PREC)
        tl.store(
            du_ptr + (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :],
            dU.to(DT),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        # (7) G ← scale·(diag(Γ) Q)ᵀ dO + Γ_C G − Wᵀ dU
        do_gamma = scaled_grad_o(b_do, gamma, scale)
        G_carry = dstate_add_outputs(tl.exp(gamma_last) * G, b_q, do_gamma, DT, PREC)
        G = dstate_finish(G_carry, b_w, dU, DT, PREC)

    tl.store(ds0_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, G, mask=state_mask)


def dstates_split_k(BK: int) -> int:
    """The reverse pass's rows per block over a key block of ``BK`` rows, for split_rows:
    DSTATES_SPLIT_K above DSTATES_SPLIT_ABOVE_BK rows, else STATES_SPLIT_K."""
    if DSTATES_SPLIT_K and BK > DSTATES_SPLIT_ABOVE_BK:
        return DSTATES_SPLIT_K
    return states.STATES_SPLIT_K


def dstates_takes_p(Dk: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether the reverse pass over heads of ``Dk`` / ``Dv`` columns (``dtype``: its dot dtype;
    a sequence-long launch, not the segments') reads the rebuild's scale·P (DSTATES_P; the split
    kernel only)."""
    if not DSTATES_P or dtype in DSTATES_P_SKIP:
        return False
    BK = key_block(Dk, Dv, dtype)
    return bool(split_rows(BK, dtype, dstates_split_k(BK)))


def dstates_stages(BK: int, *, split: bool) -> int:
    """Pipeline stages of the reverse pass over key blocks of ``BK`` rows (``split``: the
    row-block kernel of states_split.py): DSTATES_STAGES where they were measured to help, else
    1 (``states.pass_stages``: the forward's passes')."""
    if split:
        return 1
    return DSTATES_STAGES if BK <= DSTATES_STAGES_MAX_BK else 1


def launch_dstates(
    q: Tensor,
    k: Tensor,
    *,
    w: Tensor,
    log_decay: Tensor | None,
    grad_o: Tensor,
    grad_final_state: Tensor | None,
    tables: ChunkTables,
    scale: float,
    dh: Tensor,
    du: Tensor,
    d_initial_state: Tensor,
    split_k: int = 0,
    maxnreg: int = 0,
    p: Tensor | None = None,
) -> None:
    """(7)–(8) from each sequence's end: ``dh`` (the state's gradient leaving every chunk),
    ``du`` (dU, like v) and ``d_initial_state`` ([N, H, Dk, Dv] fp32). ``grad_final_state``
    None: the final state was not used (its gradient is zero, and no zeros are read).
    ``split_k``, ``maxnreg``: the caller's rows per block and register cap (0: dstates_split_k's
    rows, DSTATES_MAXNREG): the segments' step 3 takes its own. ``p``: the rebuild's scale·P for
    the split kernel (``dstates_takes_p``), else None."""
    H, Dk, Dv = q.shape[2], q.shape[3], grad_o.shape[3]
    N = tables.cu_seqlens.numel() - 1
    BK = key_block(Dk, Dv, q.dtype)
    BV = min(head_block(Dv, q.dtype), DSTATES_BV)
    split = split_launch(BK, q.dtype, split_k or dstates_split_k(BK))
    launch = {"num_warps": DSTATES_WARPS, **split}
    if maxnreg or DSTATES_MAXNREG:
        launch["maxnreg"] = maxnreg or DSTATES_MAXNREG
    kernel = split_dstates_kernel if "BKS" in launch else chunk_dstates_kernel
    if "BKS" in launch:
        launch.update(p_ptr=tables.placeholder if p is None else p, HAS_P=p is not None)
    elif p is not None:
        raise ValueError("launch_dstates: p is for the split reverse pass (dstates_takes_p)")
    else:
        launch["G_AHEAD"] = log_alpha_ahead()
    kernel[(cdiv(Dv, BV), N * H)](
        q_ptr=q,
        k_ptr=k,
        w_ptr=w,
        g_ptr=q if log_decay is None else log_decay,
        do_ptr=grad_o,
        dsT_ptr=tables.placeholder if grad_final_state is None else grad_final_state,
        dh_ptr=dh,
        du_ptr=du,
        ds0_ptr=d_initial_state,
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_offsets_ptr=tables.chunk_offsets,
        scale=scale,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BV,
        HAS_DECAY=log_decay is not None,
        HAS_DST=grad_final_state is not None,
        PREC=dot_precision(q.dtype),
        **launch,
        num_stages=dstates_stages(BK, split="BKS" in launch),
    )
