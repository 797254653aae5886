"""Gradients (gradcheck), varlen packing, decode steps and bad input."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule, delta_rule_step
from deltaflow.rules import RULES


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_gradcheck(rule, backend):
    inputs = make_inputs(1, 5, 2, 3, 2, rule=rule, seed=11)
    names = ["q", "k", "v", "beta", "log_decay", "initial_state"]
    tensors = [inputs[n].clone().requires_grad_(True) for n in names]

    def f(*args):
        kw = dict(zip(names, args))
        o, s = delta_rule(
            **kw,
            rule=rule,
            negative_eigenvalues=True,
            chunk_size=2,
            output_final_state=True,
            backend=backend,
        )
        return o, s

    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_torch_gradients_match_reference():
    inputs = make_inputs(2, 70, 2, 6, 4, rule="trapezoid", seed=5)
    grads = {}
    for backend in ("reference", "torch"):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        o, s = delta_rule(**leaves, rule="trapezoid", output_final_state=True, backend=backend)
        ((o * torch.sin(o)).sum() + s.pow(2).sum()).backward()
        grads[backend] = {k: v.grad for k, v in leaves.items()}
    for name, g in grads["torch"].items():
        assert rel_err(g, grads["reference"][name]) <= 1e-10, name


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("rule", ["delta", "efla", "kaczmarz"])
def test_varlen_equals_separate_runs(backend, rule):
    lengths = [0, 5, 63, 0, 130, 1, 64]
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    inputs = make_inputs(1, T, 2, 6, 5, rule=rule, n_states=len(lengths), seed=9)
    o, s = delta_rule(
        **inputs, rule=rule, cu_seqlens=cu, output_final_state=True, backend=backend, chunk_size=16
    )
    assert o.shape == (1, T, 2, 5) and s.shape == (len(lengths), 2, 6, 5)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = {
            k: (v[i : i + 1] if k == "initial_state" else v[:, start:end])
            for k, v in inputs.items()
        }
        o_i, s_i = delta_rule(**piece, rule=rule, output_final_state=True, backend="reference")
        if end > start:
            assert rel_err(o[:, start:end], o_i) <= 1e-10
        assert rel_err(s[i : i + 1], s_i) <= 1e-10
        if end == start:
            assert torch.equal(s[i], inputs["initial_state"][i])  # empty sequence: state kept


def test_varlen_gradients_flow():
    cu = torch.tensor([0, 3, 3, 10])
    inputs = make_inputs(1, 10, 1, 3, 2, rule="longhorn", n_states=3, seed=2)
    names = ["q", "k", "v", "beta", "log_decay", "initial_state"]
    tensors = [inputs[n].clone().requires_grad_(True) for n in names]

    def f(*args):
        return delta_rule(
            **dict(zip(names, args)),
            rule="longhorn",
            cu_seqlens=cu,
            output_final_state=True,
            chunk_size=4,
            backend="torch",
        )

    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_decode_steps_equal_full_sequence(rule):
    inputs = make_inputs(3, 12, 2, 5, 4, rule=rule, seed=4, dtype=torch.float32)
    o_full, s_full = delta_rule(**inputs, rule=rule, output_final_state=True, backend="reference")
    state = inputs["initial_state"].clone()
    outs = []
    for t in range(0, 12, 3):  # 1-token and 2-token steps mixed
        for sl in (slice(t, t + 1), slice(t + 1, t + 3)):
            piece = {k: inputs[k][:, sl] for k in ("q", "k", "v", "beta", "log_decay")}
            outs.append(delta_rule_step(**piece, state=state, rule=rule))
    assert rel_err(torch.cat(outs, 1), o_full) <= 1e-5
    assert rel_err(state, s_full) <= 1e-5


def test_decode_step_errors():
    inputs = make_inputs(1, 1, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(TypeError, match="state must be a float32"):
        delta_rule_step(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            inputs["beta"],
            torch.zeros(1, 2, 4, 3, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, Dk, Dv\]"):
        delta_rule_step(
            inputs["q"], inputs["k"], inputs["v"], inputs["beta"], torch.zeros(1, 2, 3, 4)
        )


def _base():
    return make_inputs(2, 10, 3, 4, 5, rule="delta", initial_state=False, dtype=torch.float32)


BAD_INPUTS = [
    ("q rank", lambda d: d.update(q=d["q"][0]), ValueError, r"q must have shape \[B, T, H, Dk\]"),
    ("k Dk", lambda d: d.update(k=d["k"][..., :3]), ValueError, "Dk mismatch"),
    ("v shape", lambda d: d.update(v=d["v"][:, :9]), ValueError, r"v must have shape"),
    (
        "beta shape",
        lambda d: d.update(beta=d["beta"][..., :1]),
        ValueError,
        r"beta must have shape \[B, T, H\] = \[2, 10, 3\]",
    ),
    ("beta broadcast", lambda d: d.update(beta=d["beta"][:1]), ValueError, "beta must have shape"),
    (
        "beta negative",
        lambda d: d["beta"].__setitem__((0, 0, 0), -0.1),
        ValueError,
        "beta must be >= 0",
    ),
    ("beta none", lambda d: d.update(beta=None), ValueError, "beta is None but rule 'delta'"),
    (
        "log_decay positive",
        lambda d: d.update(log_decay=d["log_decay"].abs() + 0.1),
        ValueError,
        "log_decay must be <= 0",
    ),
    (
        "log_decay shape",
        lambda d: d.update(log_decay=d["log_decay"][:, :, :1]),
        ValueError,
        "log_decay must have shape",
    ),
    (
        "initial_state shape",
        lambda d: d.update(initial_state=torch.zeros(2, 3, 5, 4)),
        ValueError,
        r"initial_state must have shape \[B, H, Dk, Dv\] = \[2, 3, 4, 5\]",
    ),
    ("q int", lambda d: d.update(q=d["q"].long()), TypeError, "q must be a floating-point"),
    ("q list", lambda d: d.update(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(case):
    _, mutate, exc, pattern = case
    d = _base()
    mutate(d)
    with pytest.raises(exc, match=pattern):
        delta_rule(**d)


def test_bad_options():
    d = _base()
    with pytest.raises(ValueError, match="unknown rule 'foo'; known rules: delta, efla"):
        delta_rule(**d, rule="foo")
    for chunk_size in (0, 3, 48, -64, 2.0):
        with pytest.raises(ValueError, match="chunk_size must be a positive power of two"):
            delta_rule(**d, chunk_size=chunk_size)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        delta_rule(**d, backend="cuda")


def test_bad_cu_seqlens():
    d = make_inputs(1, 10, 2, 4, 3, initial_state=False)
    cases = [
        (torch.tensor([1, 4, 10]), "cu_seqlens must start at 0"),
        (torch.tensor([0, 6, 4, 10]), "cu_seqlens must be non-decreasing"),
        (torch.tensor([0, 4, 9]), "cu_seqlens must end at T=10"),
        (torch.tensor([0.0, 10.0]), "cu_seqlens must be an integer tensor"),
        (torch.tensor([[0, 10]]), "cu_seqlens must be a 1-D"),
    ]
    for cu, pattern in cases:
        with pytest.raises((ValueError, TypeError), match=pattern):
            delta_rule(**d, cu_seqlens=cu)
    d2 = make_inputs(2, 10, 2, 4, 3, initial_state=False)
    with pytest.raises(ValueError, match="cu_seqlens requires B == 1"):
        delta_rule(**d2, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, Dk, Dv\]"):
        delta_rule(
            **{**d, "initial_state": torch.zeros(1, 2, 4, 3)}, cu_seqlens=torch.tensor([0, 4, 10])
        )


def test_trapezoid_negative_eigenvalues_warns():
    d = make_inputs(1, 4, 1, 3, 2, rule="trapezoid")
    with pytest.warns(UserWarning, match="unstable"):
        delta_rule(**d, rule="trapezoid", negative_eigenvalues=True)
