"""Every Triton launch of the op stays inside the tensors it is given (tests/_bounds.py), on the
CPU interpreter, at heads that are not multiples of 16 (padded blocks: the masks carry it), over
the forward's two forms, the kept-for-backward modes and the segmented state passes. Session 19
saw an illegal memory access on the GPU at fp32 Dk = 20, Dv = 12 that the interpreter did not
show: this test is the interpreter's half of that hunt, and guards every later kernel change."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _bounds import available, checked
from _inputs import make_inputs

from deltaflow import delta_rule
from deltaflow.rules import RULES

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.interpreting():
    pytest.skip("the bounds check patches the CPU interpreter", allow_module_level=True)
if not available():
    pytest.skip("this Triton's interpreter lacks the internals _bounds patches",
                allow_module_level=True)  # fmt: skip


@triton.jit
def _copy_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def test_the_check_sees_an_out_of_bounds_load():
    with checked() as hits:
        _copy_kernel[(1,)](torch.zeros(8), torch.zeros(16), N=16)  # reads 8 past x
    assert hits == [("_copy_kernel", "load", 8)]


CASES = {  # (forward form, SAVE_FOR_BACKWARD, segmented state passes)
    "fused-none": ("fused", "none", "off"),
    "two_pass-t": ("two_pass", "t", "off"),
    "fused-states": ("fused", "states", "off"),
    "segments-prepare": ("auto", "prepare", "on"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_odd_narrow_heads_stay_in_bounds(case, monkeypatch):
    mode, save, segments = CASES[case]
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", save)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", segments)
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    rule = "kaczmarz"  # no β; test_save_t's case that faulted on the GPU
    x = make_inputs(1, 130 if segments == "on" else 65, 2, 20, 12, rule=rule, seed=3)
    x["beta"] = None if not RULES[rule].needs_beta else x["beta"]
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in x.items()}
    with checked() as hits:
        o, s = delta_rule(**leaves, rule=rule, output_final_state=True, backend="triton")
        (o.sum() + s.sum()).backward()
    assert hits == []
    assert all(t.grad is not None for t in leaves.values() if t is not None)
