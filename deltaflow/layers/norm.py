"""Normalizations used by the mixers and blocks: RMSNorm, gated RMSNorm and L2 normalization.

All three compute in float32 (float64 for float64 inputs) and cast back to the input dtype.
They are autograd Functions with hand-written backwards so that training saves only the input
(in its own dtype) and one float32 scale per row: the op-by-op float32 graph would keep two
or three float32 copies of every normalized activation alive until backward (~0.4 GB per
layer at 16k tokens x 1024).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from deltaflow.compat import cast_output


def _acc(x: Tensor) -> torch.dtype:
    """float32 for half and single precision inputs, float64 for float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _silu_grad(g: Tensor) -> Tensor:
    """d SiLU(g) / dg = σ(g) (1 + g (1 − σ(g)))."""
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


class _Norm(torch.autograd.Function):
    """``y = x · rsqrt(reduce(x²) + eps) [· weight] [· SiLU(gate)]`` over the last dim, where
    reduce is the mean (RMSNorm) or the sum (L2 normalization)."""

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor | None, gate: Tensor | None, eps: float, mean: bool
    ) -> Tensor:
        acc = _acc(x)
        xf = x.to(acc)
        sq = xf.square()
        rstd = torch.rsqrt((sq.mean(-1, keepdim=True) if mean else sq.sum(-1, keepdim=True)) + eps)
        y = xf * rstd
        if weight is not None:
            y = y * weight.to(acc)
        if gate is not None:
            y = y * F.silu(gate.to(acc))
        ctx.save_for_backward(x, weight, gate, rstd)
        ctx.mean = mean
        # not y.to(x.dtype): a no-op for float32 inputs, which torch 2.11's compile turns into
        # zero gradients (deltaflow/compat.py)
        return cast_output(y, x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, gate, rstd = ctx.saved_tensors
        acc = _acc(x)
        xhat = x.to(acc) * rstd
        dyf = dy.to(acc)
        dgate = dweight = None
        if gate is not None:
            gf = gate.to(acc)
            normed = xhat if weight is None else xhat * weight.to(acc)
            dgate = (dyf * normed * _silu_grad(gf)).to(gate.dtype)
            dyf = dyf * F.silu(gf)
        if weight is not None:
            dweight = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            dyf = dyf * weight.to(acc)
        # d/dx [x r] with r = (reduce(x²) + eps)^-½: r (dy − x̂ · reduce(dy ⊙ x̂)).
        dot = dyf * xhat
        dot = dot.mean(-1, keepdim=True) if ctx.mean else dot.sum(-1, keepdim=True)
        dx = (rstd * (dyf - xhat * dot)).to(x.dtype)
        return dx, dweight, dgate, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, gate: Tensor | None = None) -> Tensor:
    """``RMSNorm(x) · weight`` (``· SiLU(gate)`` if given, gate shaped like x), in float32."""
    return _Norm.apply(x, weight, gate, eps, True)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back to the input dtype.

    ``forward(x, gate)`` also applies the output gate ``⊙ SiLU(gate)`` in the same function
    (the gated RMSNorm of Gated DeltaNet's output), rounding once instead of twice.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm: dim must be positive, got {dim}")
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: expected last dim {self.dim}, got shape {tuple(x.shape)}")
        if gate is not None and gate.shape != x.shape:
            raise ValueError(
                f"RMSNorm: gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}"
            )
        return rms_norm(x, self.weight, self.eps, gate)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, in float32 (a zero vector stays zero)."""
    return _Norm.apply(x, None, None, eps, False)
