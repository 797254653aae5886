"""What every stage's kernels share: the chunk length, the chunk tables of a (varlen) batch,
and the small loads and products the kernels are written with. Equations: docs/design.md."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils import _pytree as pytree

from deltaflow.ops.chunk import TRITON_CHUNK_SIZE
from deltaflow.ops.triton_ops import HALF_MIN_HEAD, interpreting

# Tokens per chunk, C of docs/design.md §3. The prepare kernel's block substitution is built
# for it (four sub-blocks of SUB tokens), so it is a constant, not a tunable; the torch backend's
# chunk_size is free. Block widths (BK, BV: head-dimension columns a program holds) are not
# chunk lengths: they are derived from the head dims and the launch settings.
CHUNK = tl.constexpr(TRITON_CHUNK_SIZE)  # the number lives in ops/chunk.py
SUB = tl.constexpr(16)  # tokens per sub-block of the prepare kernel (CHUNK = 4 · SUB)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for launch grids. Not ``triton.cdiv``: in recent Triton (3.9 measured here; the
    wrapper came with ``constexpr_function``, Triton 3.5) that is a ``constexpr_function`` whose
    host calls unwrap every argument, ~4 µs a call on this CPU, a dozen calls per forward +
    backward (benchmarks/host_overhead.py)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0, as Triton's): ``triton.next_power_of_2``
    without its constexpr_function wrapper (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# The narrowest head block (key or value columns a program holds) launched with bf16/fp16
# operands. 16, head_block's own floor, is what every launch used before session 17. Triton 3.6 on
# Hopper miscompiled the half-precision state pass at 16 and 32 value columns
# (benchmarks/NOTES.md: v2's "Invalid __shared__ read", issue 30's illegal address at 32), which
# is why FUSED_BV and the other value blocks are 64; a head narrower than 64 columns still gets a
# block of its own width. 64 pads such heads to the 64-column kernels (masked: the same sums) that
# check_triton validates on the GPU. Measured (H100, Triton 3.6, session 17,
# benchmarks/probe_fp16.py, results/issue31/s17call3): with 16-column blocks, heads of 16 columns
# gave NaN from the prepare kernel on in bf16 and fp16, and Dk or Dv = 16 wrong gradients (5e-2 to
# 0.26 relative); with 64, every probed shape right. Heads of 32 columns were right with 32-column
# blocks, but 64 is the width the GPU checks validate.
# Since session 18 the op runs half-precision heads narrower than triton_ops.HALF_MIN_HEAD on
# the fp32 kernels (the padded ones were right but short of bf16's tolerance), so its half
# launches never meet a narrower head; the floor is that same number (one fact, one place) and
# still guards a launcher called with a narrower half head (benchmarks' probes, and tests with
# HALF_MIN_HEAD = 0 that study the half-precision kernels on the interpreter).
HALF_MIN_BLOCK = HALF_MIN_HEAD


def head_block(n: int, dtype: torch.dtype | None = None) -> int:
    """Register block covering a head dim of ``n`` columns: a power of two, at least 16
    (the smallest tl.dot operand), and at least :data:`HALF_MIN_BLOCK` for bf16/fp16
    operands (``dtype``: the dot dtype of the launch)."""
    floor = HALF_MIN_BLOCK if dtype in (torch.bfloat16, torch.float16) else 16
    return max(floor, next_power_of_2(n))


# The narrowest key block of an fp32 launch whose value head is wider than its key head. With a
# key block under 64 columns the state passes' key-side products (Kᵀ U, Wᵀ dU, [BK, 64] @
# [64, BV]) are too short for Hopper's wgmma (64 rows a warp group): Triton 3.6 puts them on
# mma.sync beside the kernel's wgmma products, with its 4 warps side by side along the value
# block when that is the wider (warpsPerCTA [1, 4]; TTGIR for sm_90, compiled on the CPU). The
# H100 gave an illegal memory access on the one such fp32 launch checked (session 17, call 4:
# check_triton, Dk=16 Dv=64; the interpreter finds no access outside any tensor there,
# tests/test_narrow_heads.py), while fp32 at Dk=Dv=16 (mma.sync, warps [4, 1]) and Dk=64 Dv=16
# (wgmma only) were right. 64 runs such heads on the all-wgmma kernels of the 64-column key
# blocks that check_triton validates in fp32, the extra columns masked (the same sums).
FP32_WIDE_VALUE_MIN_KEY_BLOCK = 64
# Which fp32 launches take that floor: "wider_value" (the value block wider than the key
# block, the fault above), "unequal" (the two blocks differ either way), "narrow" (every key
# block under it). The H200 also faulted (illegal memory access) with a 32-column key block
# beside a 16-column value block, which "wider_value" leaves alone: Dk/Dv = 20/12, 32/16 and
# 24/12 in both save modes, while 16/12, 20/20, 32/32, 12/20, 48/16, 48/32, 64/12, 16/16, 16/64
# and 64/16 passed; with "unequal" all 13 passed (benchmarks/probe_narrow_fp32.py, session 20
# call 1, results/issue32/s20call1/probe.txt).
FP32_MIN_KEY_BLOCK_WHEN = "unequal"
FP32_MIN_KEY_BLOCK_CHOICES = ("wider_value", "unequal", "narrow")


def key_block(Dk: int, Dv: int, dtype: torch.dtype | None = None) -> int:
    """The key block of a launch over heads of ``Dk`` key and ``Dv`` value columns:
    :func:`head_block` of ``Dk``, and for an fp32 launch (``dtype``: its dot dtype) at least
    :data:`FP32_WIDE_VALUE_MIN_KEY_BLOCK` where :data:`FP32_MIN_KEY_BLOCK_WHEN` says so
    (half-precision launches: :data:`HALF_MIN_BLOCK`'s floor alone)."""
    block = head_block(Dk, dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return block
    when = FP32_MIN_KEY_BLOCK_WHEN
    if when not in FP32_MIN_KEY_BLOCK_CHOICES:
        raise ValueError(
            f"common.FP32_MIN_KEY_BLOCK_WHEN must be one of {', '.join(FP32_MIN_KEY_BLOCK_CHOICES)}"
            f", got {when!r}"
        )
    value = head_block(Dv, dtype)
    if (
        (when == "wider_value" and value > block)
        or (when == "unequal" and value != block)
        or when == "narrow"
    ):
        return max(block, FP32_WIDE_VALUE_MIN_KEY_BLOCK)
    return block


def dot_precision(dot_dtype: torch.dtype) -> str:
    """fp32 operands on the tensor cores as "tf32x3" (three tf32 products: within ~1e-6 of exact
    fp32, benchmarks/tf32x3_error.py); bf16/fp16 ones as they are. Not "ieee": exact fp32 dots
    are FMA loops that spill 20 KB of stack per thread and compile for minutes
    (benchmarks/NOTES.md, issue 30)."""
    return "tf32x3" if dot_dtype == torch.float32 else "tf32"


class ChunkTables(NamedTuple):
    """Where the sequences and chunks of a batch lie in the flattened [B·T] token axis."""

    cu_seqlens: Tensor  # int32 [N + 1]: first token of each sequence
    chunk_offsets: Tensor  # int32 [N + 1]: first chunk of each sequence
    # int32 [n_chunks, 2]: (first token, end of its sequence) of every chunk, what the per-chunk
    # kernels read (chunk_bounds: one round trip to memory; (sequence, chunk) then cu_seqlens
    # took two, issue 32 session 30)
    chunk_spans: Tensor
    n_chunks: int
    # fp32 [1], never read: what a launcher passes for an absent fp32 pointer (the forward's T),
    # so that one compiled kernel serves both (a pointer's dtype is part of Triton's key)
    placeholder: Tensor


def build_chunk_tables(
    cu_seqlens: Tensor | None, B: int, T: int, device: torch.device
) -> ChunkTables:
    """The chunk tables of ``B`` sequences of ``T`` tokens, or of the packed ``cu_seqlens``
    (whose chunk count is read on the host: a GPU sync). Uncached: see :func:`chunk_tables`."""
    C = CHUNK.value
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        per_seq = torch.full((B,), cdiv(T, C), device=device, dtype=torch.int32)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        per_seq = (cu[1:] - cu[:-1] + C - 1) // C
    chunk_offsets = torch.zeros(per_seq.numel() + 1, device=device, dtype=torch.int32)
    chunk_offsets[1:] = per_seq.cumsum(0)
    # each chunk's sequence and place in it, then its first token and its sequence's end: the
    # grid of the per-chunk kernels
    n_chunks = B * cdiv(T, C) if cu_seqlens is None else int(chunk_offsets[-1])
    seq = torch.repeat_interleave(
        torch.arange(per_seq.numel(), device=device), per_seq.long(), output_size=n_chunks
    )
    chunk_in_seq = torch.arange(n_chunks, device=device, dtype=torch.int32) - chunk_offsets[seq]
    first = cu[seq] + chunk_in_seq * C
    chunk_spans = torch.stack([first, cu[seq + 1]], dim=1).contiguous()
    placeholder = torch.empty(1, device=device, dtype=torch.float32)
    return ChunkTables(cu, chunk_offsets, chunk_spans, n_chunks, placeholder)


# The tables of the last few batch layouts. Every layer's forward and backward of a step asks
# for the same ones (48 calls a step in the 400M model): built each time they cost ~15 small
# tensor ops, each a GPU kernel launch, and for packed sequences a host sync each
# (benchmarks/NOTES.md, "Issue 31, session 16: the op's host time"). Keys: (B, T, device); for
# packed sequences also the offsets tensor itself, by identity, version and address (a tensor
# changed in place, or a new one, is a miss; a weak reference tells a reused id apart).
TABLES_CACHE_SIZE = 16
_tables: OrderedDict[tuple, tuple[weakref.ref | None, ChunkTables]] = OrderedDict()


def chunk_tables(cu_seqlens: Tensor | None, B: int, T: int, device: torch.device) -> ChunkTables:
    """The chunk tables of ``B`` sequences of ``T`` tokens, or of the packed ``cu_seqlens``,
    from a small LRU cache (:data:`TABLES_CACHE_SIZE` entries) when possible."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph capture: the graph's memory pool owns what is allocated now, and a
        # cached entry could be freed (evicted) while the graph still reads it. Replays run no
        # Python, so a cache would save nothing there.
        return build_chunk_tables(cu_seqlens, B, T, device)
    ref = None
    if cu_seqlens is None:
        key: tuple = (B, T, device)
    elif cu_seqlens.is_inference():  # no version counter to tell an in-place change
        return build_chunk_tables(cu_seqlens, B, T, device)
    else:
        key = (id(cu_seqlens), cu_seqlens._version, cu_seqlens.data_ptr(), B, T, device)
        ref = weakref.ref(cu_seqlens)
    hit = _tables.get(key)
    if hit is not None and (hit[0] is None or hit[0]() is cu_seqlens):
        _tables.move_to_end(key)
        return hit[1]
    tables = _outside_graph_pools(lambda: build_chunk_tables(cu_seqlens, B, T, device), device)
    _tables[key] = (ref, tables)
    while len(_tables) > TABLES_CACHE_SIZE:
        _release(_tables.popitem(last=False)[1][1])
    return tables


Built = TypeVar("Built")


def _outside_graph_pools(build: Callable[[], Built], device: torch.device) -> Built:
    """``build()``, on a GPU from a thread of its own (on the caller's stream, which waits for
    it): cudagraph trees (torch.compile's "reduce-overhead") warm a graph up with every
    allocation *of the warming thread* sent to the graph's memory pool, and refuse tensors there
    that outlive the graph (``check_memory_pool``): a cached table built on the warming thread
    would be one. Once per cache miss; the caller waits for the thread, not for the GPU."""
    if device.type != "cuda":
        return build()
    stream = torch.cuda.current_stream(device)
    done: list = []

    def target() -> None:
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                done.append(build())
        except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
            done.append(error)

    thread = threading.Thread(target=target, name="deltaflow-chunk-tables")
    thread.start()
    thread.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _release(tables: object) -> None:
    """Forget an evicted entry (any tuple of tensors). Its GPU memory returns to the pool of the
    stream it was built on; kernels of the current stream may still be queued to read it, so its
    reuse waits for them (``record_stream``)."""
    for t in pytree.tree_leaves(tables):
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class GraphSafeCache(Generic[Built]):
    """Device tables that depend on shapes alone, cached so that a CUDA-graph capture
    (cudagraph trees: a warm-up run, then the capture) neither copies from the host nor reads
    memory that may be freed while the graph lives:

    - outside a capture, a miss builds through :func:`_outside_graph_pools` (not in a graph's
      pool, as :func:`chunk_tables`' entries) and enters an LRU of ``size`` entries;
    - under a capture, a hit (the warm-up built it) is *pinned*: moved out of the LRU, never
      evicted, since every replay of the graph reads its memory; nothing is built or copied;
    - under a capture, a miss builds inside the capture (graph-owned memory, uncached: what
      :func:`chunk_tables` does for every capture). ``build`` must then issue device ops only
      (no host list copied to the GPU: that is a sync, refused during capture).

    A hit costs a dict lookup; the capture check is made on misses and LRU hits only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lru: OrderedDict[Hashable, Built] = OrderedDict()
        self.pinned: dict[Hashable, Built] = {}

    def get(self, key: Hashable, build: Callable[[], Built], device: torch.device) -> Built:
        hit = self.pinned.get(key)
        if hit is not None:
            return hit
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        hit = self.lru.get(key)
        if hit is not None:
            if capturing:
                self.pinned[key] = self.lru.pop(key)
            else:
                self.lru.move_to_end(key)
            return hit
        if capturing:
            return build()
        built = _outside_graph_pools(build, device)
        self.lru[key] = built
        while len(self.lru) > self.size:
            _release(self.lru.popitem(last=False)[1])
        return built

    def clear(self) -> None:
        """Forget every entry, pinned ones too: for tests only (a graph captured with a pinned
        entry would replay reading freed memory)."""
        self.lru.clear()
        self.pinned.clear()


@triton.jit
def chunk_bounds(chunk_spans_ptr, i_c):
    """First token of chunk ``i_c`` and the end of its sequence (ChunkTables.chunk_spans)."""
    return tl.load(chunk_spans_ptr + 2 * i_c), tl.load(chunk_spans_ptr + 2 * i_c + 1)


@triton.jit
def load_chunk_square(ptr, c, i_h, H):
    """The [CHUNK, CHUNK] tile of chunk ``c`` (int64), head ``i_h`` of a [chunks, H, CHUNK,
    CHUNK] tensor: the kept T as the prepare stores it."""
    rows = tl.arange(0, CHUNK)
    return tl.load(ptr + (c * H + i_h) * (CHUNK * CHUNK) + rows[:, None] * CHUNK + rows[None, :])


@triton.jit
def load_rows(ptr, offs_t, mask_t, i_h, offs_d, mask_d, H: tl.constexpr, D: tl.constexpr):
    """Rows ``offs_t`` of head ``i_h`` of a [.., T, H, D] tensor (zeros where masked)."""
    return tl.load(
        ptr + (offs_t[:, None] * H + i_h) * D + offs_d[None, :],
        mask=mask_t[:, None] & mask_d[None, :],
        other=0.0,
    )


@triton.jit
def store_rows(ptr, x, offs_t, mask_t, i_h, offs_d, mask_d, H: tl.constexpr, D: tl.constexpr):
    """``x`` into rows ``offs_t``, columns ``offs_d`` of head ``i_h`` of a [.., T, H, D] tensor
    (only where both masks hold), in the tensor's dtype: :func:`load_rows`' counterpart."""
    tl.store(
        ptr + (offs_t[:, None] * H + i_h) * D + offs_d[None, :],
        x.to(ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_d[None, :],
    )


@triton.jit
def load_gates(
    beta_ptr, g_ptr, offs_t, mask_t, i_h, H, HAS_BETA: tl.constexpr, HAS_DECAY: tl.constexpr
):
    """β (1 where there is none) and log α (0 where there is no decay) of tokens ``offs_t``."""
    if HAS_BETA:
        b_beta = tl.load(beta_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_beta = tl.where(mask_t, 1.0, 0.0)
    if HAS_DECAY:
        b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_g = tl.zeros_like(b_beta)
    return b_beta, b_g


@triton.jit
def chunk_gamma(g_ptr, offs_t, mask_t, i_h, H: tl.constexpr, HAS_DECAY: tl.constexpr):
    """γ_i = Σ_{j≤i} log α_j inside the chunk (0 without decay; padding adds 0)."""
    if HAS_DECAY:
        b_g = tl.load(g_ptr + offs_t * H + i_h, mask=mask_t, other=0.0).to(tl.float32)
    else:
        b_g = tl.zeros([CHUNK], dtype=tl.float32)
    return tl.cumsum(b_g, axis=0)


# A chunk's log α is loaded before the work that waits for it (log_alpha_rows): a 2-byte log α
# is a plain load (cp.async copies 4 bytes or more), which otherwise stalls where it is used.
# The unsplit sequential passes (the fused forward, the state pass, the reverse pass) load the
# next chunk's a step early (the fused forward its next first_bad too), the lean key side its
# chunk's before its value loop. H200, bf16, session 28 calls 3-4, forward + backward: (8, 4096,
# 16, 128) 3.10 → 3.05 ms (state pass 0.267 → 0.235, forward 0.330 → 0.315, reverse pass 0.534
# → 0.523, key side 0.865 → 0.849), (16, 2048, 32, 64) 2.68 → 2.59, (1, 32768, 16, 128) 4.77 →
# 4.67. Of the split (D = 256) and segment passes (session 29 call 1) the split forward (1.249
# → 1.137 ms at (8, 2048, 32, 256)) and the segments' state pass (0.299 → 0.260) take it; the
# split state and reverse passes (+0.03, +0.02-0.05: more spills) and the segments' reverse pass
# (+0.01) do not. A switch for measuring and the bitwise test only (the values are the same
# either way).
LOG_ALPHA_AHEAD = True


def log_alpha_ahead() -> bool:
    """:data:`LOG_ALPHA_AHEAD`, read at each launch (benchmarks set it at run time)."""
    return LOG_ALPHA_AHEAD


@triton.jit
def log_alpha_rows(g_ptr, offs_t, bos, eos, i_h, H: tl.constexpr, HAS_DECAY: tl.constexpr):
    """log α of tokens ``offs_t`` of head ``i_h`` in fp32, 0 outside [bos, eos) and without
    decay: :func:`chunk_gamma`'s before its cumsum, for a pass that loads the next chunk's (on
    either side of the one it works on) a step early."""
    if HAS_DECAY:
        mask = (offs_t >= bos) & (offs_t < eos)
        return tl.load(g_ptr + offs_t * H + i_h, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros([CHUNK], dtype=tl.float32)


@triton.jit
def gamma_and_next(g_next, g_ptr, offs_t, mask_t, step, lo, hi, i_h, H: tl.constexpr,
                   HAS_DECAY: tl.constexpr, G_AHEAD: tl.constexpr):  # fmt: skip
    """A sequential pass's step: γ of the chunk at ``offs_t`` (:func:`chunk_gamma`'s values)
    and the log α its next step needs. G_AHEAD: γ from ``g_next`` (this chunk's, loaded a step
    ago), and the chunk ``step`` rows on (−CHUNK: the one before) loaded now, 0 outside [lo,
    hi); otherwise chunk_gamma's load here, ``g_next`` passed through."""
    if G_AHEAD:
        gamma = tl.cumsum(g_next, axis=0)
        g_next = log_alpha_rows(g_ptr, offs_t + step, lo, hi, i_h, H, HAS_DECAY)
    else:
        gamma = chunk_gamma(g_ptr, offs_t, mask_t, i_h, H, HAS_DECAY)
    return gamma, g_next


@triton.jit
def decay_matrix(gamma):
    """e^{γ_i − γ_j} for j ≤ i, 0 above the diagonal: always from the difference, never as
    Γ_i / Γ_j (which underflows), and masked before the exp (no overflow to mask)."""
    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]
    return tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], -float("inf")))


@triton.jit
def mm(x, y, PREC: tl.constexpr, DT: tl.constexpr):
    """x @ y with operands in DT, accumulated in fp32."""
    return tl.dot(x.to(DT), y.to(DT), input_precision=PREC)


@triton.jit
def dot_split(x, y, acc, DT: tl.constexpr, PREC: tl.constexpr):
    """acc + x @ y where one operand is an fp32 value that fla keeps in fp32 where a plain DT dot
    would round it, the other stored in DT already: the fp32 one as two DT parts, hi + lo (~16
    significant bits in bf16), so that only the stored one enters as DT. Two DT dots: the
    tensor-core time of one tf32 dot, with DT operands in shared memory. With DT = fp32 (fp32
    inputs) one dot, as they are."""
    if DT == tl.float32:
        return tl.dot(x, y, acc=acc, input_precision=PREC)
    elif x.dtype == tl.float32:
        hi = x.to(DT)
        acc = tl.dot(hi, y, acc=acc, input_precision=PREC)
        return tl.dot((x - hi.to(tl.float32)).to(DT), y, acc=acc, input_precision=PREC)
    else:
        hi = y.to(DT)
        acc = tl.dot(x, hi, acc=acc, input_precision=PREC)
        return tl.dot(x, (y - hi.to(tl.float32)).to(DT), acc=acc, input_precision=PREC)


@triton.jit
def scaled_grad_o(b_do, gamma, scale):
    """scale·diag(Γ) dO in fp32: the reverse pass's right operand of (7)'s outputs term
    Qᵀ (scale·diag(Γ) dO) (dstates.dstate_add_outputs), before dot_split's hi + lo."""
    return b_do.to(tl.float32) * (scale * tl.exp(gamma))[:, None]


def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count, asked once per device (a few µs a call otherwise).
    Not cached off the GPU: benchmarks/_launches.py answers for a CPU device while it traces
    launches, with the count of the GPU it stands in for."""
    if device.type != "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_multiprocessors(index)


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# L2 prefetch hints (PTX ``prefetch.global.L2``, one a 128-byte line; issue 32, session 27): a
# tile a kernel will load later is asked into L2 now, so that its load then waits on L2 rather
# than DRAM. They pay where a tile is read after a long phase nothing pipelines: the lean key
# side's epilogue (gradients_lean.K_PREFETCH) and the fused forward two chunks ahead
# (states.FUSED_PREFETCH_AHEAD). In the reverse pass (spills), the state pass, the prepare, the
# rebuild and one wave of programs ahead they lost (benchmarks/NOTES.md, session 27). A hint
# changes no value; its addresses stay inside the tensor (rows and columns clamped). PREFETCH:
# whether launches ask for them (never on the interpreter, which runs no PTX: ``prefetch_on``).
PREFETCH = True
LINE_BITS = tl.constexpr(1024)  # 128 bytes


def prefetch_on() -> bool:
    """The kernels' ``PREFETCH`` constexpr: the setting, off under TRITON_INTERPRET."""
    return PREFETCH and not interpreting()


@triton.jit
def _prefetch_l2(ptrs):
    """One L2 prefetch a pointer of ``ptrs`` (the result, a zero, unused)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def row_lines(offs_t, last_t, i_h, col0, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
              BITS: tl.constexpr):  # fmt: skip
    """Element offsets, one a 128-byte line, covering columns [col0, col0 + BD) (within D) of
    rows ``offs_t`` (past ``last_t``: that row) of head ``i_h`` of a [.., T, H, D] tensor of
    BITS-bit elements: :func:`prefetch_rows`' addresses (tests/test_prefetch.py). A row that
    does not start on a line boundary spans one line more than this covers: its last is left
    out (a hint only; the op's fast heads are 64-128-column multiples)."""
    NL: tl.constexpr = (BD * BITS + LINE_BITS - 1) // LINE_BITS
    cols = tl.minimum(col0 + tl.arange(0, NL) * (LINE_BITS // BITS), D - 1)
    t = tl.minimum(offs_t, last_t)
    return (t[:, None] * H + i_h) * D + cols[None, :]


@triton.jit
def prefetch_rows(ptr, offs_t, last_t, i_h, col0, H: tl.constexpr, D: tl.constexpr,
                  BD: tl.constexpr):  # fmt: skip
    """Ask L2 for :func:`load_rows`' tile of columns [col0, col0 + BD) of rows ``offs_t``
    (clamped to ``last_t``) of head ``i_h`` of a [.., T, H, D] tensor, one hint a line."""
    BITS: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
    _prefetch_l2(ptr + row_lines(offs_t, last_t, i_h, col0, H, D, BD, BITS))


@triton.jit
def prefetch_block(ptr, N: tl.constexpr):
    """Ask L2 for ``N`` contiguous elements from ``ptr`` (N · bits / 1024 lines, a power of 2)."""
    BITS: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
    _prefetch_l2(ptr + tl.arange(0, N * BITS // LINE_BITS) * (LINE_BITS // BITS))
