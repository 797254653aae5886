"""The fused gradient kernel (``gradients.GRADS_FUSED``, ``ops/triton/gradients_fused.py``)
against the float64 token-by-token reference, forward and backward, with the helpers of
tests/test_grads_variants.py: every Triton rule (negative eigenvalues on every other one),
decay and β absent, T = 1 and odd T, packed sequences with initial states, fp16 through "auto"
(bf16 on a GPU; the interpreter's bf16 dots are wrong) with fp32 states, and fp16 against the
plain pair. Each test checks that the fused kernel ran; the switch's routes are checked on the
launches alone (nothing run)."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err
from _op_runs import op_inputs, record_launches, run_op
from test_grads_variants import (
    DEVICE,
    EVERY_RULE,
    _check,
    _half,
    _launch,
    _without_unused_beta,
)
from test_half_blocks import KERNELS

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton import gradients, gradients_fused, gradients_lean  # noqa: E402

GRADIENT_KERNELS = {
    gradients: ["chunk_grads_v_kernel", "chunk_grads_k_kernel"],
    gradients_lean: ["chunk_grads_v_lean_kernel", "chunk_grads_k_lean_kernel"],
    gradients_fused: ["chunk_grads_fused_kernel"],
}


@pytest.fixture
def fused(monkeypatch) -> list[torch.dtype]:
    """GRADS_FUSED on for the test; the dtypes of the fused launches, which the test checks."""
    monkeypatch.setattr(gradients, "GRADS_FUSED", "on")
    launches: list[torch.dtype] = []
    launch = gradients_fused.launch_fused

    def counted(pointers: dict, *args) -> None:
        launches.append(pointers["q_ptr"].dtype)
        launch(pointers, *args)

    monkeypatch.setattr(gradients_fused, "launch_fused", counted)
    return launches


@pytest.mark.parametrize("rule, negative_eigenvalues", EVERY_RULE)
def test_every_rule(fused, rule, negative_eigenvalues):
    # fp32 ("on"), T = 65: a full chunk and a one-token one; Dk != Dv; β absent where unused.
    # Negative eigenvalues on every other rule, as test_grads_variants chose them
    inputs = make_inputs(1, 65, 2, 16, 32, rule=rule, dtype=torch.float32, seed=31)
    _check(_without_unused_beta(inputs, rule), fused, rule=rule,
           negative_eigenvalues=negative_eigenvalues)  # fmt: skip


@pytest.mark.parametrize(
    "T, rule, decay, state",
    [(1, "longhorn", False, False), (1, "gated_efla", True, True), (67, "delta", False, True),
     (130, "kaczmarz", True, False)],
)  # fmt: skip
def test_lengths_and_gates(fused, T, rule, decay, state):
    # T = 1 (B = 2: one ragged chunk each), odd T; delta without decay, kaczmarz without β
    inputs = make_inputs(2 if T == 1 else 1, T, 2, 16, 24, rule=rule, dtype=torch.float32,
                         decay=decay, initial_state=state, seed=32)  # fmt: skip
    _check(_without_unused_beta(inputs, rule), fused, rule=rule, negative_eigenvalues=T > 1)


def test_packed_sequences(fused):
    # unequal lengths, an empty and a one-token sequence, chunks ending mid-sequence
    lengths = [5, 64, 0, 70, 1, 33]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(DEVICE)
    inputs = make_inputs(1, sum(lengths), 2, 16, 24, rule="delta", dtype=torch.float32,
                         n_states=len(lengths), seed=33)  # fmt: skip
    _check(inputs, fused, rule="delta", cu_seqlens=cu, negative_eigenvalues=True)


@pytest.mark.usefixtures("narrow_half_kernels")  # 32/48-column heads on the half kernels
def test_half_precision_auto(monkeypatch, fused):
    # "auto" takes half-precision heads of one 64-column block each; fp32 states (h, dh) too
    monkeypatch.setattr(gradients, "GRADS_FUSED", "auto")
    monkeypatch.setattr(triton_backend, "BACKWARD_STATES_FP32", True)
    inputs = _half("gated_efla", 70, 32, 48, seed=34)
    _check(inputs, fused, tol=1e-2, rule="gated_efla", negative_eigenvalues=True)
    assert fused == [inputs["q"].dtype]


def test_half_precision_against_the_plain_kernels(monkeypatch):
    # launch_gradients on fp16 inputs with dX dominating dk (test_grads_variants' case): the
    # fused kernel (GRADS_FUSED "on" comes before the lean switch) against the plain pair
    g = torch.Generator().manual_seed(35)
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    B, T, H, Dk, Dv = 1, 128, 2, 64, 64
    n = B * T // 64

    def randn(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    inputs = {"q": randn(B, T, H, Dk), "k": randn(B, T, H, Dk) * 0.3, "v": randn(B, T, H, Dv),
              "beta": randn(B, T, H, dtype=torch.float32).sigmoid(),
              "log_decay": -randn(B, T, H, dtype=torch.float32).abs() * 0.1,
              "t": randn(n, H, 64, 64, dtype=torch.float32).tril() * 0.2, "h": randn(n, H, Dk, Dv),
              "du": randn(B, T, H, Dv), "v_new": randn(B, T, H, Dv), "do": randn(B, T, H, Dv),
              "dh": randn(n, H, Dk, Dv)}  # fmt: skip
    inputs["t"] += torch.eye(64, device=DEVICE)
    monkeypatch.setattr(gradients, "GRADS_LEAN", "off")  # _launch sets it; restored after
    monkeypatch.setattr(gradients, "GRADS_FUSED", "off")
    plain = _launch(False, inputs, H, n)
    seen = record_launches(monkeypatch, GRADIENT_KERNELS)
    monkeypatch.setattr(gradients, "GRADS_FUSED", "on")
    got = _launch(False, inputs, H, n)
    assert [name for name, _ in seen] == ["chunk_grads_fused_kernel"]
    for name in ("dq", "dk", "dv", "dbeta", "dlog_decay"):
        assert torch.isfinite(got[name]).all(), name
        assert rel_err(got[name], plain[name]) <= 1e-5, name


@pytest.mark.parametrize(
    "mode, Dk, Dv, dtype, want",
    [("auto", 64, 64, torch.float16, "fused"), ("auto", 64, 64, torch.bfloat16, "fused"),
     ("auto", 64, 128, torch.bfloat16, "plain"), ("auto", 128, 128, torch.bfloat16, "lean"),
     ("auto", 64, 64, torch.float32, "plain"), ("off", 64, 64, torch.bfloat16, "plain"),
     ("on", 128, 64, torch.bfloat16, "fused"), ("on", 16, 16, torch.float32, "fused")],
)  # fmt: skip
def test_switch_routes_the_launch(monkeypatch, mode, Dk, Dv, dtype, want):
    # what the op's backward launches (no kernel runs), and the scratch it sizes for it
    monkeypatch.setattr(gradients, "GRADS_FUSED", mode)
    seen = record_launches(monkeypatch, {**KERNELS, **GRADIENT_KERNELS}, run=False)
    run_op(op_inputs(dtype, Dk, Dv))
    seen = [(name, kw) for name, kw in seen if name.startswith("chunk_grads")]
    kernels = {"fused": GRADIENT_KERNELS[gradients_fused], "plain": GRADIENT_KERNELS[gradients],
               "lean": GRADIENT_KERNELS[gradients_lean]}[want]  # fmt: skip
    assert [name for name, _ in seen] == kernels
    scratch = (gradients.scratch_matrices(Dk, Dv, dtype), gradients.scratch_rows(Dk, Dv, dtype))
    assert (scratch == (0, 0)) == (want == "fused")


def test_launch_settings(fused, monkeypatch):
    # the settings --variant may set (warps, stages, register cap) change no result
    for name, value in {"GRADS_FUSED_WARPS": 4, "GRADS_FUSED_STAGES": 1,
                        "GRADS_FUSED_MAXNREG": 168}.items():  # fmt: skip
        monkeypatch.setattr(gradients, name, value)
    inputs = make_inputs(1, 65, 2, 16, 16, rule="relaxed_kaczmarz", dtype=torch.float32, seed=36)
    _check(inputs, fused, rule="relaxed_kaczmarz")


def test_bad_switch_is_refused(monkeypatch):
    monkeypatch.setattr(gradients, "GRADS_FUSED", "yes")
    with pytest.raises(ValueError, match="GRADS_FUSED must be"):
        gradients.use_fused(64, 64, torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dots: GPU only (the interpreter's are wrong)")
@pytest.mark.parametrize("rule", ["delta", "gated_efla"])
def test_bf16_against_the_plain_kernels_on_the_gpu(monkeypatch, rule):
    # the shape "auto" is for (64-column heads), bf16, the op end to end: the same roundings as
    # the pair (M_P, M_A in bf16 as its scratch), fp32 sums in another order
    monkeypatch.setattr(gradients, "GRADS_FUSED", "off")
    plain = run_op(op_inputs(torch.bfloat16, 64, 64, rule=rule, T=200), rule=rule,
                   negative_eigenvalues=True)  # fmt: skip
    seen = record_launches(monkeypatch, GRADIENT_KERNELS)
    monkeypatch.setattr(gradients, "GRADS_FUSED", "auto")
    got = run_op(op_inputs(torch.bfloat16, 64, 64, rule=rule, T=200), rule=rule,
                 negative_eigenvalues=True)  # fmt: skip
    assert {name for name, _ in seen} == {"chunk_grads_fused_kernel"}
    for x, y in zip(got, plain):
        if x is not None:
            assert torch.isfinite(x).all() and rel_err(x, y) <= 2e-3
