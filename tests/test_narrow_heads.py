"""Heads narrower than 64 columns (issue 31, session 17, call 4: check_triton's fp32 case at
Dk=16 Dv=64 died of an illegal memory access on the H100). No kernel reads or writes outside
its tensors at those shapes (the interpreter's accesses, tests/_bounds.py, in fp32 and fp16,
both forwards and the backward): the cause is not an unmasked access but the code Triton 3.6
generates for fp32 key blocks under 64 columns beside a wider value block (mma.sync products
in the state passes; common.FP32_WIDE_VALUE_MIN_KEY_BLOCK). Such heads now take 64-column key
blocks, masked: the same results as the narrow blocks on the interpreter. (Half-precision
inputs at such heads run the fp32 kernels since session 18: tests/test_half_blocks.py; the
fp16 access check here runs the half-precision kernels on purpose.)"""

from __future__ import annotations

import pytest
import torch
from _bounds import checked_accesses
from _inputs import rel_err
from _op_runs import RESULTS, op_inputs, record_launches, reference, run_op

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton import common, dstates, gradients, outputs, states  # noqa: E402

INTERPRETER = not torch.cuda.is_available()
# the launches that take a key block (the prepare kernel takes a column tile instead)
KEYED = {
    states: ["chunk_forward_kernel", "chunk_states_kernel"],
    dstates: ["chunk_dstates_kernel"],
    outputs: ["chunk_output_kernel"],
    gradients: ["chunk_grads_v_kernel", "chunk_grads_k_kernel"],
}


def test_key_block_pads_fp32_keys_only_beside_other_value_blocks(monkeypatch):
    f32, bf = torch.float32, torch.bfloat16
    assert [common.key_block(16, dv, f32) for dv in (16, 17, 32, 64, 128)] == [16, 64, 64, 64, 64]
    # a 32-column key block beside a 16-column value block faulted on the H200 (session 20)
    assert [common.key_block(dk, 16, f32) for dk in (16, 20, 32, 64, 100)] == [16, 64, 64, 64, 128]
    assert common.key_block(32, 32, f32) == 32 and common.key_block(64, 128, f32) == 64
    assert common.key_block(20, 20, f32) == 32  # equal narrow blocks passed: kept
    monkeypatch.setattr(common, "FP32_MIN_KEY_BLOCK_WHEN", "wider_value")  # the session-17 rule
    assert [common.key_block(dk, 16, f32) for dk in (16, 32, 64, 100)] == [16, 32, 64, 128]
    monkeypatch.setattr(common, "FP32_MIN_KEY_BLOCK_WHEN", "narrow")
    assert [common.key_block(dk, dk, f32) for dk in (16, 32, 64, 100)] == [64, 64, 64, 128]
    monkeypatch.setattr(common, "FP32_MIN_KEY_BLOCK_WHEN", "wide")
    with pytest.raises(ValueError, match="FP32_MIN_KEY_BLOCK_WHEN must be one of"):
        common.key_block(16, 16, f32)
    monkeypatch.setattr(common, "FP32_MIN_KEY_BLOCK_WHEN", "unequal")
    assert common.key_block(128, 256, f32) == 128  # wide keys: as before
    # half precision: head_block's 64-column floor already
    assert [common.key_block(dk, dv, bf) for dk, dv in ((16, 16), (16, 64), (64, 16))] == [64] * 3


def _run(dtype: torch.dtype, Dk: int, Dv: int, *, forward: str = "auto") -> list:
    """Output, the other forward's output, final state and every gradient (fwd + bwd)."""
    other = "fused" if forward == "two_pass" else "two_pass"
    return run_op(op_inputs(dtype, Dk, Dv), forward=forward, other_forward=other)


def _key_blocks(seen: list) -> set[int]:
    return {kw["BK"] for _, kw in seen}


def test_fp32_narrow_keys_beside_wider_values_take_64_column_key_blocks(monkeypatch):
    seen = record_launches(monkeypatch, KEYED)
    leaves = op_inputs(torch.float32, 16, 64)
    got = run_op(leaves)
    assert {name for name, _ in seen} == {n for names in KEYED.values() for n in names}
    assert _key_blocks(seen) == {64}
    for name, a, b in zip(RESULTS, got, reference(leaves)):
        err = rel_err(a, b.to(a.device))
        assert torch.isfinite(a).all() and err < 1e-5, (name, err)
    seen.clear()
    _run(torch.float32, 16, 16)  # a head as narrow on both sides keeps its 16-column blocks
    assert _key_blocks(seen) == {16}


@pytest.mark.skipif(not INTERPRETER, reason="the narrow fp32 blocks are what the H100 refused")
def test_fp32_key_padding_changes_no_result(monkeypatch):
    seen = record_launches(monkeypatch, KEYED)
    wide = _run(torch.float32, 16, 64)
    monkeypatch.setattr(common, "FP32_WIDE_VALUE_MIN_KEY_BLOCK", 16)
    narrow = _run(torch.float32, 16, 64)
    assert _key_blocks(seen) == {16, 64}
    for a, b in zip(narrow, wide):  # masked columns: the same sums, up to the dots' order
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-6


@pytest.mark.skipif(not INTERPRETER, reason="the interpreter's accesses are what is checked")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("Dk", "Dv"), [(16, 64), (64, 16), (16, 16)])
@pytest.mark.parametrize("narrow", [False, True])
def test_no_access_outside_the_tensors_at_narrow_heads(
    monkeypatch, narrow_half_kernels, dtype, Dk, Dv, narrow
):
    # fp16 on the half-precision kernels (narrow_half_kernels: the op would run these heads on
    # the fp32 kernels, which the fp32 cases check)
    if narrow:  # the blocks before the padding (fp32: the H100's failing launch)
        monkeypatch.setattr(common, "FP32_WIDE_VALUE_MIN_KEY_BLOCK", 16)
        monkeypatch.setattr(common, "HALF_MIN_BLOCK", 16)
    monkeypatch.setattr(triton_backend, "POISON_OUTPUTS", True)
    seen = record_launches(monkeypatch, KEYED)
    for forward in ("two_pass", "fused"):  # each forward with the gradients, then the other
        with checked_accesses() as report:
            got = _run(dtype, Dk, Dv, forward=forward)
        assert not report.bad, report.bad[:5]
        assert all(torch.isfinite(t).all() for t in got)
    assert {kw["k_ptr"].dtype for _, kw in seen} == {dtype}
    assert _key_blocks(seen) == {common.key_block(Dk, Dv, dtype)}  # under the patched floors


def test_the_access_check_sees_an_access_outside():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_one_too_many(x_ptr, y_ptr, N: tl.constexpr, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N + 1), mask=offs < N)

    if not INTERPRETER:
        pytest.skip("interpreter only")
    buf = torch.zeros(40)
    with checked_accesses() as report:
        copy_one_too_many[(1,)](buf[:16], buf[20:36], N=16, B=32)
    assert [(a.kernel, a.op, a.count, a.nearest, a.offset) for a in report.bad] == [
        ("copy_one_too_many", "load", 1, "x_ptr", 64)
    ]
