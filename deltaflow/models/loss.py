"""Memory-lean LM loss: linear head + cross-entropy without materializing the [N, V] logits.

The plain path ``F.cross_entropy(lm_head(h).float(), y)`` keeps logits [N, V] in the compute
dtype, their float32 copy, and the gradient of both alive at once: at N = 16384 tokens and
V = 32000 that is several GB. Here the rows are walked in chunks; each chunk's logits live only
while its loss and its gradients w.r.t. the hidden states and the head weight are computed,
in the forward pass. Backward only scales the stored gradients by ``grad_output``.

Numerics follow the plain path: logits in the compute dtype (bf16 under bf16 params), then
log-sum-exp and softmax in float32 (float64 for float64 inputs); the weight gradient is
accumulated in that precision over chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 4096  # rows per chunk: 4096 x 32000 logits = 0.5 GB in fp32


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
    return _LinearCrossEntropy.apply(
        h,
        weight,
        y,
        chunk_size,
        ignore_index,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )
