"""Every Triton launch of the op stays inside the tensors it is given (tests/_bounds.py's
checked_accesses), on the CPU interpreter, at heads that are not multiples of 16 (padded blocks:
the masks carry it), over the forward's two forms, the kept-for-backward modes and the segmented
state passes. Session 19 saw an illegal memory access on the H200 at fp32 Dk = 20, Dv = 12
(test_save_t's kaczmarz case) that the interpreter does not show: this is the interpreter's half
of that hunt (test_narrow_heads.py has the check's own test), and guards later kernel changes."""

from __future__ import annotations

import pytest
from _bounds import checked_accesses
from _inputs import make_inputs

from deltaflow import delta_rule

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.interpreting():
    pytest.skip("the access check patches the CPU interpreter", allow_module_level=True)

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
    x = make_inputs(1, 130 if segments == "on" else 65, 2, 20, 12, rule="kaczmarz", seed=3)
    x["beta"] = None  # kaczmarz takes no β
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in x.items()}
    with checked_accesses() as report:
        o, s = delta_rule(**leaves, rule="kaczmarz", output_final_state=True, backend="triton")
        (o.sum() + s.sum()).backward()
    assert not report.bad, report.bad[:5]
    assert all(t.grad is not None for t in leaves.values() if t is not None)
