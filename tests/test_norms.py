"""Lean autograd Functions of the layers: norms, gated norm, SwiGLU product, no host checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deltaflow.layers.delta_attention as delta_attention
from deltaflow.layers import DeltaAttention, RMSNorm, l2_normalize
from deltaflow.layers.norm import rms_norm
from deltaflow.models.block import SwiGLU, _SwiGLUProduct
from deltaflow.ops import checks as op_checks


def plain_rms(x, w, eps, gate=None):
    """The op-by-op float32 formulas the Functions replace."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    if gate is not None:
        y = y * F.silu(gate.float())
    return y.to(x.dtype)


def plain_l2(x, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_gradcheck_and_matches_plain(gated):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_(True)
    g = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True) if gated else None
    inputs = (x, w) + ((g,) if gated else ())
    torch.autograd.gradcheck(lambda x, w, *g: rms_norm(x, w, 1e-5, *g), inputs)
    # float32: same values and gradients as autograd through the plain formula.
    xs = [t.detach().float().requires_grad_(True) for t in inputs]
    gate = xs[2] if gated else None
    y, y_ref = rms_norm(xs[0], xs[1], 1e-5, gate), plain_rms(xs[0], xs[1], 1e-5, gate)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, xs, dy)
    ref = torch.autograd.grad(y_ref, xs, dy)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_l2_normalize_gradcheck_zero_vector_and_bf16():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(l2_normalize, (x,))
    z = torch.zeros(2, 4, requires_grad=True)
    y = l2_normalize(z)
    y.sum().backward()
    assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(z.grad).all()
    xb = torch.randn(7, 16).bfloat16()
    assert torch.equal(l2_normalize(xb), plain_l2(xb))
    norm = RMSNorm(16)
    assert torch.equal(norm(xb), plain_rms(xb, norm.weight, norm.eps))


def test_rms_norm_bad_gate_shape():
    with pytest.raises(ValueError, match="gate must have the shape"):
        RMSNorm(8)(torch.randn(2, 8), torch.randn(2, 4))


def test_swiglu_product_gradcheck_and_module():
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(_SwiGLUProduct.apply, (a, b))
    mlp = SwiGLU(8, 12)
    x = torch.randn(3, 8)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), ref)


def test_delta_attention_skips_host_value_checks(monkeypatch):
    # The layer's gates satisfy the value checks by construction: it asks the op to skip them
    # (an argument of that call, no global switched), and the op then never reads the values.
    seen, checked = [], []
    real_op, real_checkable = delta_attention.delta_rule, op_checks._values_checkable

    def spy(*args, **kwargs):
        seen.append(kwargs.get("check_values"))
        return real_op(*args, **kwargs)

    def checkable(t, check_values):
        checked.append(check_values)
        return real_checkable(t, check_values)

    monkeypatch.setattr(delta_attention, "delta_rule", spy)
    monkeypatch.setattr(op_checks, "_values_checkable", checkable)
    layer = DeltaAttention(32, num_heads=2, use_decay=True, chunk_size=8, backend="torch")
    layer(torch.randn(2, 9, 32))[0].sum().backward()
    assert seen == [False] and checked and not any(checked)
