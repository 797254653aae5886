"""A NaN or ±inf input never travels backwards in time (issue 21).

The token-by-token reference is causal by construction: a non-finite k or v at token t leaves
the outputs at tokens < t finite. The chunked backends sum over a chunk's tokens with masked
products, where 0 · NaN = NaN would reach back to the chunk's first token; they must give the
reference's outputs before t, and NaN (never a silent finite value) from t on.
"""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule
from deltaflow.rules import RULES, triton_rules

# numpy (the Triton interpreter) warns about the NaN it is handed: that is the point here
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")
BAD_INPUTS = [("k", NAN), ("k", INF), ("v", NAN), ("v", -INF)]


def planted(rule: str, name: str, value: float, at: int, T: int = 100, dtype=torch.float64):
    """Inputs with ``value`` in one entry of ``name`` at token ``at`` (batch 1 of 2, head 1)."""
    x = make_inputs(2, T, 2, 8, 6, rule=rule, dtype=dtype, seed=at)
    if not RULES[rule].needs_beta:
        x["beta"] = None
    x[name][1, at, 1, 3] = value
    return x


def assert_causal(o, state, o_ref, state_ref, at: int, tol: float) -> None:
    """Before ``at``: finite and equal to the reference. From ``at`` on (batch 1, head 1): NaN
    wherever the reference is not finite, and NaN as documented (the whole row). Other batch
    rows and heads: untouched."""
    assert torch.isfinite(o_ref[1, :at]).all()  # the reference's own causality
    assert torch.isfinite(o[1, :at]).all(), "a non-finite value reached earlier tokens"
    assert rel_err(o[1, :at], o_ref[1, :at]) <= tol
    assert not torch.isfinite(o[1, at:, 1]).any()
    assert not torch.isfinite(state[1, 1]).any()
    assert rel_err(o[1, :, 0], o_ref[1, :, 0]) <= tol  # the other head
    assert rel_err(o[0], o_ref[0]) <= tol and rel_err(state[0], state_ref[0]) <= tol


def reference(x: dict, rule: str):
    return delta_rule(**x, rule=rule, output_final_state=True, backend="reference")


@pytest.mark.parametrize("name, value", BAD_INPUTS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_torch_chunked_forward(rule, name, value):
    # token 20 of a 64-token chunk (and of a 32-token one), and token 84 of the second chunk
    for at in (20, 84):
        x = planted(rule, name, value, at)
        o_ref, s_ref = reference(x, rule)
        for chunk_size in (64, 32):
            o, s = delta_rule(
                **x, rule=rule, output_final_state=True, backend="torch", chunk_size=chunk_size
            )
            assert_causal(o, s, o_ref, s_ref, at, 1e-10)


@pytest.mark.parametrize("name, value", BAD_INPUTS)
def test_torch_chunked_autograd_path(name, value):
    # inputs that need gradients take the autograd path (ChunkedRecurrence)
    x = planted("efla", name, value, 20)
    o_ref, s_ref = reference(x, "efla")
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in x.items()}
    o, s = delta_rule(
        **leaves, rule="efla", output_final_state=True, backend="torch", chunk_size=64
    )
    assert o.requires_grad
    assert_causal(o.detach(), s.detach(), o_ref, s_ref, 20, 1e-10)


def test_torch_chunked_varlen_keeps_sequences_apart():
    lengths = [30, 50, 20]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = make_inputs(1, sum(lengths), 2, 8, 6, rule="longhorn", n_states=3, seed=2)
    x["v"][0, 10, 0, 1] = NAN  # token 10 of the first sequence
    o_ref, _ = delta_rule(**x, rule="longhorn", cu_seqlens=cu, backend="reference")
    o, s = delta_rule(**x, rule="longhorn", cu_seqlens=cu, output_final_state=True, chunk_size=64)
    assert rel_err(o[0, :10], o_ref[0, :10]) <= 1e-10
    assert not torch.isfinite(o[0, 10:30, 0]).any() and not torch.isfinite(s[0, 0]).any()
    assert rel_err(o[0, 30:], o_ref[0, 30:]) <= 1e-10  # the other sequences: untouched
    assert torch.isfinite(s[1:]).all()


@pytest.mark.parametrize("decay", [False, True], ids=["no_decay", "decay"])
@pytest.mark.parametrize("rule", ["delta", "longhorn"])
def test_torch_chunked_documents_in_place_match_the_padded_batch(monkeypatch, rule, decay):
    """The torch backend's two forms of packed documents (ops/delta_rule.py, PACK_IN_PLACE:
    in place under torch.compile, a padded [N, T_max] batch in eager mode) give the same
    outputs, with and without grad, and the same gradients; an empty document, one-token
    documents and starts inside and at chunk boundaries (chunks of 16); a NaN and an inf each
    poison their own document's later tokens only."""
    import importlib

    op_module = importlib.import_module("deltaflow.ops.delta_rule")
    lengths = [5, 0, 27, 1, 1, 30, 16, 20]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = make_inputs(1, sum(lengths), 2, 8, 6, rule=rule, decay=decay, initial_state=False)
    weights = torch.randn(1, sum(lengths), 2, 6, dtype=torch.float64)
    results = []
    for in_place in (False, True):
        monkeypatch.setattr(op_module, "PACK_IN_PLACE", in_place)
        leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in x.items()}
        o, _ = delta_rule(**leaves, rule=rule, cu_seqlens=cu, chunk_size=16, backend="torch")
        (o * weights).sum().backward()
        grads = [t.grad for t in leaves.values() if t is not None]
        with torch.no_grad():
            o_eval, _ = delta_rule(**x, rule=rule, cu_seqlens=cu, chunk_size=16, backend="torch")
        bad = dict(x, v=x["v"].clone(), k=x["k"].clone())
        bad["v"][0, 10, 0, 1], bad["k"][0, 40, 1, 2] = NAN, INF  # documents 2 and 5
        o_bad, _ = delta_rule(**bad, rule=rule, cu_seqlens=cu, chunk_size=16, backend="torch")
        results.append((o.detach(), o_eval, grads, o_bad))
    (o0, e0, g0, b0), (o1, e1, g1, b1) = results
    assert rel_err(o1, o0) <= 1e-12 and rel_err(e1, o0) <= 1e-12 and rel_err(e0, o0) <= 1e-12
    for a, b in zip(g1, g0):
        assert rel_err(a, b) <= 1e-12
    assert torch.equal(b0.isnan(), b1.isnan())
    finite = ~b0.isnan()
    assert rel_err(b1[finite], b0[finite]) <= 1e-12
    nan_tokens = b1.isnan().any(-1)  # [1, T, H]
    assert nan_tokens[0, 10:32, 0].all() and not nan_tokens[0, :10, 0].any()
    assert not nan_tokens[0, 32:, 0].any()  # the next documents start clean
    assert nan_tokens[0, 40:64, 1].all() and not nan_tokens[0, 64:, 1].any()


class TestTriton:
    """The same on the Triton kernels (GPU, or the CPU interpreter: tiny shapes)."""

    @pytest.fixture(autouse=True)
    def _needs_triton(self):
        backend = pytest.importorskip("deltaflow.ops.triton_backend")
        if not backend.available():
            pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
        self.backend = backend
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def run(self, x: dict, rule: str, **kwargs):
        x = {n: None if t is None else t.to(self.device) for n, t in x.items()}
        o, s = delta_rule(**x, rule=rule, output_final_state=True, backend="triton", **kwargs)
        return o.cpu(), s.cpu()

    @pytest.mark.parametrize("rule", triton_rules())
    def test_every_rule(self, rule):
        # the interpreter is slow: one planted value per rule, k and v in turn
        name, value = BAD_INPUTS[sorted(RULES).index(rule) % len(BAD_INPUTS)]
        x = planted(rule, name, value, 20, T=70, dtype=torch.float32)
        o_ref, s_ref = reference(x, rule)
        assert_causal(*self.run(x, rule), o_ref, s_ref, 20, 1e-4)

    @pytest.mark.parametrize("mode, name, value", [("fused", "k", INF), ("two_pass", "v", NAN)])
    def test_second_chunk_and_both_forward_kernels(self, mode, name, value, monkeypatch):
        monkeypatch.setattr(self.backend, "FORWARD_MODE", mode)
        x = planted("delta", name, value, 84, T=130, dtype=torch.float32)
        o_ref, s_ref = reference(x, "delta")
        assert_causal(*self.run(x, "delta"), o_ref, s_ref, 84, 1e-4)

    def test_varlen_keeps_sequences_apart(self):
        lengths = [30, 70, 20]
        cu = torch.tensor([0] + lengths).cumsum(0)
        x = make_inputs(1, sum(lengths), 2, 16, 16, rule="efla", dtype=torch.float32, n_states=3)
        x["k"][0, 10, 0, 1] = NAN  # token 10 of the first sequence
        o_ref, _ = delta_rule(**x, rule="efla", cu_seqlens=cu, backend="reference")
        o, s = self.run(x, "efla", cu_seqlens=cu.to(self.device))
        assert rel_err(o[0, :10], o_ref[0, :10]) <= 1e-4
        assert not torch.isfinite(o[0, 10:30, 0]).any() and not torch.isfinite(s[0, 0]).any()
        assert rel_err(o[0, 30:], o_ref[0, 30:]) <= 1e-4 and torch.isfinite(s[1:]).all()
