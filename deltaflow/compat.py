"""Work-arounds for bugs of the torch versions deltaflow supports (each with its reason).

``cast_output``: an ``autograd.Function`` forward must never return a no-op cast of one of its
intermediates. ``y.to(y.dtype)`` (also ``.float()`` of a float32 tensor, ``.contiguous()`` of
a contiguous one) returns ``y`` itself, and torch 2.11's dynamo (the GPU image's torch) then
records the same tensor twice among the traced forward's outputs, routes the incoming gradient
to the wrong one and silently returns zero gradients for everything before the Function
(pytorch/pytorch#180642, a 2.11 regression; 2.13 is right). That is what made compiled
DeltaAttention blocks lose 12 of their 13 parameter gradients in float32 (issue 31): RMSNorm
computes in float32 and cast back to the input's dtype, a no-op for float32 activations.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cast_output(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, but ``t`` itself (no traced no-op cast) when it already has ``dtype``:
    for the return values of ``autograd.Function`` forwards (the module docstring says why)."""
    return t if t.dtype == dtype else t.to(dtype)
