"""Chunked linear + cross-entropy: same loss and gradients as the plain F.cross_entropy path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaflow.models.loss import linear_cross_entropy


def reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The plain path: full logits, float32 cross-entropy, mean over scored rows (0 if none)."""
    logits = (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32))
    total = F.cross_entropy(logits.reshape(-1, w.shape[0]), y.reshape(-1), reduction="sum")
    return total / (y != -100).sum().clamp_min(1)


def grads(fn, h, w, y, scale=1.0):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, y)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])  # 7 does not divide N = 3 * 11
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_plain_cross_entropy(chunk, dtype):
    torch.manual_seed(0)
    B, T, D, V = 3, 11, 16, 37
    h = torch.randn(B, T, D, dtype=dtype)
    w = torch.randn(V, D, dtype=dtype) * 0.5
    y = torch.randint(0, V, (B, T))
    y[0, :4] = -100
    y[2, -1] = -100

    def fused(h, w, y):
        return linear_cross_entropy(h, w, y, chunk_size=chunk)

    # A non-unit upstream gradient checks that backward scales the stored gradients.
    got = grads(fused, h, w, y, scale=2.5)
    ref = grads(reference, h, w, y, scale=2.5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    assert got[0].dtype == torch.promote_types(dtype, torch.float32)


def test_bf16_matches_plain_path_to_bf16_rounding():
    torch.manual_seed(1)
    N, D, V = 50, 32, 101
    h = torch.randn(N, D).bfloat16()
    w = (torch.randn(V, D) * 0.3).bfloat16()
    y = torch.randint(0, V, (N,))
    got = grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=16), h, w, y)
    ref = grads(reference, h, w, y)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)  # both float32 losses
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h = torch.randn(2, 5, 8)
    w = torch.randn(13, 8)
    y = torch.full((2, 5), -100)
    loss, gh, gw = grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=3), h, w, y)
    assert loss.item() == 0.0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_tied_weight_receives_both_gradients():
    torch.manual_seed(2)
    V, D = 17, 8
    emb = torch.nn.Embedding(V, D)
    ids = torch.randint(0, V, (2, 6))
    y = torch.randint(0, V, (2, 6))

    def run(loss_fn):
        emb.zero_grad()
        h = torch.tanh(emb(ids))
        loss_fn(h, emb.weight, y).backward()
        return emb.weight.grad.clone()

    got = run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=5))
    torch.testing.assert_close(got, run(reference), atol=1e-6, rtol=1e-5)


def test_no_grad_and_bad_inputs():
    h, w, y = torch.randn(4, 8), torch.randn(5, 8), torch.randint(0, 5, (4,))
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), reference(h, w, y))
    with pytest.raises(ValueError, match="labels must have shape"):
        linear_cross_entropy(h, w, y[:3])
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)
