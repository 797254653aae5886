"""``common.HALF_MIN_BLOCK``: the narrowest head block of bf16/fp16 launches (issue 31, session
17: on the H100 with Triton 3.6, half-precision launches with 16-column blocks (heads of 16
columns) return NaN from the prepare kernel on, and heads of Dk or Dv = 16 wrong gradients, in
bf16 and fp16 alike; 64-column blocks are right: benchmarks/probe_fp16.py,
results/issue31/s17call3). Every half-precision kernel gets blocks of at least 64 columns, fp32
launches keep theirs, and the padding is masked: on the interpreter (where 16-column blocks are
right) the outputs and gradients are the same to the bit either way (its float16 stands in for
half precision: its bf16 dots are wrong)."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

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


def test_head_block_floor_is_for_half_precision_only():
    assert [common.head_block(n) for n in (1, 16, 17, 64, 100)] == [16, 16, 32, 64, 128]
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


def _spy(monkeypatch, seen: list) -> None:
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, _Spy(name, getattr(module, name), seen))


@pytest.mark.parametrize(("Dk", "Dv"), [(16, 16), (16, 48), (64, 16)])
def test_narrow_half_precision_heads_run_64_column_blocks_and_match_the_reference(
    monkeypatch, Dk, Dv
):
    # The default: the GPU's failing shapes (s17 call 3) right, against float64.
    seen: list = []
    _spy(monkeypatch, seen)
    got = _run(torch.float16, Dk, Dv, seen)
    assert common.HALF_MIN_BLOCK == 64 and min(_widths(seen)) == 64
    x = make_inputs(1, 70, 2, Dk, Dv, rule="delta", dtype=torch.float64, seed=3)
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend="reference")
    (o.sin().sum() + s.pow(2).sum()).backward()
    ref = [o, o, s, *(leaves[n].grad for n in NAMES)]
    for name, a, b in zip(["o", "o two-pass", "state", *NAMES], got, ref):
        b = b.to(a.device)  # the float64 reference ran on the CPU
        assert torch.isfinite(a).all() and rel_err(a, b) < 2e-3, (name, rel_err(a, b))
    seen.clear()
    _run(torch.float32, Dk, Dv, seen)  # fp32 launches keep their blocks (at Dk < Dv: 64 keys)
    assert min(_widths(seen)) == (16 if Dk == Dv or Dv == 16 else 32)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="16-column half-precision blocks are wrong on the H100"
)
@pytest.mark.parametrize(("Dk", "Dv"), [(16, 16), (16, 48)])
def test_half_min_block_pads_narrow_heads_bit_for_bit(monkeypatch, Dk, Dv):
    seen: list = []
    _spy(monkeypatch, seen)
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 16)
    narrow = _run(torch.float16, Dk, Dv, seen)
    assert min(_widths(seen)) == 16  # a 16-column head with 16-column blocks
    assert {name for name, _ in seen} == {n for names in KERNELS.values() for n in names}
    seen.clear()
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 64)
    wide = _run(torch.float16, Dk, Dv, seen)
    assert min(_widths(seen)) == 64
    for a, b in zip(narrow, wide):
        assert a.dtype == b.dtype and torch.equal(a, b)
    seen.clear()
    _run(torch.float32, Dk, Dv, seen)  # fp32 launches keep their blocks (at Dk < Dv: 64 keys)
    assert min(_widths(seen)) == (16 if Dk == Dv else 32)
