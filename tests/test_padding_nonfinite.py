"""Padding is selected away, not multiplied by 0: nan/inf hidden states at padded positions
(left, right or both) never reach a real token, for every rule, forward and backward."""

from __future__ import annotations

import pytest
import torch

from deltaflow.layers import DeltaAttention, ShortConvolution, SoftmaxAttention
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.rules import RULES

T, HIDDEN = 20, 16


def _mask() -> torch.Tensor:
    """Row 0 right-padded, row 1 left-padded, row 2 both, row 3 unpadded (chunk size 8, so
    padding starts and ends inside chunks)."""
    m = torch.ones(4, T, dtype=torch.bool)
    m[0, 13:] = False
    m[1, :5] = False
    m[2, :3] = False
    m[2, 17:] = False
    return m


def _poisoned(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with nan at every padded position and +-inf at a few of them."""
    bad = x.clone()
    bad[~mask] = float("nan")
    bad[0, 15, :3] = float("inf")
    bad[1, 2, -2:] = -float("inf")
    return bad


def _run(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor):
    """Outputs, the cached state, and parameter gradients of a loss on real positions only."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y, state = layer(x, attention_mask=mask, use_cache=True)
    (y[mask] ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), state, grads, x.grad


def _check_unpoisoned(layer: torch.nn.Module) -> None:
    torch.manual_seed(1)
    mask = _mask()
    clean = torch.randn(4, T, HIDDEN)  # random, not zero, at padded positions too
    y0, s0, g0, dx0 = _run(layer, clean, mask)
    y1, s1, g1, dx1 = _run(layer, _poisoned(clean, mask), mask)
    assert torch.isfinite(y1).all(), "non-finite output"
    # What a padded position holds does not matter at all: same outputs everywhere.
    torch.testing.assert_close(y1[mask], y0[mask], rtol=0, atol=0)
    for name in s0:
        if torch.is_tensor(s0[name]) and s0[name].is_floating_point():
            assert torch.isfinite(s1[name]).all(), f"non-finite state {name}"
            torch.testing.assert_close(s1[name], s0[name], rtol=0, atol=0)
    assert g1.keys() == g0.keys()
    for name in g0:
        assert torch.isfinite(g1[name]).all(), f"non-finite gradient of {name}"
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0)
    assert torch.isfinite(dx1[mask]).all() and (dx1[~mask] == 0).all()


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("use_decay", [False, True])
def test_delta_attention_nonfinite_padding_never_reaches_real_tokens(rule, use_decay):
    if RULES[rule].decay_coefficients is not None and not use_decay:
        pytest.skip(f"{rule} reads the decay: the layer refuses it without use_decay")
    torch.manual_seed(0)
    layer = DeltaAttention(
        HIDDEN, num_heads=2, rule=rule, use_decay=use_decay, chunk_size=8, backend="torch"
    )
    _check_unpoisoned(layer)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rule="delta", negative_eigenvalues=True, beta_activation="softplus"),
        dict(rule="efla", use_short_conv=False),
        dict(rule="delta", use_decay=True, backend="reference"),
    ],
)
def test_delta_attention_variants_nonfinite_padding(kwargs):
    torch.manual_seed(0)
    _check_unpoisoned(DeltaAttention(HIDDEN, num_heads=2, chunk_size=8, **kwargs))


@pytest.mark.parametrize("window", [None, 6])
def test_softmax_attention_nonfinite_padding_never_reaches_real_tokens(window):
    torch.manual_seed(0)
    _check_unpoisoned(SoftmaxAttention(HIDDEN, num_heads=2, window_size=window))


def test_short_conv_selects_padding_away():
    torch.manual_seed(0)
    conv = ShortConvolution(HIDDEN, 4)
    mask = _mask()
    x = torch.randn(4, T, HIDDEN)
    y0, w0 = conv(x, mask, output_state=True)
    y1, w1 = conv(_poisoned(x, mask), mask, output_state=True)
    assert torch.isfinite(y1).all() and torch.isfinite(w1).all()
    assert torch.equal(y1, y0) and torch.equal(w1, w0)


def test_model_with_nonfinite_padded_embeddings_keeps_real_logits():
    """A hybrid model fed inputs_embeds with nan at padded positions: real positions' logits
    are those of any finite padding (the residual stream at padded positions may stay nan)."""
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=11, hidden_size=HIDDEN, num_layers=2, num_heads=2, attn_every=2, chunk_size=8
    )
    model = DeltaFlowForCausalLM(cfg).eval()
    mask = _mask()
    emb = torch.randn(4, T, HIDDEN)
    with torch.no_grad():
        clean = model(inputs_embeds=emb, attention_mask=mask.long()).logits
        bad = model(inputs_embeds=_poisoned(emb, mask), attention_mask=mask.long()).logits
    assert torch.isfinite(bad[mask]).all()
    torch.testing.assert_close(bad[mask], clean[mask], rtol=0, atol=0)
