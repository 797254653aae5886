"""``common.HALF_MIN_BLOCK``: the narrowest head block of bf16/fp16 launches (issue 31, session
17, h17: float16 NaN on the H100 at D = 16, where half-precision launches get 16-column blocks,
the width Triton 3.6 on Hopper miscompiled before; benchmarks/probe_fp16.py's "wide" variant).
At 64 every half-precision kernel gets blocks of at least 64 columns, fp32 launches are left
alone, and the padding is masked: outputs and gradients are the same to the bit (the
interpreter's float16 stands in for half precision: its bf16 dots are wrong)."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs

from deltaflow import delta_rule

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton import common, gradients, outputs, prepare, states  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
# every launch of the op's forward (both forms) and backward, with the block widths it takes
KERNELS = {
    prepare: ["chunk_prepare_kernel"],
    states: ["chunk_forward_kernel", "chunk_states_kernel", "chunk_dstates_kernel"],
    outputs: ["chunk_output_kernel"],
    gradients: ["chunk_grads_v_kernel", "chunk_grads_k_kernel"],
}


class _Spy:
    """A kernel whose launches are recorded (name, keyword arguments) and then run."""

    def __init__(self, name: str, kernel, seen: list) -> None:
        self.name, self.kernel, self.seen = name, kernel, seen

    def __getitem__(self, grid):
        def launch(**kw):
            self.seen.append((self.name, kw))
            return self.kernel[grid](**kw)

        return launch


def test_head_block_floor_is_for_half_precision_only(monkeypatch):
    assert [common.head_block(n) for n in (1, 16, 17, 64, 100)] == [16, 16, 32, 64, 128]
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 64)
    for dt in (torch.float16, torch.bfloat16):
        assert [common.head_block(n, dt) for n in (16, 32, 64, 100)] == [64, 64, 64, 128]
    assert common.head_block(16, torch.float32) == common.head_block(16) == 16


def _run(dtype: torch.dtype, Dk: int, Dv: int, seen: list) -> list[torch.Tensor]:
    x = make_inputs(1, 70, 2, Dk, Dv, rule="delta", dtype=torch.float32, seed=3)
    leaves = {
        n: t.to(DEVICE, dtype if n in ("q", "k", "v", "initial_state") else torch.float32)
        .detach()
        .requires_grad_()
        for n, t in x.items()
    }
    o, s = delta_rule(**leaves, output_final_state=True, backend="triton")
    (o.float().sin().sum() + s.pow(2).sum()).backward()
    triton_backend.FORWARD_MODE = "two_pass"  # the other forward: state pass + outputs
    try:
        with torch.no_grad():
            o2 = delta_rule(**{n: t.detach() for n, t in leaves.items()}, backend="triton")[0]
    finally:
        triton_backend.FORWARD_MODE = "auto"
    return [o, o2, s, *(leaves[n].grad for n in NAMES)]


def _widths(seen: list) -> set[int]:
    return {kw[b] for _, kw in seen for b in ("BK", "BV", "TILE") if b in kw}


@pytest.mark.parametrize(("Dk", "Dv"), [(16, 16), (16, 48)])
def test_half_min_block_pads_narrow_heads_bit_for_bit(monkeypatch, Dk, Dv):
    seen: list = []
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, _Spy(name, getattr(module, name), seen))
    narrow = _run(torch.float16, Dk, Dv, seen)
    assert min(_widths(seen)) == 16  # the default: a 16-column head gets 16-column blocks
    assert {name for name, _ in seen} == {n for names in KERNELS.values() for n in names}
    seen.clear()
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 64)
    wide = _run(torch.float16, Dk, Dv, seen)
    assert min(_widths(seen)) == 64
    for a, b in zip(narrow, wide):
        assert a.dtype == b.dtype and torch.equal(a, b)
    seen.clear()
    _run(torch.float32, Dk, Dv, seen)  # fp32 launches keep their blocks
    assert min(_widths(seen)) == 16
