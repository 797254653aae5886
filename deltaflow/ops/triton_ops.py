"""The Triton backend's ``torch.library`` custom ops: schemas, fake (meta) implementations and
autograd, so that ``torch.compile(fullgraph=True)`` traces through ``delta_rule`` without graph
breaks. Optional tensors travel as ``Tensor?``, the rule as its kernel id; ``chunk_size`` is in
the schema so that a caller cannot ask for another chunk length and be ignored.

The bodies run ``_forward``, ``_backward`` and ``_decode`` of ``deltaflow/ops/triton_backend.py``,
looked up there at each call (the module imported on the first call: triton_backend imports this
module when it loads, never the reverse): the backend's switches live beside the code that reads
them, and a checking script may swap those functions (``benchmarks/half_grad_draws.py``).

What the forward keeps for the backward (``save``, from ``triton_backend.SAVE_FOR_BACKWARD``) is
returned as seven extra outputs, in :data:`KEPT`'s order, marked non-differentiable; autograd
saves them and hands them to the backward op, which then skips what it would have recomputed
(benchmarks/NOTES.md, "Issue 31/32, session 16"):

- ``"none"``: nothing but the inputs (and the op's save where no backward will run: inference);
  the backward recomputes prepare and the state pass.
- ``"segments"``: "none" where a backward will run: the segments' entering states alone (see
  "entering" below).
- ``"prepare"``: W, Ũ, T and first_bad of the forward's prepare; the backward's state pass stays.
- ``"states"``: W, T and the forward's state pass's h (S_0 of every chunk) and U: nothing is
  recomputed. ``"states_fp32"``: the same with h in float32 (``BACKWARD_STATES_FP32``).
- ``"t"``: T and first_bad alone (fla's memory: its A); the backward rebuilds W and Ũ from T
  (``triton/rebuild.py``: the prepare's lines without K Kᵀ and the solve), then runs
  the state pass (benchmarks/NOTES.md, "Issue 32, session 19").

"entering", kept by every mode whose backward recomputes the state pass ("segments", "prepare",
"t"): the state entering each segment of a forward that ran its state pass in segments
(``triton_backend.KEEP_SEGMENT_STATES``; 0 rows where it keeps none, ``kept_segment_rows``), from
which the backward's recompute runs that pass's last step alone (benchmarks/NOTES.md, "Issue 32,
session 20").

Every slot is returned whatever the mode (an empty tensor where it keeps nothing): one schema.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
from torch import Tensor

from deltaflow.ops.chunk import TRITON_CHUNK_SIZE

KEPT = ("w", "u", "t", "first_bad", "h", "v_new", "entering")
SAVE_MODES = {
    "none": (),
    "segments": ("entering",),
    "prepare": ("w", "u", "t", "first_bad", "entering"),
    "states": ("w", "t", "h", "v_new"),
    "states_fp32": ("w", "t", "h", "v_new"),
    "t": ("t", "first_bad", "entering"),
}


def interpreting() -> bool:
    """Whether Triton runs on its CPU interpreter (TRITON_INTERPRET=1): the one test of it for
    the backend and the kernels' launch settings (common.prefetch_on)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _backend() -> ModuleType:
    """deltaflow/ops/triton_backend.py, imported on first use (it imports this module as it
    loads) and kept: a ``from ... import`` inside every op call costs a few µs of import
    machinery (benchmarks/host_overhead.py)."""
    global _BACKEND
    if _BACKEND is None:
        from deltaflow.ops import triton_backend

        _BACKEND = triton_backend
    return _BACKEND


_BACKEND: ModuleType | None = None


# The narrowest key or value head that bf16/fp16 inputs run on the half-precision kernels; a
# narrower head runs the fp32 kernels (the op casts q, k, v to fp32; outputs and gradients come
# back in the inputs' dtypes). Why: Triton 3.6 on the H100 miscompiled 16-column half-precision
# blocks (NaN, wrong gradients: benchmarks/NOTES.md "Issue 31, session 17: float16 on the GPU"),
# so such heads were padded to 64-column blocks (common.HALF_MIN_BLOCK, derived from this), and
# those padded kernels still missed bf16's 5e-3 at heads of 16 columns: check_triton --dtype
# all (H100, session 18 call 1, benchmarks/results/issue32/s18call1) failed 7 of 150 cases, all
# bf16 at Dk or Dv = 16, at 5.0-6.7e-3 (1.0-1.14x the bf16 floor), while fp32 at those shapes
# is at ~3e-7. Through the fp32 kernels only the bf16 storage of the outputs and gradients is
# left. 64: every head narrower than the blocks check_triton validates in half precision.
# The cost, unmeasured: fp32 bytes, tf32x3 products and the casts, against padded blocks; a few
# times the padded bf16 kernels' time at most, on heads whose kernels cost little anyway.
# Tests of the half-precision kernels themselves set 0 (tests/conftest.py, narrow_half_kernels).
HALF_MIN_HEAD = 64


def dot_dtype(dtype: torch.dtype, Dk: int, Dv: int) -> torch.dtype:
    """The kernels' operand dtype for q, k, v in ``dtype`` over heads of ``Dk`` key and ``Dv``
    value columns: bf16/fp16 as given where both heads have at least :data:`HALF_MIN_HEAD`
    columns, else fp32 (fp32 inputs and narrow half-precision heads)."""
    if dtype in (torch.bfloat16, torch.float16) and min(Dk, Dv) >= HALF_MIN_HEAD:
        return dtype
    return torch.float32


def chunk_rows(B: int, T: int, cu_seqlens: Tensor | None) -> int:
    """Rows of a per-chunk tensor the forward keeps: the chunk count of B sequences of T tokens;
    for packed sequences a bound from shapes alone, Σ⌈L_i/C⌉ ≤ (T + (C−1)·N) / C, since the
    count depends on cu_seqlens' values, which a fake tensor does not have. The kernels write
    the first n_chunks rows; the forward zeroes the others (never read)."""
    C = TRITON_CHUNK_SIZE
    if cu_seqlens is None:
        return max(B * ((T + C - 1) // C), 1)
    return max((T + (C - 1) * (cu_seqlens.shape[0] - 1)) // C, 1)


def kept_layout(
    save: str, q: Tensor, v: Tensor, cu_seqlens: Tensor | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor that ``save`` keeps, as the fake forward returns them; the
    real one allocates the same (its per-chunk rows from :func:`chunk_rows`, its per-segment
    ones from ``triton_backend.kept_segment_rows``), which ``torch.library.opcheck`` compares
    (tests/test_triton_interpret.py)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dt = dot_dtype(q.dtype, Dk, Dv)
    n, C = chunk_rows(B, T, cu_seqlens), TRITON_CHUNK_SIZE
    backend, names = _backend(), SAVE_MODES[save]
    every = {
        "w": ((B, T, H, Dk), dt),
        "u": ((B, T, H, Dv), dt),
        "t": ((n, H, C, C), backend.t_dtype(dt, kept_alone=save == "t")),
        "first_bad": ((n, H), torch.int32),
        "h": ((n, H, Dk, Dv), torch.float32 if save == "states_fp32" else dt),
        "v_new": ((B, T, H, Dv), dt),
    }
    if "entering" in names:  # the segments' entering states (fp32, as the chain writes them)
        rows = backend.kept_segment_rows(save, q, v, cu_seqlens)
        every["entering"] = ((rows, H, Dk, Dv), torch.float32)
    return {name: every[name] for name in names}


def _slots(kept: dict[str, Tensor], like: Tensor) -> tuple[Tensor, ...]:
    """The kept slots in KEPT's order, an empty tensor where ``kept`` has none."""
    return tuple(kept[name] if name in kept else like.new_empty(0) for name in KEPT)


def _chunk_fwd(
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
    save: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final_state, *the seven kept slots)."""
    backend = _backend()
    backend._check_chunk_size(chunk_size)
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {sorted(SAVE_MODES)}, got {save!r}")
    o, final_state, kept = backend._forward(
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
        save=save,
    )
    return (o, final_state, *_slots(kept, q))


def _chunk_fwd_fake(q, k, v, beta, log_decay, initial_state, cu_seqlens, *options):
    save = options[-1]
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    kept = {
        name: q.new_empty(shape, dtype=dtype)
        for name, (shape, dtype) in kept_layout(save, q, v, cu_seqlens).items()
    }
    return (
        q.new_empty(B, T, H, Dv, dtype=v.dtype),
        q.new_empty(N, H, Dk, Dv, dtype=torch.float32),
        *_slots(kept, q),
    )


def _chunk_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    grad_o: Tensor,
    grad_state: Tensor | None,
    w: Tensor | None,
    u: Tensor | None,
    t: Tensor | None,
    first_bad: Tensor | None,
    h: Tensor | None,
    v_new: Tensor | None,
    entering: Tensor | None,
    rule: int,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    chunk_size: int,
) -> list[Tensor]:
    """The gradients of q, k, v, β, log α and the initial state (empty where absent); the kept
    tensors that are given (None: recomputed) are the forward's, as chunk_fwd returned them.
    ``grad_state`` None: the final state was not used (its gradient is zero)."""
    backend = _backend()
    backend._check_chunk_size(chunk_size)
    slots = (w, u, t, first_bad, h, v_new, entering)
    grads = backend._backward(
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
        kept={name: x for name, x in zip(KEPT, slots) if x is not None},
    )
    return [q.new_empty(0) if g is None else g for g in grads]


def _chunk_bwd_fake(q, k, v, beta, log_decay, initial_state, *rest):
    # Contiguous, as the kernels write them: empty_like would copy a permuted input's strides,
    # and torch.compile would then read the real (contiguous) gradients through wrong strides.
    return [
        q.new_empty(0) if x is None else x.new_empty(x.shape)
        for x in (q, k, v, beta, log_decay, initial_state)
    ]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, beta, log_decay, initial_state, cu_seqlens, *options, save = inputs
    kept = output[2:]
    ctx.mark_non_differentiable(*kept)
    # The kept outputs never get a gradient: without this autograd would hand the backward a
    # zero tensor of each (a memset of W, T, h, U per layer). grad_o / grad_state may be None.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, log_decay, initial_state, cu_seqlens, *kept)
    ctx.options = options
    ctx.kept = SAVE_MODES[save]


def _chunk_fwd_backward(ctx, grad_o, grad_state, *_kept_grads):
    q, k, v, beta, log_decay, initial_state, cu_seqlens, *slots = ctx.saved_tensors
    kept = [x if name in ctx.kept else None for name, x in zip(KEPT, slots)]
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    # grad_state stays None when the final state was not used (training): the reverse pass then
    # starts from zero without reading a tensor of zeros (no allocation, no fill each layer)
    grads = (chunk_bwd_op if cu_seqlens is None else chunk_bwd_varlen_op)(
        q,
        k,
        v,
        beta,
        log_decay,
        initial_state,
        cu_seqlens,
        grad_o,
        grad_state,
        *kept,
        *ctx.options,
    )
    present = [q, k, v, beta, log_decay, initial_state]
    grads = [None if x is None else g for x, g in zip(present, grads)]
    # cu_seqlens, rule, negative_eigenvalues, eps, scale, chunk_size, save: no gradient
    return (*grads, None, None, None, None, None, None, None)


# Two pairs of ops, one implementation. Packed sequences (cu_seqlens) read their chunk count
# on the host (a sync) and launch a grid of that size: a CUDA graph can neither capture the sync
# nor replay another batch's chunk count. Their ops carry the cudagraph_unsafe tag, so that
# inductor runs a compiled graph holding them without CUDA graphs (compile.CUDA_GRAPHS: dense
# batches replay graphs, packed documents run as plain compiled code) instead of failing at
# capture or replaying the first batch's layout.
_UNSAFE = (torch.Tag.cudagraph_unsafe,)
chunk_fwd_op = torch.library.custom_op("deltaflow::chunk_fwd", _chunk_fwd, mutates_args=())
chunk_bwd_op = torch.library.custom_op("deltaflow::chunk_bwd", _chunk_bwd, mutates_args=())
chunk_fwd_varlen_op = torch.library.custom_op(
    "deltaflow::chunk_fwd_varlen", _chunk_fwd, mutates_args=(), tags=_UNSAFE
)
chunk_bwd_varlen_op = torch.library.custom_op(
    "deltaflow::chunk_bwd_varlen", _chunk_bwd, mutates_args=(), tags=_UNSAFE
)
for _fwd, _bwd in ((chunk_fwd_op, chunk_bwd_op), (chunk_fwd_varlen_op, chunk_bwd_varlen_op)):
    _fwd.register_fake(_chunk_fwd_fake)
    _bwd.register_fake(_chunk_bwd_fake)
    _fwd.register_autograd(_chunk_fwd_backward, setup_context=_setup_context)


def chunk_fwd_for(cu_seqlens: Tensor | None):  # noqa: ANN201 - a CustomOpDef
    """The forward op for dense (None) or packed sequences."""
    return chunk_fwd_op if cu_seqlens is None else chunk_fwd_varlen_op


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
    return _backend()._decode(
        q,
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        state=state,
        kernel_id=rule,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
    )


@decode_step_op.register_fake
def _(q, k, v, beta, log_decay, state, rule, negative_eigenvalues, eps, scale):
    return torch.empty_like(v)
