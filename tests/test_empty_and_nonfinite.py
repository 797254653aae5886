"""Edge inputs of delta_rule: empty sequences (T = 0) and non-finite beta / log_decay."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs

from deltaflow import delta_rule
from deltaflow.ops.checks import BACKENDS

# every backend, 'triton' too: T = 0 returns before any backend (or availability check) runs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_sequence_returns_empty_output_and_the_initial_state(backend, initial_state, dtype):
    B, H, Dk, Dv = 2, 3, 5, 7
    x = make_inputs(B, 0, H, Dk, Dv, dtype=dtype, initial_state=initial_state)
    if not initial_state:
        x["initial_state"] = None
    o, state = delta_rule(**x, output_final_state=True, backend=backend)
    assert o.shape == (B, 0, H, Dv) and o.dtype == dtype
    assert state.shape == (B, H, Dk, Dv) and state.dtype == dtype  # float32 or float64 state
    if initial_state:
        assert torch.equal(state, x["initial_state"])
        assert state.data_ptr() != x["initial_state"].data_ptr()  # a copy, not an alias
    else:
        assert torch.equal(state, torch.zeros(B, H, Dk, Dv, dtype=dtype))
    o, none = delta_rule(**x, backend=backend)
    assert o.shape == (B, 0, H, Dv) and none is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_packed_batch_keeps_every_sequence_state(backend):
    x = make_inputs(1, 0, 2, 4, 3, n_states=3)
    cu = torch.tensor([0, 0, 0, 0])
    o, state = delta_rule(**x, cu_seqlens=cu, output_final_state=True, backend=backend)
    assert o.shape == (1, 0, 2, 3) and torch.equal(state, x["initial_state"])
    x["initial_state"] = None
    _, state = delta_rule(**x, cu_seqlens=cu, output_final_state=True, backend=backend)
    assert torch.equal(state, torch.zeros(3, 2, 4, 3, dtype=torch.float64))


def test_empty_sequence_gradient_reaches_the_initial_state():
    x = make_inputs(1, 0, 2, 4, 3)
    s0 = x["initial_state"].requires_grad_(True)
    weights = torch.randn(s0.shape, dtype=s0.dtype)
    _, state = delta_rule(**x, output_final_state=True)
    (state * weights).sum().backward()
    assert torch.equal(s0.grad, weights)  # the final state is the initial one


def test_empty_sequence_still_checks_arguments():
    x = make_inputs(1, 0, 2, 4, 3)
    with pytest.raises(ValueError, match="beta is None"):
        delta_rule(**{**x, "beta": None}, rule="delta")
    with pytest.raises(ValueError, match="initial_state must have shape"):
        delta_rule(**{**x, "initial_state": torch.randn(1, 2, 4, 4, dtype=torch.float64)})


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_beta_is_reported_by_name(backend, bad):
    x = make_inputs(2, 9, 2, 4, 3)
    x["beta"][1, 4, 0] = bad
    with pytest.raises(ValueError, match=r"beta must be finite, got \d NaN and \d inf values") as e:
        delta_rule(**x, backend=backend)
    assert "[1, 4, 0]" in str(e.value)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_log_decay_is_reported_by_name(backend, bad):
    x = make_inputs(2, 9, 2, 4, 3)
    x["log_decay"][0, 8, 1] = bad
    with pytest.raises(ValueError, match="log_decay must be finite") as e:
        delta_rule(**x, backend=backend)
    assert "[0, 8, 1]" in str(e.value) and "-30" in str(e.value)


def test_finite_but_out_of_range_values_keep_their_messages():
    x = make_inputs(2, 9, 2, 4, 3)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        delta_rule(**{**x, "beta": x["beta"] - 2.0})
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        delta_rule(**{**x, "log_decay": x["log_decay"] + 2.0})


def test_value_checks_are_an_argument_of_the_op():
    x = make_inputs(1, 5, 2, 4, 3)
    x["beta"] = x["beta"] - 2.0  # negative: refused when checked, taken as given when not
    x["log_decay"] = x["log_decay"] + 2.0  # positive: likewise
    with pytest.raises(ValueError, match="beta must be >= 0"):
        delta_rule(**x)
    o, _ = delta_rule(**x, check_values=False)
    assert o.shape == (1, 5, 2, 3)
