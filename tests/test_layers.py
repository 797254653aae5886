"""Layers: every mixer gives the same outputs full-sequence, padded and step by step."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from _inputs import reads_decay
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaflow import delta_rule
from deltaflow.layers import (
    DeltaAttention,
    RMSNorm,
    ShortConvolution,
    SoftmaxAttention,
    default_qk_norm,
    l2_normalize,
    prepare_padding_mask,
)
from deltaflow.rules import RULES

ALL_RULES = list(RULES)  # every rule; the ones that read the decay get one (reads_decay)
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("seed_and_one_thread")  # conftest.py


def _decode(layer, x, prefix: int = 0, mask=None):
    """Prefill ``prefix`` tokens in one call (if > 0), then feed the rest one token at a time."""
    outs, state = [], None
    with torch.no_grad():
        if prefix:
            m = None if mask is None else mask[:, :prefix]
            o, state = layer(x[:, :prefix], attention_mask=m, state=state, use_cache=True)
            outs.append(o)
        for t in range(prefix, x.shape[1]):
            m = None if mask is None else mask[:, t : t + 1]
            o, state = layer(x[:, t : t + 1], attention_mask=m, state=state, use_cache=True)
            outs.append(o)
    return torch.cat(outs, 1), state


def _pad(x, left: int, right: int):
    """Surround x [1, T, C] with random (not zero) padding; returns the padded x and mask."""
    B, T, C = x.shape
    xp = torch.randn(B, left + T + right, C)
    xp[:, left : left + T] = x
    m = torch.zeros(B, left + T + right, dtype=torch.long)
    m[:, left : left + T] = 1
    return xp, m


def _check_modes(layer, T: int = 21, hidden: int = 32, prefix: int = 5):
    """full == step-by-step == prefill+steps == left/right padded batch (unpadded positions)."""
    layer.eval()
    x = torch.randn(2, T, hidden)
    with torch.no_grad():
        y, _ = layer(x)
    y_step, _ = _decode(layer, x)
    y_pref, _ = _decode(layer, x, prefix=prefix)
    assert y.abs().max() > 1e-3  # a dead layer would pass everything below
    torch.testing.assert_close(y_step, y, atol=TOL, rtol=0)
    torch.testing.assert_close(y_pref, y, atol=TOL, rtol=0)

    # Batch: row 0 left-padded by 3, row 1 right-padded by 3 (different chunk alignment).
    xl, ml = _pad(x[:1], 3, 0)
    xr, mr = _pad(x[1:], 0, 3)
    xb, mb = torch.cat([xl, xr]), torch.cat([ml, mr])
    with torch.no_grad():
        yb, _ = layer(xb, attention_mask=mb)
    torch.testing.assert_close(yb[0, 3:], y[0], atol=TOL, rtol=0)
    torch.testing.assert_close(yb[1, :T], y[1], atol=TOL, rtol=0)
    return layer, x, y, xb, mb


@pytest.mark.parametrize(
    ("rule", "use_decay"),
    [(r, d) for r in ALL_RULES for d in (False, True) if d or not reads_decay(r)],
)
def test_delta_attention_modes_agree(rule, use_decay):
    layer = DeltaAttention(
        32, num_heads=2, rule=rule, use_decay=use_decay, chunk_size=8, backend="torch"
    )
    _check_modes(layer)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rule="delta", negative_eigenvalues=True, use_decay=True),
        dict(rule="trapezoid", beta_activation="softplus", qk_norm="none"),
        dict(rule="efla", num_v_heads=4, expand_v=2.0, head_dim=8, use_decay=True),
        dict(rule="delta", use_short_conv=False, use_output_gate=False),
        dict(rule="relaxed_kaczmarz", conv_size=2, qk_norm=("none", "l2")),
        dict(rule="gated_efla", use_decay=True),  # the rule that reads the decay
    ],
)
def test_delta_attention_variants_modes_agree(kwargs):
    layer = DeltaAttention(32, num_heads=2, chunk_size=8, backend="torch", **kwargs)
    _check_modes(layer)


def test_gated_efla_layer_needs_the_decay_and_differs_from_efla_times_alpha():
    with pytest.raises(ValueError, match="rule 'gated_efla' reads the decay: set use_decay=True"):
        DeltaAttention(32, num_heads=2, rule="gated_efla")
    torch.manual_seed(0)
    paper = DeltaAttention(32, num_heads=2, rule="gated_efla", use_decay=True, backend="auto")
    efla = DeltaAttention(32, num_heads=2, rule="efla", use_decay=True)
    efla.load_state_dict(paper.state_dict())  # same parameters, different rule
    x = torch.randn(2, 19, 32, requires_grad=True)
    y, _ = paper(x)
    assert not torch.allclose(y, efla(x)[0], atol=1e-4)
    y.square().sum().backward()
    assert torch.isfinite(paper.A_log.grad).all() and paper.A_log.grad.abs().sum() > 0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rule=st.sampled_from(ALL_RULES + ["softmax", "sliding"]),
    T=st.integers(1, 20),
    left=st.integers(0, 9),
    right=st.integers(0, 9),
    chunk=st.sampled_from([2, 4, 16]),
    conv=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_padding_invariance_property(rule, T, left, right, chunk, conv, seed):
    """Any left/right padding, length, chunk size and conv width: real positions unchanged."""
    torch.manual_seed(seed)
    if rule in ("softmax", "sliding"):
        layer = SoftmaxAttention(16, num_heads=2, window_size=3 if rule == "sliding" else None)
    else:
        layer = DeltaAttention(
            16, num_heads=2, rule=rule, use_decay=seed % 2 == 0 or reads_decay(rule),
            conv_size=conv, chunk_size=chunk, backend="torch",
        )  # fmt: skip
    x = torch.randn(1, T, 16)
    xp, m = _pad(x, left, right)
    with torch.no_grad():
        y, _ = layer(x)
        yp, _ = layer(xp, attention_mask=m)
    assert torch.isfinite(yp).all()
    torch.testing.assert_close(yp[:, left : left + T], y, atol=TOL, rtol=0)


def test_padded_decode_continues_like_unpadded():
    """Prefill a left+right padded batch, then decode: states must equal unpadded ones."""
    layer = DeltaAttention(32, num_heads=2, rule="efla", use_decay=True, backend="torch").eval()
    x = torch.randn(1, 9, 32)
    nxt = torch.randn(1, 4, 32)
    ref, _ = _decode(layer, torch.cat([x, nxt], 1), prefix=9)
    for left, right in [(3, 0), (0, 3), (2, 2)]:
        xp, m = _pad(x, left, right)
        with torch.no_grad():
            _, state = layer(xp, attention_mask=m, use_cache=True)
            outs = [layer(nxt[:, t : t + 1], state=state, use_cache=True)[0] for t in range(4)]
        torch.testing.assert_close(torch.cat(outs, 1), ref[:, 9:], atol=TOL, rtol=0)


def test_decode_state_contents():
    layer = DeltaAttention(32, num_heads=2, head_dim=8, expand_v=1.5, conv_size=3, backend="torch")
    _, state = _decode(layer.eval(), torch.randn(3, 4, 32), prefix=2)
    assert state["recurrent_state"].shape == (3, 2, 8, 12)
    assert state["recurrent_state"].dtype == torch.float32
    assert state["conv_q"].shape == (3, 16, 2) and state["conv_v"].shape == (3, 24, 2)


def test_delta_attention_matches_explicit_parametrization():
    """Rebuild q, k, v, β, α by hand from docs/design.md §4 and compare with the layer
    (efla: raw k)."""
    layer = DeltaAttention(
        24, num_heads=2, head_dim=6, expand_v=2.0, num_v_heads=4, rule="efla", use_decay=True,
        beta_activation="softplus", backend="torch",
    )  # fmt: skip
    x = torch.randn(2, 13, 24)
    B, T, _ = x.shape
    q = layer.q_conv(layer.q_proj(x))[0].view(B, T, 2, 6)  # the conv applies SiLU
    k = layer.k_conv(layer.k_proj(x))[0].view(B, T, 2, 6)
    v = layer.v_conv(layer.v_proj(x))[0].view(B, T, 4, 12)
    q = q / q.norm(dim=-1, keepdim=True)  # efla default: L2 on q only
    q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    beta = F.softplus(layer.b_proj(x))
    log_decay = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    o, _ = delta_rule(q, k, v, beta, rule="efla", log_decay=log_decay, backend="reference")
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight
    o = o * F.silu(layer.g_proj(x).view(B, T, 4, 12))
    ref = layer.o_proj(o.reshape(B, T, 48))
    y, _ = layer(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)


def test_default_qk_norm_per_rule():
    assert default_qk_norm("delta") == ("l2", "l2")
    assert default_qk_norm("linear") == ("l2", "l2")
    for rule in ["efla", "longhorn", "trapezoid", "kaczmarz", "relaxed_kaczmarz"]:
        assert default_qk_norm(rule) == ("l2", "none")
        assert DeltaAttention(16, 2, rule=rule).k_norm == "none"
    # Rules that take no β get no β projection.
    assert not hasattr(DeltaAttention(16, 2, rule="kaczmarz"), "b_proj")
    assert hasattr(DeltaAttention(16, 2, rule="delta"), "b_proj")


def test_layer_lets_the_op_choose_the_chunk_size(monkeypatch):
    # DeltaAttention(chunk_size=None) must not override the op's measured CPU default (32).
    op = importlib.import_module("deltaflow.ops.delta_rule")  # the module, not the function
    seen = []
    real = op.chunk_delta_rule

    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(op, "chunk_delta_rule", spy)
    # T longer than the default chunk: a chunk past T is capped at it (issue 34 item 11)
    T = 2 * op.CPU_CHUNK_SIZE + 1
    DeltaAttention(32, num_heads=2, backend="torch")(torch.randn(1, T, 32))
    DeltaAttention(32, num_heads=2, backend="torch", chunk_size=8)(torch.randn(1, T, 32))
    assert seen == [op.CPU_CHUNK_SIZE, 8]


def test_decay_init_ranges():
    layer = DeltaAttention(64, num_heads=64, head_dim=4, use_decay=True)
    A = layer.A_log.exp()
    dt = F.softplus(layer.dt_bias)
    assert (A > 0).all() and (A <= 16).all() and A.max() > 4  # U(0, 16) over 64 heads
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 0.1 * 1.001).all()
    assert dt.min() < 0.01 < dt.max()  # log-uniform spreads over two decades
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay


def test_delta_attention_gradients_reach_every_parameter():
    layer = DeltaAttention(16, num_heads=2, rule="longhorn", use_decay=True, backend="torch")
    x = torch.randn(2, 10, 16, requires_grad=True)
    m = torch.ones(2, 10, dtype=torch.long)
    m[0, :2] = 0
    y, _ = layer(x, attention_mask=m)
    y.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_fully_padded_row_is_finite_and_other_rows_unaffected():
    layer = DeltaAttention(16, num_heads=2, rule="kaczmarz", backend="torch").eval()
    x = torch.randn(2, 7, 16)
    m = torch.ones(2, 7, dtype=torch.long)
    m[1] = 0
    with torch.no_grad():
        y, _ = layer(x, attention_mask=m)
        y0, _ = layer(x[:1])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0], y0[0], atol=TOL, rtol=0)


# ---------------------------------------------------------------- short conv


def test_short_conv_matches_explicit_loop_and_caches_last_real_window():
    conv = ShortConvolution(5, kernel_size=4)
    x = torch.randn(2, 9, 5)
    y, state = conv(x, output_state=True)
    w = conv.weight[:, 0]  # [C, W]
    xpad = F.pad(x, (0, 0, 3, 0))
    ref = torch.stack([F.silu((xpad[:, t : t + 4] * w.T).sum(1)) for t in range(9)], 1)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))
    # Right padding: the window ends at the last real token, not at the padding.
    m = torch.ones(2, 9, dtype=torch.bool)
    m[1, 6:] = False
    _, state = conv(x, mask=m, output_state=True)
    torch.testing.assert_close(state[1], x[1, 3:6].T)
    torch.testing.assert_close(state[0], x[0, 6:9].T)


def test_short_conv_packed_sequences_restart():
    conv = ShortConvolution(6, kernel_size=4)
    lens = [3, 0, 1, 7]
    parts = [torch.randn(1, n, 6) for n in lens]
    cu = torch.tensor([0, 3, 3, 4, 11])
    y, _ = conv(torch.cat(parts, 1), cu_seqlens=cu)
    ref = torch.cat([conv(p)[0] for p in parts if p.shape[1]], 1)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)


def test_short_conv_bad_inputs():
    conv = ShortConvolution(4, kernel_size=3)
    with pytest.raises(ValueError, match="x must be"):
        conv(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="state must be"):
        conv(torch.randn(2, 5, 4), state=torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConvolution(4, kernel_size=0)


# ---------------------------------------------------------------- softmax attention


def _naive_attention(layer: SoftmaxAttention, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token softmax attention with RoPE at positions 0..T-1 (and the window)."""
    B, T, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(B, T, H, D)
    k = layer.k_proj(x).view(B, T, Hkv, D)
    v = layer.v_proj(x).view(B, T, Hkv, D)
    pos = torch.arange(T).expand(B, T)
    inv = 1.0 / layer.rope_theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos[..., None] * inv
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    outs = []
    for t in range(T):
        lo = 0 if layer.window_size is None else max(0, t - layer.window_size + 1)
        s = torch.einsum("bhd,bshd->bhs", q[:, t], k[:, lo : t + 1]) / math.sqrt(D)
        outs.append(torch.einsum("bhs,bshd->bhd", s.softmax(-1), v[:, lo : t + 1]))
    return layer.o_proj(torch.stack(outs, 1).reshape(B, T, H * D))


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(num_kv_heads=2), dict(window_size=4), dict(window_size=1, qk_norm=True)],
)
def test_softmax_attention_modes_agree(kwargs):
    layer = SoftmaxAttention(32, num_heads=4, **kwargs)
    layer, x, y, xb, mb = _check_modes(layer)
    if not layer.qk_norm:
        with torch.no_grad():
            torch.testing.assert_close(y, _naive_attention(layer, x), atol=1e-5, rtol=0)
    _, state = _decode(layer, x, prefix=4)
    T = x.shape[1]
    kept = T if layer.window_size is None else layer.window_size - 1  # trimmed window cache
    assert state["key"].shape == (2, layer.num_kv_heads, kept, layer.head_dim)
    assert state["key_pos"].shape == (2, kept) and (state["num_tokens"] == T).all()
    if kept:
        assert (state["key_pos"][:, -1] == T - 1).all()


def test_softmax_attention_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        SoftmaxAttention(30, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        SoftmaxAttention(32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="window_size"):
        SoftmaxAttention(32, num_heads=4, window_size=0)


# ---------------------------------------------------------------- validation and helpers


def test_delta_attention_bad_config():
    with pytest.raises(ValueError, match="unknown rule"):
        DeltaAttention(32, 2, rule="newton")
    with pytest.raises(ValueError, match="divisible"):
        DeltaAttention(30, 4)
    DeltaAttention(30, 4, head_dim=8)  # an explicit head_dim need not divide hidden_size
    with pytest.raises(ValueError, match="num_v_heads"):
        DeltaAttention(32, 2, num_v_heads=3)
    with pytest.raises(ValueError, match="expand_v"):
        DeltaAttention(32, 2, expand_v=0.3)
    with pytest.raises(ValueError, match="beta_activation"):
        DeltaAttention(32, 2, beta_activation="relu")
    with pytest.raises(ValueError, match="qk_norm"):
        DeltaAttention(32, 2, qk_norm="layer")
    with pytest.raises(ValueError, match="chunk_size"):
        DeltaAttention(32, 2, chunk_size=48)
    with pytest.raises(ValueError, match="backend"):
        DeltaAttention(32, 2, backend="cuda")


def test_bad_inputs_raise():
    layer = DeltaAttention(16, 2, backend="torch")
    x = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match=r"attention_mask must have shape"):
        layer(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="only 0 and 1"):
        layer(x, attention_mask=torch.full((2, 6), 2))
    hole = torch.ones(2, 6, dtype=torch.long)
    hole[0, 3] = 0
    with pytest.raises(ValueError, match="contiguous"):
        layer(x, attention_mask=hole)
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer(x, attention_mask=[[1] * 6] * 2)


def test_mask_helper_and_norms():
    assert prepare_padding_mask(torch.ones(2, 4), 2, 4, torch.device("cpu")) is None
    m = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    assert prepare_padding_mask(m, 2, 4, torch.device("cpu")).dtype == torch.bool
    x = torch.randn(3, 7) * 5
    torch.testing.assert_close(l2_normalize(x).norm(dim=-1), torch.ones(3), atol=1e-5, rtol=0)
    assert l2_normalize(torch.zeros(2, 3)).abs().sum() == 0
    norm = RMSNorm(7)
    torch.testing.assert_close(norm(x).pow(2).mean(-1), torch.ones(3), atol=1e-3, rtol=0)


def test_inputs_that_gave_raw_errors_are_one_clear_error():
    """Issue 34 item 12: T = 0 failed in the conv; meta-device input, fp64 input to an fp32
    layer and a non-dict state gave raw errors; norm_eps=-1 and eps=0 were accepted."""
    layer = DeltaAttention(16, num_heads=2, backend="torch")
    with pytest.raises(ValueError, match="DeltaAttention: the input has no tokens"):
        layer(torch.zeros(1, 0, 16))
    with pytest.raises(ValueError, match="on the meta device"):
        layer(torch.zeros(1, 3, 16, device="meta"))
    with pytest.raises(TypeError, match="hidden_states are torch.float64 but the layer's"):
        layer(torch.zeros(1, 3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="state must be the dict a previous call returned"):
        layer(torch.zeros(1, 3, 16), state=[1, 2])
    for kwargs in (dict(norm_eps=-1), dict(eps=0), dict(eps=float("nan"))):
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            DeltaAttention(16, num_heads=2, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes are autocast's job
        assert layer(torch.zeros(1, 3, 16))[0].shape == (1, 3, 16)
