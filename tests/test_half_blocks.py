"""Half-precision inputs at narrow heads.

Since session 18 (issue 32), bf16/fp16 inputs whose key or value head is narrower than
``triton_ops.HALF_MIN_HEAD`` (64) columns run the fp32 kernels: on the H100, check_triton's
7 failing cases of 150 (benchmarks/results/issue32/s18call1) were all bf16 at heads of 16
columns, on the half-precision kernels padded to 64-column blocks, at 5.0-6.7e-3 against bf16's
5e-3, where fp32 is at ~3e-7. Their outputs and gradients come back in the inputs' dtypes, so
only that storage's rounding is left. Heads of 64 columns and more keep the half-precision
kernels.

Those kernels keep ``common.HALF_MIN_BLOCK`` (= HALF_MIN_HEAD), the narrowest head block of a
bf16/fp16 launch (issue 31, session 17: on the H100 with Triton 3.6, 16-column blocks gave NaN
from the prepare kernel on and wrong gradients at Dk or Dv = 16, in bf16 and fp16 alike;
64-column blocks were right: benchmarks/probe_fp16.py, results/issue31/s17call3). The op no
longer launches half precision at a narrower head; the tests below that check the floor run
the half-precision kernels at such heads on purpose (the ``narrow_half_kernels`` fixture). The
padding is masked: on the interpreter (where 16-column blocks are right) the results are the
same to the bit either way. Half precision on the interpreter is float16 wherever the
half-precision kernels compute: its bf16 dots are wrong; through the fp32 kernels bf16 is
checked too."""

from __future__ import annotations

import pytest
import torch
from _inputs import rel_err
from _op_runs import RESULTS, op_inputs, record_launches, reference, run_op

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops import triton_ops  # noqa: E402
from deltaflow.ops.triton import (  # noqa: E402
    common,
    dstates,
    gradients,
    gradients_fused,
    gradients_lean,
    outputs,
    prepare,
    rebuild,
    states,
)

HALF = (torch.bfloat16, torch.float16)
# every launch of the op's forward (both forms) and backward, with the block widths it takes
KERNELS = {
    prepare: ["chunk_prepare_kernel"],
    states: ["chunk_forward_kernel", "chunk_states_kernel"],
    dstates: ["chunk_dstates_kernel"],
    outputs: ["chunk_output_kernel"],
    gradients: ["chunk_grads_v_kernel", "chunk_grads_k_kernel"],
    gradients_lean: ["chunk_grads_v_lean_kernel", "chunk_grads_k_lean_kernel"],
    gradients_fused: ["chunk_grads_fused_kernel"],
    rebuild: ["chunk_rebuild_kernel"],  # the backward's W, Ũ from the kept T (the default "t")
}
ALL_KERNELS = {n for names in KERNELS.values() for n in names}


def launched(Dk: int, Dv: int, dtype: torch.dtype) -> set[str]:
    """ALL_KERNELS as one op launches them at these heads (``dtype``: its kernels' dtype): one of
    the gradient kernels (gradients.use_fused: the fused kernel at small half-precision heads;
    gradients.use_lean: the lean pair at wide key blocks; the plain pair), and the rebuild only
    where the recomputed state pass does not form W and Ũ itself (states.rebuilds_w_u)."""
    grads = {gradients, gradients_lean, gradients_fused}
    if gradients.use_fused(Dk, Dv, dtype):
        used = gradients_fused
    else:
        used = gradients_lean if gradients.use_lean(Dk, Dv, dtype) else gradients
    k, v = (torch.empty(1, 1, 1, d, dtype=dtype, device="meta") for d in (Dk, Dv))
    unused = grads - {used} | ({rebuild} if states.rebuilds_w_u(k, v) else set())
    return ALL_KERNELS - {n for module in unused for n in KERNELS[module]}


NARROW_HEADS = [(16, 16), (16, 64), (64, 16), (32, 32)]


def _widths(seen: list) -> set[int]:
    return {kw[b] for _, kw in seen for b in ("BK", "BV", "TILE") if b in kw}


def _kernel_dtypes(seen: list) -> set[torch.dtype]:
    """The operand dtype of every launch: its k (every chunk kernel reads k, in the dot dtype)."""
    return {kw["k_ptr"].dtype for _, kw in seen}


def test_head_block_floor_is_for_half_precision_only():
    assert [common.head_block(n) for n in (1, 16, 17, 64, 100)] == [16, 16, 32, 64, 128]
    for dt in HALF:
        assert [common.head_block(n, dt) for n in (16, 32, 64, 100)] == [64, 64, 64, 128]
    assert common.head_block(16, torch.float32) == common.head_block(16) == 16


def test_dot_dtype_runs_narrow_half_heads_in_fp32():
    # one number for both facts: no half-precision launch of the op meets a head narrower than
    # the half-precision block floor
    assert common.HALF_MIN_BLOCK == triton_ops.HALF_MIN_HEAD == 64
    for dt in HALF:
        for Dk, Dv in [*NARROW_HEADS, (63, 128), (128, 48)]:
            assert triton_ops.dot_dtype(dt, Dk, Dv) == torch.float32, (dt, Dk, Dv)
        for Dk, Dv in [(64, 64), (64, 128), (128, 64), (100, 72), (256, 256)]:
            assert triton_ops.dot_dtype(dt, Dk, Dv) == dt, (dt, Dk, Dv)
    for dt in (torch.float32, torch.float64):
        assert triton_ops.dot_dtype(dt, 16, 16) == triton_ops.dot_dtype(dt, 128, 128)
        assert triton_ops.dot_dtype(dt, 128, 128) == torch.float32
    # what the forward keeps for the backward (the fake implementation's layout) follows it
    for Dk, Dv, kept in [(16, 16, torch.float32), (64, 16, torch.float32), (64, 64, HALF[0])]:
        q = torch.empty(1, 70, 2, Dk, dtype=HALF[0], device="meta")
        v = torch.empty(1, 70, 2, Dv, dtype=HALF[0], device="meta")
        layout = triton_ops.kept_layout("states", q, v, None)
        assert {n: dt for n, (_, dt) in layout.items()} == {
            "w": kept,
            "t": torch.float32,
            "h": kept,
            "v_new": kept,
        }, (Dk, Dv)


# (rule, negative eigenvalues): delta with decay, β and negative eigenvalues; kaczmarz (raw keys
# of varied norm, no β); both with decay and an initial state
RULE_CASES = [("delta", True), ("kaczmarz", False)]
# Each dtype at each narrow head with one rule, the rules alternating (the other dtype takes the
# other rule there): every head meets both rules, every dtype both rules at two heads each. The
# fp32 kernels run the same for either dtype (cast to fp32 first); what depends on the dtype
# (the routing, the results' dtypes, the storage's rounding) is checked at every head.
NARROW_CASES = [
    pytest.param(dt, Dk, Dv, rule, ne, id=f"{name}-{Dk}-{Dv}-{rule}")
    for j, (dt, name) in enumerate(zip(HALF, ["bf16", "fp16"]))
    for i, (Dk, Dv) in enumerate(NARROW_HEADS)
    for rule, ne in [RULE_CASES[(i + j) % 2]]
]


@pytest.mark.parametrize(("dtype", "Dk", "Dv", "rule", "ne"), NARROW_CASES)
def test_narrow_half_heads_run_the_fp32_kernels(monkeypatch, dtype, Dk, Dv, rule, ne):
    seen = record_launches(monkeypatch, KERNELS)
    # the initial state in the half dtype too: its gradient comes back in it
    leaves = op_inputs(dtype, Dk, Dv, rule=rule, state_dtype=dtype)
    got = run_op(leaves, rule=rule, negative_eigenvalues=ne)
    # both forwards and the backward
    assert {name for name, _ in seen} == launched(Dk, Dv, torch.float32)
    assert _kernel_dtypes(seen) == {torch.float32}
    # results in the inputs' dtypes: the outputs in v's, the final state float32, each gradient
    # in its input's
    dtypes = [
        dtype,
        dtype,
        torch.float32,
        *(None if x is None else x.dtype for x in leaves.values()),
    ]
    assert [None if x is None else x.dtype for x in got] == dtypes
    # Errors against float64 (the loss's weights are exact in both): the fp32 results (final
    # state, dβ, d log α) at fp32's (measured 2e-7 to 2e-6; the half-precision kernels give
    # 2-4e-4 in fp16, nonsense from the interpreter's bf16 dots), the half-precision ones at
    # their storage's rounding alone, within the dtype's unit roundoff (round to nearest: half
    # of it; the interpreter's fp32 -> bf16 cast truncates: up to all of it, o at 3.3e-3)
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for name, x, x_ref in zip(RESULTS, got, reference(leaves, rule=rule, negative_eigenvalues=ne)):
        if x is None:
            continue
        err = rel_err(x, x_ref.to(x.device))
        assert torch.isfinite(x).all() and err < (1e-5 if x.dtype == torch.float32 else unit), (
            name,
            err,
        )


@pytest.mark.parametrize(("Dk", "Dv"), [(64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_wide_half_heads_keep_the_half_precision_kernels(monkeypatch, dtype, Dk, Dv):
    # what is launched, not its results (nothing runs: the interpreter's bf16 dots are wrong)
    seen = record_launches(monkeypatch, KERNELS, run=False)
    leaves = op_inputs(dtype, Dk, Dv)
    got = run_op(leaves)
    assert {name for name, _ in seen} == launched(Dk, Dv, dtype)
    assert _kernel_dtypes(seen) == {dtype}  # q, k, v as given: no fp32 copies
    assert {kw["q_ptr"].dtype for _, kw in seen if "q_ptr" in kw} == {dtype}
    assert min(_widths(seen)) == 64
    assert [x.dtype for x in got[:2]] == [dtype, dtype]
    assert [leaves[n].grad.dtype for n in ("q", "k", "v")] == [dtype] * 3


def test_opcheck_narrow_half_heads_keep_fp32():
    # The op's fake implementation against the real one at a narrow bf16 head with the forward
    # keeping its prepare (SAVE_FOR_BACKWARD "prepare"): the kept W and Ũ are fp32 in both
    # (kept_layout, _inputs: both from dot_dtype), and autograd runs the backward on them.
    leaves = op_inputs(torch.bfloat16, 16, 16, T=20)
    args = [*leaves.values(), None, 1, True, 1e-6, 0.25, 64, "prepare"]
    torch.library.opcheck(triton_backend.chunk_fwd_op, args)
    with torch.no_grad():
        o, state, *slots = triton_backend.chunk_fwd_op(*args)
    kept = dict(zip(triton_ops.KEPT, slots))
    layout = triton_ops.kept_layout("prepare", leaves["q"], leaves["v"], None)
    assert {n: (tuple(kept[n].shape), kept[n].dtype) for n in layout} == layout
    assert kept["w"].dtype == kept["u"].dtype == torch.float32
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.parametrize(("Dk", "Dv"), [(16, 16), (16, 48), (64, 16)])
def test_half_precision_kernels_at_narrow_heads_take_64_column_blocks(
    monkeypatch, narrow_half_kernels, Dk, Dv
):
    # The half-precision kernels at the GPU's failing shapes (s17 call 3): 64-column blocks and
    # right, against float64.
    seen = record_launches(monkeypatch, KERNELS)
    leaves = op_inputs(torch.float16, Dk, Dv, state_dtype=torch.float16)
    got = run_op(leaves)
    assert _kernel_dtypes(seen) == {torch.float16} and min(_widths(seen)) == 64
    for name, a, b in zip(RESULTS, got, reference(leaves)):
        err = rel_err(a, b.to(a.device))  # the float64 reference ran on the CPU
        assert torch.isfinite(a).all() and err < 2e-3, (name, err)
    seen.clear()
    run_op(op_inputs(torch.float32, Dk, Dv))  # fp32 keeps its blocks (at Dk < Dv: 64 keys)
    assert min(_widths(seen)) == (16 if Dk == Dv or Dv == 16 else 32)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="16-column half-precision blocks are wrong on the H100"
)
@pytest.mark.parametrize(("Dk", "Dv"), [(16, 16), (16, 48)])
def test_half_min_block_pads_narrow_heads_bit_for_bit(monkeypatch, narrow_half_kernels, Dk, Dv):
    seen = record_launches(monkeypatch, KERNELS)
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 16)
    narrow = run_op(op_inputs(torch.float16, Dk, Dv, state_dtype=torch.float16))
    assert min(_widths(seen)) == 16  # a 16-column head with 16-column blocks
    assert {name for name, _ in seen} == launched(Dk, Dv, torch.float16)
    seen.clear()
    monkeypatch.setattr(common, "HALF_MIN_BLOCK", 64)
    wide = run_op(op_inputs(torch.float16, Dk, Dv, state_dtype=torch.float16))
    assert min(_widths(seen)) == 64
    for a, b in zip(narrow, wide):
        assert a.dtype == b.dtype and torch.equal(a, b)
