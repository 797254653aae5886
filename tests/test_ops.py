"""Every backend against the float64 token-by-token reference."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaflow import delta_rule
from deltaflow.rules import RULES

ALL_RULES = sorted(RULES)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def run(backend: str, inputs: dict, **kw):
    return delta_rule(**inputs, output_final_state=True, backend=backend, **kw)


@pytest.mark.parametrize("rule", ALL_RULES)
@pytest.mark.parametrize("negative_eigenvalues", [False, True])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_matches_reference(rule, negative_eigenvalues, decay, initial_state, dtype):
    if not decay and RULES[rule].decay_coefficients is not None:
        # a rule that reads the decay is refused without one, by every backend (and the layer)
        inputs = make_inputs(1, 5, 2, 8, 5, rule=rule, dtype=dtype, decay=False)
        for backend in ("reference", "torch", "auto"):
            with pytest.raises(ValueError, match=f"rule '{rule}' reads the decay: give log_decay"):
                run(backend, inputs, rule=rule, negative_eigenvalues=negative_eigenvalues)
        return
    for T in (1, 5, 63, 64, 65, 200):
        inputs = make_inputs(
            2, T, 2, 8, 5, rule=rule, dtype=dtype, decay=decay, initial_state=initial_state, seed=T
        )
        kw = {"rule": rule, "negative_eigenvalues": negative_eigenvalues}
        o_ref, s_ref = run("reference", inputs, **kw)
        o, s = run("torch", inputs, **kw)
        assert o.dtype == dtype and s.dtype == dtype
        assert o.shape == (2, T, 2, 5) and s.shape == (2, 2, 8, 5)
        assert rel_err(o, o_ref) <= TOL[dtype], f"o, T={T}"
        assert rel_err(s, s_ref) <= TOL[dtype], f"state, T={T}"


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 128])
def test_chunk_sizes(chunk_size):
    inputs = make_inputs(1, 77, 2, 6, 7, rule="efla", seed=3)
    o_ref, s_ref = run("reference", inputs, rule="efla")
    o, s = run("torch", inputs, rule="efla", chunk_size=chunk_size)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10


def test_a_chunk_longer_than_the_sequence_is_capped_at_it():
    """Issue 34 item 11: chunk_size=2**20 at T=10 asked for 1 TiB of padding (65536: 16 GB)."""
    inputs = make_inputs(1, 10, 2, 6, 7, rule="efla", seed=3)
    o_ref, s_ref = run("reference", inputs, rule="efla")
    for chunk_size in (2**16, 2**20):
        o, s = run("torch", inputs, rule="efla", chunk_size=chunk_size)
        assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 90),
    H=st.integers(1, 3),
    Dk=st.integers(1, 9),
    Dv=st.integers(1, 9),
    rule=st.sampled_from(ALL_RULES),
    log_chunk=st.integers(0, 6),
    decay=st.booleans(),
    negative_eigenvalues=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_shapes(B, T, H, Dk, Dv, rule, log_chunk, decay, negative_eigenvalues, seed):
    decay = decay or RULES[rule].decay_coefficients is not None  # refused without one
    inputs = make_inputs(B, T, H, Dk, Dv, rule=rule, decay=decay, seed=seed)
    kw = {"rule": rule, "negative_eigenvalues": negative_eigenvalues}
    o_ref, s_ref = run("reference", inputs, **kw)
    o, s = run("torch", inputs, chunk_size=2**log_chunk, **kw)
    assert rel_err(o, o_ref) <= 1e-9 and rel_err(s, s_ref) <= 1e-9


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_low_precision_inputs(backend):
    inputs = make_inputs(1, 40, 2, 8, 8, rule="delta", dtype=torch.bfloat16)
    inputs["initial_state"] = inputs["initial_state"].float()
    o, s = run(backend, inputs)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ref, _ = run("reference", {k: None if t is None else t.double() for k, t in inputs.items()})
    assert rel_err(o, ref) < 2e-2


def _grads(inputs: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``o``, the final state and every input's gradient of a fixed loss."""
    x = {k: None if t is None else t.detach().requires_grad_() for k, t in inputs.items()}
    o, s = delta_rule(**x, output_final_state=True, **kw)
    (o.float().square().sum() + s.sum()).backward()
    return o, s, {k: t.grad for k, t in x.items() if t is not None}


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rule", ["delta", "gated_efla"])
def test_cpu_bf16_autocast_keeps_the_dtype_policy(T, packed, rule):
    """CPU bf16 autocast (the trainer's precision='bf16'): the torch backends compute in fp32
    as without it (docs/design.md §1). Autocast ran their matmuls in bf16 and the chunked
    backward failed on the mix ("expected scalar type Float but found BFloat16"); the
    forward-only path failed too. bf16 inputs give exactly their result without autocast,
    near the float64 reference of the rounded inputs; fp32 inputs keep fp32's accuracy."""
    cu = torch.tensor([0, T // 3, T]) if packed else None
    inputs = make_inputs(1, T, 2, 8, 8, rule=rule, n_states=2 if packed else 1, seed=T)
    bf16 = {k: t.bfloat16() if k != "initial_state" else t.float() for k, t in inputs.items()}
    exact = {k: t.double() for k, t in bf16.items()}
    kw = {"rule": rule, "cu_seqlens": cu}
    o_ref, s_ref, g_ref = _grads(exact, backend="reference", **kw)
    o_plain, s_plain, g_plain = _grads(bf16, **kw)  # no autocast
    for backend in ("torch", "reference"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                o_ng, s_ng = run(backend, bf16, **kw)
            o, s, g = _grads(bf16, backend=backend, **kw)
        assert o.dtype == o_ng.dtype == torch.bfloat16 and s.dtype == s_ng.dtype == torch.float32
        if backend == "torch":  # the same computation as without autocast
            assert torch.equal(o, o_plain) and torch.equal(s, s_plain) and torch.equal(o_ng, o)
            assert all(torch.equal(g[k], g_plain[k]) for k in g)
        for out, ref in ((o, o_ref), (s, s_ref), (o_ng, o_ref), (s_ng, s_ref)):
            assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2, backend
        for k in g:
            assert torch.isfinite(g[k]).all() and rel_err(g[k], g_ref[k]) < 2e-2, (backend, k)
    # fp32 inputs under autocast: fp32's accuracy, not bf16 matmuls' (~3e-3 before)
    fp32 = {k: t.float() for k, t in inputs.items()}
    o_ref, s_ref, g_ref = _grads(inputs, backend="reference", **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s, g = _grads(fp32, backend="torch", **kw)
    assert o.dtype == s.dtype == torch.float32
    assert rel_err(o, o_ref) <= TOL[torch.float32] and rel_err(s, s_ref) <= TOL[torch.float32]
    assert all(rel_err(g[k], g_ref[k]) <= 10 * TOL[torch.float32] for k in g)


def test_cpu_bf16_autocast_decode_step_keeps_the_state_dtype():
    """delta_rule_step's torch path under CPU bf16 autocast: as without it (fp32 products)."""
    from deltaflow.ops import delta_rule_step

    inputs = make_inputs(1, 3, 2, 8, 8, rule="delta", seed=5)
    x = {k: t.bfloat16() for k, t in inputs.items() if k in ("q", "k", "v", "beta", "log_decay")}
    outs, states = [], []
    for autocast in (False, True):
        state = inputs["initial_state"].float().clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs.append(delta_rule_step(**x, state=state, rule="delta"))
        states.append(state)
    assert outs[1].dtype == torch.bfloat16 and states[1].dtype == torch.float32
    assert torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1])


def test_default_scale_and_no_final_state():
    inputs = make_inputs(1, 9, 1, 16, 4, rule="longhorn")
    o, s = delta_rule(**inputs, rule="longhorn")
    assert s is None
    o2, _ = delta_rule(**inputs, rule="longhorn", scale=0.25)  # Dk ** -0.5 = 0.25
    assert torch.equal(o, o2)
    o3, _ = delta_rule(**inputs, rule="longhorn", scale=0.5)
    assert torch.allclose(o3, 2 * o)


def test_beta_none_rules():
    inputs = make_inputs(1, 30, 2, 4, 3, rule="kaczmarz")
    inputs.pop("beta")
    for rule in ("linear", "kaczmarz"):
        o_ref, _ = run("reference", inputs, rule=rule)
        o, _ = run("torch", inputs, rule=rule)
        assert rel_err(o, o_ref) <= 1e-10
    # linear with beta=None is plain (decayed) linear attention: S_t = α S + k vᵀ
    o, _ = run("torch", inputs, rule="linear")
    o_b, _ = run(
        "torch", {**inputs, "beta": torch.ones(1, 30, 2, dtype=torch.float64)}, rule="linear"
    )
    assert torch.allclose(o, o_b)


def test_user_rule_function_and_registration():
    from deltaflow.rules import register_rule

    def my_longhorn(beta, lam, eps):
        a = beta / (1 + beta * lam)
        return a, a

    inputs = make_inputs(1, 50, 2, 5, 3, rule="longhorn")
    ref, _ = run("torch", inputs, rule="longhorn")
    for rule in (my_longhorn, register_rule("my_longhorn_test", my_longhorn)):
        for backend in ("reference", "torch"):
            o, _ = run(backend, inputs, rule=rule)
            assert rel_err(o, ref) <= 1e-12
    with pytest.raises(ValueError, match="runs the rules of the Triton rule table only"):
        run("triton", inputs, rule=my_longhorn)


@pytest.mark.parametrize("rule", ["delta", "linear"])
def test_raw_keys_for_normalized_rules(rule):
    # The op never normalizes k: raw keys are used as given, even where the rule is unstable.
    inputs = make_inputs(1, 64, 2, 4, 3, rule="efla", seed=7)
    o_ref, s_ref = run("reference", inputs, rule=rule)
    o, s = run("torch", inputs, rule=rule, chunk_size=16)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10


def test_negative_eigenvalues_doubles_strengths():
    # With a = b, doubling both is the same as doubling beta for delta (a = β).
    inputs = make_inputs(1, 20, 1, 4, 3, rule="delta")
    o1, _ = run("torch", inputs, rule="delta", negative_eigenvalues=True)
    o2, _ = run("torch", {**inputs, "beta": 2 * inputs["beta"]}, rule="delta")
    assert rel_err(o1, o2) <= 1e-12


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 1, 16, 64])
def test_forward_only_path_equals_the_autograd_path_and_the_reference(B, decay, chunk_size):
    """Without gradients the torch backend takes a separate forward (nothing saved, chunk-major
    layout); it must agree with the autograd path and the float64 reference."""
    x = make_inputs(B, 77, 3, 8, 6, rule="delta", decay=decay)
    ref_o, ref_s = run("reference", x)
    with torch.no_grad():
        o, s = run("torch", x, chunk_size=chunk_size)
    leaves = {k: (t.clone().requires_grad_(True) if t is not None else None) for k, t in x.items()}
    o_grad, s_grad = run("torch", leaves, chunk_size=chunk_size)
    assert o_grad.grad_fn is not None and o.grad_fn is None
    for got in (o, o_grad):
        assert (got - ref_o).abs().max() < 1e-12
    for got in (s, s_grad):
        assert (got - ref_s).abs().max() < 1e-12


def test_arguments_that_switched_checks_off_or_were_taken_are_refused():
    """Issue 34 item 12: check_values=None/0 turned the value checks off unseen; scale nan/inf
    was taken; a user rule returning NaN was taken silently and the wrong shape gave a raw
    error."""
    inputs = make_inputs(1, 6, 2, 4, 4, rule="delta", seed=0)
    for value in (None, 0, "no"):
        with pytest.raises(TypeError, match="check_values must be True or False"):
            delta_rule(**inputs, rule="delta", check_values=value)
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            delta_rule(**inputs, rule="delta", scale=scale)

    def nan_rule(beta, lam, eps):
        return beta * float("nan"), beta

    def flat_rule(beta, lam, eps):
        return beta.flatten(), beta.flatten()

    with pytest.raises(ValueError, match="rule 'nan_rule' returned NaN or inf in a"):
        delta_rule(**inputs, rule=nan_rule, backend="torch")
    with pytest.raises(ValueError, match=r"rule 'flat_rule' must return \(a, b\) tensors of"):
        delta_rule(**inputs, rule=flat_rule, backend="torch")
