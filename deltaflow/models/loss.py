"""Memory-lean LM loss: linear head + cross-entropy without materializing the [N, V] logits.

The plain path ``F.cross_entropy(lm_head(h).float(), y)`` keeps logits [N, V] in the compute
dtype, their float32 copy, and the gradient of both alive at once: at N = 16384 tokens and
V = 32000 that is several GB. Here the rows are walked in chunks; each chunk's logits live only
while its loss and its gradients w.r.t. the hidden states and the head weight are computed,
in the forward pass. Backward only scales the stored gradients by ``grad_output``.

Numerics follow the plain path: logits in the compute dtype (bf16 under bf16 params), then
log-sum-exp and softmax in float32 (float64 for float64 inputs); the weight gradient is
accumulated in that precision over chunks.

The fast path (issue 31 item 4): CUDA inputs go to liger-kernel's fused linear cross-entropy,
whose one Triton pass per row turns each chunk's logits into their gradient in place (no float32
copy, no separate softmax passes): 6.5 ms instead of 17.2 ms at 16384 x 1024 x 32000 in bf16 on
an H100, 0.40 instead of 1.37 GiB, errors against float32 no larger
(``benchmarks/results/issue31/s15call2/lm_loss.log``). Same semantics; what it does not cover
(CPU, float64, liger not installed, a weight-only gradient) stays on the chunked torch path.
``FUSED_CE_BACKEND`` chooses.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 4096  # rows per chunk: 4096 x 32000 logits = 0.5 GB in fp32

# "auto": liger-kernel's fused linear cross-entropy where it applies and is installed (the
# `triton` extra brings it), else the chunked path below, silently; "liger": the same, with a
# warning when liger cannot be imported; "torch": always the chunked path. Read at every call,
# so a benchmark or a training script can flip it at run time.
FUSED_CE_BACKEND = "auto"
BACKENDS = ("auto", "torch", "liger")
# liger's kernels are Triton: on the CPU they only run under TRITON_INTERPRET=1, which tests
# use by adding "cpu" here; in production the switch must never send CPU tensors there.
_LIGER_DEVICES: tuple[str, ...] = ("cuda",)
# float64 is not a Triton kernel dtype liger handles; those inputs keep the torch path.
_LIGER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T`` over rows whose label != ignore_index."""

    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk_size: int,
        ignore_index: int,
        need_grad_h: bool,
        need_grad_w: bool,
    ) -> Tensor:
        N = h.shape[0]
        valid = labels != ignore_index
        # A tensor, not an int: no host sync. An all-ignored batch divides 0 by 1 (loss 0).
        acc = torch.promote_types(h.dtype, torch.float32)  # float32, or float64 for float64
        n_valid = valid.sum().clamp_min(1).to(acc)
        safe = torch.where(valid, labels, 0)
        grad_h = torch.empty_like(h) if need_grad_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_w = grad_w if need_grad_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for start in range(0, N, chunk_size):
            rows = slice(start, min(start + chunk_size, N))
            hc, yc, vc = h[rows], safe[rows], valid[rows]
            # float32 copy of the chunk's logits: reused in place below for the softmax.
            logits = (hc @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, yc[:, None]).squeeze(1)
            total += torch.where(vc, lse - target, 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            # d loss / d logits = (softmax - onehot) * valid / n_valid, computed in place.
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, yc[:, None], -vc[:, None].to(acc))
            probs.mul_((vc.to(acc) / n_valid)[:, None])
            g = probs.to(h.dtype)
            del logits, probs
            if grad_h is not None:
                grad_h[rows] = g @ weight.to(h.dtype)
            if grad_w is not None:
                grad_w += g.t() @ hc
            del g  # else it lives on while the next chunk's logits are made: one more chunk
        ctx.save_for_backward(
            grad_h if grad_h is not None else h.new_empty(0),
            grad_w if grad_w is not None else h.new_empty(0),
        )
        ctx.has_grads = (grad_h is not None, grad_w is not None)
        ctx.weight_dtype = weight.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        has_h, has_w = ctx.has_grads
        dh = (grad_h * grad_out.to(grad_h.dtype)) if has_h else None
        dw = (grad_w * grad_out).to(ctx.weight_dtype) if has_w else None
        return dh, dw, None, None, None, None, None


@functools.cache
def _liger_import() -> Callable[..., Tensor] | str:
    """liger's functional fused linear cross-entropy, or why it cannot be imported. Imported on
    first use only: it takes seconds (it loads transformers and Triton)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as e:  # noqa: BLE001 - ImportError, or a liger built for another Triton
        return repr(e)
    return liger_fused_linear_cross_entropy


def _liger_loss() -> Callable[..., Tensor] | None:
    """liger's function, or None; asked for by name (``FUSED_CE_BACKEND='liger'``), its absence
    is warned about once."""
    fn = _liger_import()
    if isinstance(fn, str):
        if FUSED_CE_BACKEND == "liger":
            _warn_once(fn)
        return None
    return fn


@functools.cache
def _warn_once(error: str) -> None:
    warnings.warn(
        f"FUSED_CE_BACKEND='liger' but liger-kernel cannot be imported ({error}); "
        "using the chunked torch loss",
        RuntimeWarning,
        stacklevel=4,
    )


def liger_chunk_mem_const(n: int, d: int, v: int, chunk_size: int) -> int:
    """liger's ``chunk_mem_const`` whose chunks come closest to ``chunk_size`` rows without
    exceeding it (1, liger's default and its smallest chunks, if none does).

    liger sizes its chunks from a memory budget, not a row count: ``c`` gives
    ``min(n, next_pow2(ceil(n / ceil(v / (c * d)))))`` rows, non-decreasing in ``c``. Its default
    c = 1 bounds the logits to n x d elements: 512-row chunks at n = 16384, d = 1024, v = 32000,
    8 times more (smaller) matmuls than our 4096-row default, so the comparison maps ours.
    """
    best = 1
    for c in range(1, -(-v // d) + 1):  # from ceil(v / d) on, one chunk of n rows
        inc = -(-v // (c * d))
        rows = min(n, 1 << max(0, (-(-n // inc) - 1).bit_length()))
        if rows > chunk_size:
            break
        best = c
    return best


def _liger_applies(h: Tensor, weight: Tensor, need_grad_h: bool, need_grad_w: bool) -> bool:
    """Whether the switch says liger and liger covers these inputs (see FUSED_CE_BACKEND)."""
    backend = FUSED_CE_BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"FUSED_CE_BACKEND must be one of {BACKENDS}, got {backend!r}")
    return (
        backend != "torch"
        and h.device.type in _LIGER_DEVICES
        and weight.device == h.device
        and h.dtype in _LIGER_DTYPES
        and weight.dtype in _LIGER_DTYPES
        # liger computes the weight's gradient only alongside the hidden states' one
        and (need_grad_h or not need_grad_w)
        and _liger_loss() is not None
    )


def _liger_linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int,
    ignore_index: int,
    need_grad_h: bool,
    need_grad_w: bool,
) -> Tensor:
    fn = _liger_loss()
    assert fn is not None  # _liger_applies checked it
    # liger decides what to differentiate from requires_grad alone (not grad mode): detach what
    # needs no gradient, so evaluation under no_grad does no gradient work.
    return fn(
        h if need_grad_h else h.detach(),
        weight if need_grad_w else weight.detach(),
        labels,
        ignore_index=ignore_index,
        reduction="mean",
        # Its default accumulates the weight gradient in the weight's dtype (bf16 over chunks);
        # ours accumulates in float32 and casts once: ask for the same.
        accum_dtype=torch.float32,
        chunk_mem_const=liger_chunk_mem_const(h.shape[0], h.shape[1], weight.shape[0], chunk_size),
    )


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index)`` (mean over scored rows, 0 if
    none) in float32, without keeping a [N, V] tensor beyond one chunk of rows.

    hidden ``[..., D]``; weight ``[V, D]`` (e.g. a tied embedding: its gradient flows there);
    labels ``[...]`` aligned with hidden's rows (shift them first for next-token prediction).
    Gradients are computed during the forward pass when grad mode is on and an input needs
    them, so call ``backward`` on the result at most once (as a training step does).
    ``FUSED_CE_BACKEND`` picks the implementation (same results within bf16 rounding).
    """
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape {list(hidden.shape[:-1])} (hidden without its last dim), "
            f"got {list(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {list(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(device=h.device, dtype=torch.long)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    if _liger_applies(h, weight, *need):
        return _liger_linear_cross_entropy(h, weight, y, chunk_size, ignore_index, *need)
    return _LinearCrossEntropy.apply(h, weight, y, chunk_size, ignore_index, *need)
