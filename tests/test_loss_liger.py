"""The opt-in liger-kernel backend of linear_cross_entropy (issue 31 item 4): when the switch
sends inputs there, and the same loss and gradients as the chunked torch path. liger's kernels
are Triton; here they run on the CPU interpreter (TRITON_INTERPRET=1, set in conftest.py) with
"cpu" added to the devices the switch may send there. Without liger the numeric tests skip; the
dispatch tests use a fake and always run."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from deltaflow.models import loss as L
from deltaflow.models.loss import linear_cross_entropy

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
CAN_RUN_LIGER = HAS_LIGER and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def liger_on(monkeypatch):
    """The switch on, and this test's device one that it may send to liger."""
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "liger")
    monkeypatch.setattr(L, "_LIGER_DEVICES", ("cuda", "cpu"))


@pytest.fixture
def real_liger(liger_on):
    """liger itself, checked importable: a silent fallback would compare torch with torch."""
    L._liger_import.cache_clear()
    assert L._liger_loss() is not None


@pytest.fixture
def fake(monkeypatch, liger_on):
    """A stand-in for liger's function that records its calls and returns a marker loss."""
    calls: list[dict] = []

    def fn(h, w, y, **kw):
        calls.append(dict(h=h, w=w, y=y, **kw))
        return (h.sum() + w.sum()) * 0 + 123.0

    monkeypatch.setattr(L, "_liger_loss", lambda: fn)
    return calls


def test_chunk_mem_const_maps_our_chunk_size():
    def liger_rows(n, d, v, c):  # liger 0.8.5's fused_linear_cross_entropy_forward
        inc = -(-v // (c * d))
        return min(n, 1 << (-(-n // inc) - 1).bit_length())

    # The 400M benchmark: liger's default c = 1 gives 512 rows; ours (4096) needs c = 8..10.
    assert liger_rows(16384, 1024, 32000, 1) == 512
    c = L.liger_chunk_mem_const(16384, 1024, 32000, 4096)
    assert liger_rows(16384, 1024, 32000, c) == 4096
    assert liger_rows(16384, 1024, 32000, c + 1) > 4096
    assert L.liger_chunk_mem_const(16384, 1024, 32000, 100) == 1  # none fits: its smallest
    assert L.liger_chunk_mem_const(6, 16, 37, 4096) == 3  # ceil(37 / 16): one chunk of 6 rows
    for n, d, v, chunk in [(33, 16, 37, 7), (1000, 64, 50000, 128), (1, 8, 5, 1)]:
        c = L.liger_chunk_mem_const(n, d, v, chunk)
        assert c == 1 or liger_rows(n, d, v, c) <= chunk


def test_switch_off_or_uncovered_inputs_keep_the_torch_path(fake, monkeypatch):
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    y = torch.randint(0, 5, (4,))
    ref = L._LinearCrossEntropy.apply(h, w, y, 4096, -100, False, False)
    # float64; a weight-only gradient (liger computes it only with the hidden one's)
    linear_cross_entropy(h.double(), w.double(), y)
    linear_cross_entropy(h.detach(), w, y)
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "torch")
    torch.testing.assert_close(linear_cross_entropy(h, w, y), ref)
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "liger")
    monkeypatch.setattr(L, "_LIGER_DEVICES", ("cuda",))  # production: CPU inputs never go there
    if DEVICE == "cpu":
        linear_cross_entropy(h, w, y)
    assert fake == []
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "fused")
    with pytest.raises(ValueError, match="FUSED_CE_BACKEND"):
        linear_cross_entropy(h, w, y)


def test_switch_on_maps_the_arguments(fake):
    h = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    y = torch.randint(0, 5, (2, 3), dtype=torch.int32)
    assert linear_cross_entropy(h, w, y, chunk_size=4, ignore_index=-1).item() == 123.0
    (call,) = fake
    assert call["h"].shape == (6, 8) and call["h"].requires_grad and call["w"] is w
    assert call["y"].dtype == torch.long and call["y"].shape == (6,)
    assert call["ignore_index"] == -1 and call["reduction"] == "mean"
    assert call["accum_dtype"] == torch.float32
    assert call["chunk_mem_const"] == L.liger_chunk_mem_const(6, 8, 5, 4)
    # What needs no gradient goes detached: liger reads requires_grad, not grad mode.
    linear_cross_entropy(h, w.detach(), y)
    assert not fake[1]["w"].requires_grad and fake[1]["h"].requires_grad
    with torch.no_grad():
        linear_cross_entropy(h, w, y)
    assert not fake[2]["h"].requires_grad and not fake[2]["w"].requires_grad


def test_missing_liger_warns_once_when_asked_for_and_falls_back(liger_on, monkeypatch):
    """'liger' without liger: one warning, the torch path; 'auto' (the default) without it: the
    torch path silently."""
    import builtins
    import warnings

    real_import = builtins.__import__

    def no_liger(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise ImportError("no liger here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    L._liger_import.cache_clear()
    L._warn_once.cache_clear()
    try:
        h, w, y = torch.randn(4, 8), torch.randn(5, 8), torch.randint(0, 5, (4,))
        ref = L._LinearCrossEntropy.apply(h, w, y, 4, -100, False, False)
        with pytest.warns(RuntimeWarning, match="cannot be imported"):
            got = linear_cross_entropy(h, w, y)
        torch.testing.assert_close(got, ref)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            linear_cross_entropy(h, w, y)  # warned once already
            monkeypatch.setattr(L, "FUSED_CE_BACKEND", "auto")
            L._warn_once.cache_clear()
            torch.testing.assert_close(linear_cross_entropy(h, w, y), ref)
    finally:
        L._liger_import.cache_clear()  # later tests import the real one
        L._warn_once.cache_clear()


def _loss_and_grads(h, w, y, scale=2.5, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, y, **kw)
    (loss * scale).backward()  # a non-unit upstream gradient: liger's backward scales
    return loss.detach(), h.grad, w.grad


needs_liger = pytest.mark.skipif(
    not CAN_RUN_LIGER, reason="liger-kernel with a GPU or Triton's interpreter"
)


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 4096])  # several chunks with a ragged tail; one chunk
def test_liger_matches_the_torch_path(dtype, chunk, monkeypatch, real_liger):
    torch.manual_seed(0)
    B, T, D, V = 3, 11, 16, 37
    h = torch.randn(B, T, D, device=DEVICE).to(dtype)
    w = (torch.randn(V, D, device=DEVICE) * 0.5).to(dtype)
    y = torch.randint(0, V, (B, T), device=DEVICE)
    y[0, :4] = -100
    y[2, -1] = -100
    got = _loss_and_grads(h, w, y, chunk_size=chunk)
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "torch")
    ref = _loss_and_grads(h, w, y, chunk_size=chunk)
    assert got[0].dtype == torch.float32
    lo = dtype != torch.float32  # both round the logits and their gradient to dtype
    tol = dict(atol=2e-3, rtol=2e-2) if lo else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(got[1][0, :4], torch.zeros_like(got[1][0, :4]))  # ignored rows


@needs_liger
def test_liger_all_ignored_no_grad_and_hidden_only(monkeypatch, real_liger):
    torch.manual_seed(1)
    h, w = torch.randn(2, 5, 8, device=DEVICE), torch.randn(13, 8, device=DEVICE)
    y = torch.full((2, 5), -100, device=DEVICE)
    loss, gh, gw = _loss_and_grads(h, w, y, chunk_size=3)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()
    y = torch.randint(0, 13, (2, 5), device=DEVICE)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, y)
    hg = h.clone().requires_grad_(True)
    linear_cross_entropy(hg, w, y).backward()  # the weight needs no gradient
    monkeypatch.setattr(L, "FUSED_CE_BACKEND", "torch")
    torch.testing.assert_close(got, linear_cross_entropy(h, w, y))
    hr = h.clone().requires_grad_(True)
    linear_cross_entropy(hr, w, y).backward()
    torch.testing.assert_close(hg.grad, hr.grad, atol=1e-6, rtol=1e-5)
