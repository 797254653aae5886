"""Stage 2, the state passes: one program per sequence, head and block of value columns walks
the chunks in order (the only sequential work), with the state in registers.

- ``chunk_forward_kernel``: the forward in one pass, (4)–(6) of docs/design.md §3: ``U = Ũ − W S``,
  the chunk's outputs (5) and the state update (6). It never sees β or the rule.
- ``chunk_states_kernel``: the state pass alone, (4) and (6), storing the state entering every
  chunk and U for the per-chunk output kernel (outputs.py) and the gradients (gradients.py);
  recomputed by the backward at narrow key blocks, it forms W and Ũ from the kept T itself
  (``rebuilds_w_u``: the rebuild kernel's lines, rebuild.py).
  With few sequences × heads, more programs with narrower value blocks beat the fused kernel.

The backward's reverse pass, (7)–(8) of docs/design.md §7, is dstates.py's, with the same launch
and row blocks (``split_rows``, ``split_launch``, ``STATES_SPLIT_K``).

The chunk steps of the state pass are jit helpers, shared with ``segment_states.py`` (the same
passes split across segments of a sequence when sequences × heads leave the GPU idle).

From a chunk's first non-finite token on (``first_bad``, from the prepare kernel), outputs and
states are NaN: a poison added to the row scale Γ_i and to stored states, never a product with
a masked future (docs/design.md §8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaflow.ops.triton import prepare
from deltaflow.ops.triton.common import (
    CHUNK,
    ChunkTables,
    cdiv,
    decay_matrix,
    dot_precision,
    gamma_and_next,
    head_block,
    key_block,
    load_rows,
    log_alpha_ahead,
    log_alpha_rows,
    prefetch_on,
    prefetch_rows,
    store_rows,
)
from deltaflow.ops.triton.rebuild import pass_args, rebuilt_w, u_product
from deltaflow.ops.triton.states_split import split_forward_kernel, split_states_kernel

# Launch settings (benchmarks/NOTES.md; benchmarks/tune_backward.py sweeps them). The fused
# forward: 64 value columns (32 in fp32: twice the shared memory), 4 warps (16/32 columns in bf16
# miscompile on Hopper, Triton 3.6).
FUSED_BV = 64
FUSED_BV_FP32 = 32
FUSED_WARPS = 4
FUSED_STAGES = 2
FUSED_STAGES_FP32 = 1  # fp32 operands at D = 256 needed 401 KB of shared memory with 2
# The forward's state pass's value block: 32 (fla's at D = 256) is slower in every pass of ours,
# and wrong at one stage or in the reverse pass at 4 warps (benchmarks/NOTES.md, session 23)
TWO_PASS_BV = 64
STATES_WARPS = 4
# The forward's and the recomputed state pass's pipeline stages (the next chunk's loads in flight
# during a latency-bound step), at key blocks up to STATES_STAGES_MAX_BK, not in the split
# kernels (pass_stages; H200, session 20 call 1: 2 against 1 gains 0.03-0.26 ms at D ≤ 128, the
# split kernels at D = 256 lose 0.36: one program an SM there).
STATES_STAGES = 2
STATES_STAGES_MAX_BK = 128
# The state pass stores h without masks where the state tile is the head's (Dk == BK, BV | Dv),
# U without masks in whole chunks: eight branchy masked STG.128 less each (AOT sm_90: 243 → 224
# registers). H200, bf16, session 29 call 1: the pass 0.234 → 0.230 ms at (8, 4096, 16, 128),
# 0.656 → 0.630 at (1, 32768, 16, 128). Not the reverse pass's dh and dU (+0.009 at D = 64, 0
# at 128) nor the fused forward's outputs (two store paths took its spills 128 → 168 B, AOT).
STATES_WHOLE_STORES = True
# At key blocks up to NARROW_MAX_BK (Dk ≤ 64) both state passes hold a [64, BV] state: a third
# stage fits (H200, session 21 call 1: −0.03 / −0.05 ms at D = 64; at D = 128 it loses).
STATES_STAGES_NARROW = 3
NARROW_MAX_BK = 64
BWD_STATES_BV = 64  # the state pass recomputed by the backward
# That pass forms W and Ũ from the kept T itself (rebuild.py's lines) at key blocks up to
# STATES_REBUILD_MAX_BK (rebuilds_w_u; 0: never), and the rebuild kernel does not run. H200,
# session 25 call 1, bf16, forward + backward: −0.07 ms at (16, 2048, 32, 64) (the pass +0.12,
# the rebuild's 0.19 gone), +0.04 at (8, 4096, 16, 128) (+0.22: W formed by the programs of
# both value blocks); the reverse pass forming W too lost at both (benchmarks/NOTES.md).
STATES_REBUILD_MAX_BK = 64
# The three passes with the state as row blocks of STATES_SPLIT_K key rows (states_split.py) for a
# launch whose key block is wider; 0: never (128: D = 256 forward + backward 14.06 → 11.25 ms,
# benchmarks/NOTES.md, session 19). A block is never narrower than the dtype floor
# (common.head_block) nor BK / 4 (four accumulators), so e.g. 32 acts as 64 in bf16.
STATES_SPLIT_K = 128
# Nor narrower than SPLIT_MIN_ROWS: shorter state updates go to mma.sync beside wgmma, which
# Triton 3.6 got wrong in fp32 (common.FP32_WIDE_VALUE_MIN_KEY_BLOCK); tests lower it.
SPLIT_MIN_ROWS = 64
# The split kernels' warps: SPLIT_WARPS where the key block is at most 128 rows, SPLIT_WIDE_WARPS
# where it is wider (Dk = 256; 8 warps hold its [256, BV] fp32 state in twice the registers).
SPLIT_WARPS = 4
SPLIT_WIDE_WARPS = 4
# The split fused forward's own rows, stages, warps (0: STATES_SPLIT_K's, FUSED_STAGES, SPLIT_*)
SPLIT_FORWARD_K = 0
SPLIT_FORWARD_STAGES = 0
SPLIT_FORWARD_WARPS = 0
# It reads (5)'s P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j} from the prepare, once a chunk (H200, bf16,
# D = 256: forward 2.384 → 1.880 ms); not in fp16, wrong there on the H200 (benchmarks/NOTES.md)
SPLIT_FORWARD_P = True
SPLIT_FORWARD_P_SKIP = (torch.float16,)


# The fused forward asks L2 for the tiles of the chunk FUSED_PREFETCH_AHEAD steps on (0: none;
# common.prefetch_rows), beyond its pipeline's one step of loads in flight. H200, bf16, session
# 27 call 2: the forward kernel 0.346 → 0.332 ms at (8, 4096, 16, 128), 0.297 → 0.283 at
# (16, 2048, 32, 64); the same hints in the state pass lost (0.267 → 0.274, 0.322 → 0.342), as
# did V's in the prepare and the rebuild (0.398 → 0.403, 0.188 → 0.205; results/issue32/s27call2).
FUSED_PREFETCH_AHEAD = 2


def split_rows(BK: int, dtype: torch.dtype, split_k: int | None = None) -> int:
    """The rows of one state block of the split kernels for a key block of ``BK`` rows and dot
    dtype ``dtype``, or 0: the one-accumulator kernels (``split_k``, by default
    ``STATES_SPLIT_K``, off, or not below BK)."""
    split_k = STATES_SPLIT_K if split_k is None else split_k
    if split_k <= 0:
        return 0
    rows = max(split_k, BK // 4, SPLIT_MIN_ROWS, head_block(1, dtype))
    return rows if rows < BK else 0


def forward_takes_p(Dk: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether the fused forward over heads of ``Dk`` / ``Dv`` columns (``dtype``: its dot dtype)
    reads (5)'s P from the prepare (SPLIT_FORWARD_P; the split kernel only)."""
    if not SPLIT_FORWARD_P or dtype in SPLIT_FORWARD_P_SKIP:
        return False
    return bool(split_rows(key_block(Dk, Dv, dtype), dtype, SPLIT_FORWARD_K or None))


def rebuilds_w_u(k: Tensor, v: Tensor) -> bool:
    """Whether the backward's recomputed state pass over ``k``, ``v`` (the op's inputs as the
    kernels take them) forms W and Ũ itself (STATES_REBUILD_MAX_BK): its key block unsplit and
    within the setting (λ sums every key column of the block), the rebuild's products in the
    pass's dtype, its value block one of the rebuild's column tiles (a row that is not finite
    zeroed over the same columns). The caller checks the rest: T kept, the pass not in
    segments."""
    Dk, Dv, dtype = k.shape[3], v.shape[3], k.dtype
    BK = key_block(Dk, Dv, dtype)
    BV = min(head_block(Dv, dtype), BWD_STATES_BV)
    dots = prepare.backward_settings(dtype, t_kept=True)["LOW_PRECISION_DOTS"]
    tiled = BV == prepare.tile(k, v) or BV >= Dv
    unsplit = not split_rows(BK, dtype)
    return BK <= STATES_REBUILD_MAX_BK and unsplit and dots == (dtype != torch.float32) and tiled


def split_launch(BK: int, dtype: torch.dtype, split_k: int | None = None) -> dict:
    """The split kernels' extra launch arguments (``BKS`` and their warps), or {}: none."""
    rows = split_rows(BK, dtype, split_k)
    if not rows:
        return {}
    return dict(BKS=rows, num_warps=SPLIT_WIDE_WARPS if BK > 128 else SPLIT_WARPS)


@triton.jit
def chunk_forward_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    o_ptr,
    sT_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    scale,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
    AHEAD: tl.constexpr,
    G_AHEAD: tl.constexpr,
):
    """(4)–(6) along one sequence for one head and BV value columns, state S in registers.
    AHEAD > 0: each step asks L2 for the tiles of the chunk AHEAD steps on (prefetch_rows).
    G_AHEAD: the next chunk's log α and first_bad loaded a step early (common.LOG_ALPHA_AHEAD)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = w_ptr.dtype.element_ty  # matrix-unit operand dtype (bf16/fp16, or fp32 as tf32x3)

    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    causal = rows[:, None] >= rows[None, :]
    state_offs = (i_nh.to(tl.int64) * Dk + offs_k[:, None]) * Dv + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    n_chunks = tl.cdiv(eos - bos, CHUNK)
    if G_AHEAD:  # chunk 0's
        g_next = log_alpha_rows(g_ptr, bos + rows, bos, eos, i_h, H, HAS_DECAY)
        bad_next = tl.load(first_bad_ptr + c_first * H + i_h, mask=n_chunks > 0, other=CHUNK)
    for j in range(0, n_chunks):
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        if AHEAD > 0:
            on = offs_t + AHEAD * CHUNK  # prefetch_rows clamps them to the last row
            prefetch_rows(w_ptr, on, eos - 1, i_h, 0, H, Dk, BK)
            prefetch_rows(u_ptr, on, eos - 1, i_h, i_v * BV, H, Dv, BV)
            prefetch_rows(k_ptr, on, eos - 1, i_h, 0, H, Dk, BK)
            prefetch_rows(q_ptr, on, eos - 1, i_h, 0, H, Dk, BK)
        if G_AHEAD:
            first_bad = bad_next
            bad_next = tl.load(first_bad_ptr + (c_first + j + 1) * H + i_h,
                               mask=j + 1 < n_chunks, other=CHUNK)  # fmt: skip
        else:
            first_bad = tl.load(first_bad_ptr + (c_first + j) * H + i_h)
        row_poison = poison + tl.where(rows >= first_bad, float("nan"), 0.0)
        k_offs = (offs_t[:, None] * H + i_h) * Dk + offs_k[None, :]
        k_mask = mask_t[:, None] & mask_k[None, :]
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        v_mask = mask_t[:, None] & mask_v[None, :]
        b_w = tl.load(w_ptr + k_offs, mask=k_mask, other=0.0)
        b_u = tl.load(u_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0)
        b_q = tl.load(q_ptr + k_offs, mask=k_mask, other=0.0)
        if G_AHEAD:
            b_g = g_next
            g_next = log_alpha_rows(g_ptr, offs_t + CHUNK, bos, eos, i_h, H, HAS_DECAY)
        elif HAS_DECAY:
            b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
        else:
            b_g = tl.zeros([CHUNK], dtype=tl.float32)
        gamma = tl.cumsum(b_g, axis=0)  # γ_i
        gamma_last = tl.sum(b_g, axis=0)  # γ_C (padding adds log α = 0)

        # (4) U = Ũ − W S_0   (critical path: this dot and the state update below)
        U = b_u - tl.dot(b_w.to(DT), S.to(DT), input_precision=PREC)
        # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
        decay = decay_matrix(gamma)
        P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay, 0.0)
        row_scale = tl.exp(gamma) + row_poison
        b_o = row_scale[:, None] * tl.dot(b_q.to(DT), S.to(DT), input_precision=PREC)
        b_o += tl.dot(P.to(DT), U.to(DT), input_precision=PREC)
        tl.store(o_ptr + v_offs, (scale * b_o).to(o_ptr.dtype.element_ty), mask=v_mask)
        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U, through K̃ = diag(e^{γ_C − γ}) K: K̃
        # needs only the chunk's loads, so it is ready before U, off the latency-bound chain.
        # The state pass's form (chunk_state_update: U scaled, the keys exact) took this kernel
        # 0.347 → 0.576 ms at (8, 4096, 16, 128) (H200, session 22 call 2: 120 KB of shared
        # memory, one program an SM instead of two)
        k_to_end = (b_k.to(tl.float32) * tl.exp(gamma_last - gamma)[:, None]).to(DT)
        S = tl.exp(gamma_last) * S + tl.dot(tl.trans(k_to_end), U.to(DT), input_precision=PREC)
        poison += tl.where(first_bad < CHUNK, float("nan"), 0.0)

    tl.store(sT_ptr + state_offs, S + poison, mask=state_mask)


def launch_forward(
    q: Tensor,
    k: Tensor,
    *,
    w: Tensor,
    u: Tensor,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    first_bad: Tensor,
    tables: ChunkTables,
    scale: float,
    o: Tensor,
    final_state: Tensor,
    p: Tensor | None = None,
) -> None:
    """The fused forward: ``o`` (like v) and ``final_state`` ([N, H, Dk, Dv] fp32); ``p``: the
    prepare's P for the split kernel (``forward_takes_p``), else None."""
    H, Dk, Dv = q.shape[2], q.shape[3], u.shape[3]
    N = tables.cu_seqlens.numel() - 1
    BV = min(head_block(Dv, q.dtype), FUSED_BV_FP32 if q.dtype == torch.float32 else FUSED_BV)
    BK = key_block(Dk, Dv, q.dtype)
    stages = FUSED_STAGES_FP32 if q.dtype == torch.float32 else FUSED_STAGES
    launch = {"num_warps": FUSED_WARPS, **split_launch(BK, q.dtype, SPLIT_FORWARD_K or None)}
    kernel = chunk_forward_kernel
    if (p is not None) != forward_takes_p(Dk, Dv, q.dtype):
        raise ValueError("launch_forward: p must be given exactly when forward_takes_p")
    if "BKS" in launch:
        stages = SPLIT_FORWARD_STAGES or stages
        launch["num_warps"] = SPLIT_FORWARD_WARPS or launch["num_warps"]
        kernel, launch["KEEP_K"] = split_forward_kernel, stages > 1
        launch.update(p_ptr=tables.placeholder if p is None else p, HAS_P=p is not None)
    else:
        launch["AHEAD"] = FUSED_PREFETCH_AHEAD if prefetch_on() else 0
    launch["G_AHEAD"] = log_alpha_ahead()  # both forms load log α a step ahead
    kernel[(cdiv(Dv, BV), N * H)](
        q_ptr=q,
        k_ptr=k,
        w_ptr=w,
        u_ptr=u,
        g_ptr=q if log_decay is None else log_decay,
        s0_ptr=q if initial_state is None else initial_state,
        o_ptr=o,
        sT_ptr=final_state,
        first_bad_ptr=first_bad,
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_offsets_ptr=tables.chunk_offsets,
        scale=scale,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BV,
        HAS_DECAY=log_decay is not None,
        HAS_S0=initial_state is not None,
        PREC=dot_precision(q.dtype),
        **launch,
        num_stages=stages,
    )


@triton.jit
def chunk_u(b_u, b_w, S, DT: tl.constexpr, PREC: tl.constexpr):
    """(4) U = Ũ − W S_0 (Ũ as loaded, fp32; W in DT; S_0 rounded to DT as the dot operand)."""
    return b_u - tl.dot(b_w, S.to(DT), input_precision=PREC)


@triton.jit
def chunk_state_update(S, U, b_k, gamma, gamma_last, DT: tl.constexpr, PREC: tl.constexpr):
    """(6) S_C = Γ_C S_0 + Kᵀ (diag(e^{γ_C − γ_j}) U): the decay scales U's rows before its one
    rounding to DT, so the keys enter as loaded (exact) instead of rounded once more as K̃
    (benchmarks/bf16_floor.py, knob fwd_K; issue 30). Shared by the state pass and the segments'
    pass (segment_states.py), whose transition columns are this map applied to the identity."""
    u_to_end = (U * tl.exp(gamma_last - gamma)[:, None]).to(DT)
    return tl.exp(gamma_last) * S + tl.dot(tl.trans(b_k), u_to_end, input_precision=PREC)


@triton.jit(do_not_specialize=["rule", "neg"])  # FROM_T: every rule one compiled kernel
def chunk_states_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    s0_ptr,
    h_ptr,
    v_new_ptr,
    sT_ptr,
    first_bad_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    t_ptr,
    v_ptr,
    beta_ptr,
    eps,
    rule,
    neg,
    H: tl.constexpr,
    Dk: tl.constexpr,
    Dv: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    PREC: tl.constexpr,
    HAS_BETA: tl.constexpr,
    FOLD: tl.constexpr,
    FROM_T: tl.constexpr,
    G_AHEAD: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """(4), (6) along one sequence: stores S_0 of every chunk (h) and U = Ũ − W S_0 (v_new).
    States after a chunk with a non-finite input are stored as NaN. FROM_T: W and Ũ formed
    here from the kept T, k, v and the rule (rebuild.py's lines and roundings) instead of read,
    and W written by the first value block's program for the reverse pass (rebuilds_w_u).
    G_AHEAD: the next chunk's log α loaded a step early (common.LOG_ALPHA_AHEAD). WHOLE: h
    stored unmasked, U unmasked in whole chunks (STATES_WHOLE_STORES)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    c_first = tl.load(chunk_offsets_ptr + i_n)
    DT = k_ptr.dtype.element_ty  # W's, Ũ's, U's

    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    state_mask = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * Dv + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    poison = 0.0  # NaN once a chunk of this sequence held a non-finite input
    w_cols = tl.where(i_v == 0, Dk, 0)  # FROM_T: the first value block's program writes W
    n_chunks = tl.cdiv(eos - bos, CHUNK)
    g_next = log_alpha_rows(g_ptr, bos + rows, bos, eos, i_h, H, HAS_DECAY and G_AHEAD)
    for j in range(0, n_chunks):
        offs_t = bos + j * CHUNK + rows
        mask_t = offs_t < eos
        c = (c_first + j).to(tl.int64)
        h_offs = h_ptr + (c * H + i_h) * Dk * Dv + state_offs
        if WHOLE:  # the state tile is the head's (Dk == BK, BV | Dv): no mask to evaluate
            tl.store(h_offs, (S + poison).to(h_ptr.dtype.element_ty))
        else:
            tl.store(h_offs, (S + poison).to(h_ptr.dtype.element_ty), mask=state_mask)
        b_k = load_rows(k_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
        if FROM_T:  # the rebuild's W and Ũ (rebuild.py), W written for the reverse pass
            b_w, T_u, b = rebuilt_w(t_ptr, b_k, beta_ptr, g_ptr, c, i_h, offs_t, mask_t, eps,
                                    rule, neg, H, HAS_BETA, HAS_DECAY, FOLD, PREC, DT)  # fmt: skip
            store_rows(w_ptr, b_w, offs_t, mask_t, i_h, offs_k, offs_k < w_cols, H, Dk)
            v32 = load_rows(v_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
            b_u = u_product(T_u, v32, b, FOLD, PREC, DT).to(DT).to(tl.float32)
        else:
            b_w = load_rows(w_ptr, offs_t, mask_t, i_h, offs_k, mask_k, H, Dk)
            b_u = load_rows(u_ptr, offs_t, mask_t, i_h, offs_v, mask_v, H, Dv).to(tl.float32)
        gamma, g_next = gamma_and_next(g_next, g_ptr, offs_t, mask_t, CHUNK, bos, eos, i_h, H,
                                       HAS_DECAY, G_AHEAD)  # fmt: skip
        gamma_last = tl.sum(tl.where(rows == CHUNK - 1, gamma, 0.0), axis=0)  # γ_C
        U = chunk_u(b_u, b_w, S, DT, PREC)  # (4)
        v_offs = (offs_t[:, None] * H + i_h) * Dv + offs_v[None, :]
        if WHOLE and bos + (j + 1) * CHUNK <= eos:  # a whole chunk: no mask either
            tl.store(v_new_ptr + v_offs, U.to(DT))
        else:
            tl.store(v_new_ptr + v_offs, U.to(DT), mask=mask_t[:, None] & mask_v[None, :])
        S = chunk_state_update(S, U, b_k, gamma, gamma_last, DT, PREC)  # (6)
        first_bad = tl.load(first_bad_ptr + c * H + i_h)
        poison += tl.where(first_bad < CHUNK, float("nan"), 0.0)

    tl.store(sT_ptr + i_nh.to(tl.int64) * Dk * Dv + state_offs, S + poison, mask=state_mask)


def pass_stages(BK: int, *, split: bool) -> int:
    """Pipeline stages of the forward's state pass over key blocks of ``BK`` rows (``split``: the
    row-block kernels of states_split.py): STATES_STAGES where they were measured to help
    (STATES_STAGES_NARROW at the narrowest blocks), else 1 (the reverse pass's:
    ``dstates.dstates_stages``)."""
    if split:
        return 1
    if BK <= NARROW_MAX_BK:
        return STATES_STAGES_NARROW
    return STATES_STAGES if BK <= STATES_STAGES_MAX_BK else 1


def launch_states(
    k: Tensor,
    *,
    w: Tensor,
    u: Tensor,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    first_bad: Tensor,
    tables: ChunkTables,
    block_v: int,
    h: Tensor,
    v_new: Tensor,
    final_state: Tensor,
    split_k: int = 0,
    maxnreg: int = 0,
    from_t: dict | None = None,
) -> None:
    """(4), (6) sequentially per sequence: ``h`` (S_0 of every chunk, [chunks, H, Dk, Dv]),
    ``v_new`` (U, like v) and ``final_state``, in value blocks of ``block_v`` columns.
    ``split_k``, ``maxnreg``: the caller's rows per block and register cap (0: STATES_SPLIT_K's
    rows, no cap): the segments' step 3 may take its own. ``from_t``: rebuild.pass_args' for W
    and Ũ formed in the pass (``w``: W's buffer, written; ``u`` unread), unsplit only."""
    H, Dk, Dv = k.shape[2], k.shape[3], u.shape[3]
    N = tables.cu_seqlens.numel() - 1
    BV = min(head_block(Dv, k.dtype), block_v)
    BK = key_block(Dk, Dv, k.dtype)
    launch = {"num_warps": STATES_WARPS, **split_launch(BK, k.dtype, split_k or STATES_SPLIT_K)}
    if maxnreg:
        launch["maxnreg"] = maxnreg
    if "BKS" in launch:
        kernel = split_states_kernel
        if from_t is not None:
            raise ValueError("launch_states: from_t is for the unsplit pass")
    else:
        kernel = chunk_states_kernel
        launch.update(from_t or pass_args(None, None, tables=tables))
        launch["WHOLE"] = STATES_WHOLE_STORES and Dk == BK and Dv % BV == 0
        launch["G_AHEAD"] = log_alpha_ahead()
    kernel[(cdiv(Dv, BV), N * H)](
        k_ptr=k,
        w_ptr=w,
        u_ptr=u,
        g_ptr=k if log_decay is None else log_decay,
        s0_ptr=k if initial_state is None else initial_state,
        h_ptr=h,
        v_new_ptr=v_new,
        sT_ptr=final_state,
        first_bad_ptr=first_bad,
        cu_seqlens_ptr=tables.cu_seqlens,
        chunk_offsets_ptr=tables.chunk_offsets,
        H=H,
        Dk=Dk,
        Dv=Dv,
        BK=BK,
        BV=BV,
        HAS_DECAY=log_decay is not None,
        HAS_S0=initial_state is not None,
        PREC=dot_precision(k.dtype),
        **launch,
        num_stages=pass_stages(BK, split="BKS" in launch),
    )
