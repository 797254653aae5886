"""The Triton kernels against the reference: on the GPU when there is one, else on the CPU
interpreter (TRITON_INTERPRET=1, set in conftest.py). Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule, delta_rule_step
from deltaflow.rules import RULES, triton_rules

# The rules with a Triton form; the others (gated_efla) run on the torch backend only.
TRITON_RULES = triton_rules()

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]


def on_device(inputs: dict) -> dict:
    return {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}


@pytest.mark.parametrize("rule", TRITON_RULES)
def test_forward_every_rule(rule):
    # T = 130: three chunks of 64 with a ragged tail; all 16-row blocks of the prepare kernel.
    inputs = on_device(make_inputs(1, 130, 2, 16, 24, rule=rule, dtype=torch.float32, seed=1))
    for ne in (False, True):
        o_ref, s_ref = delta_rule(
            **inputs,
            rule=rule,
            negative_eigenvalues=ne,
            output_final_state=True,
            backend="reference",
        )
        o, s = delta_rule(
            **inputs, rule=rule, negative_eigenvalues=ne, output_final_state=True, backend="triton"
        )
        assert rel_err(o, o_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


@pytest.mark.parametrize("T", [1, 63, 65])
def test_lengths_without_decay_or_state(T):
    inputs = on_device(
        make_inputs(
            2,
            T,
            1,
            16,
            16,
            rule="longhorn",
            dtype=torch.float32,
            decay=False,
            initial_state=False,
            seed=T,
        )
    )
    o_ref, s_ref = delta_rule(
        **inputs, rule="longhorn", output_final_state=True, backend="reference"
    )
    o, s = delta_rule(**inputs, rule="longhorn", output_final_state=True, backend="triton")
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


def test_beta_none_and_odd_head_dims():
    inputs = on_device(make_inputs(1, 70, 2, 20, 12, rule="kaczmarz", dtype=torch.float32))
    inputs["beta"] = None
    o_ref, s_ref = delta_rule(
        **inputs, rule="kaczmarz", output_final_state=True, backend="reference"
    )
    o, s = delta_rule(**inputs, rule="kaczmarz", output_final_state=True, backend="triton")
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


def test_varlen_with_initial_states():
    lengths = [0, 5, 64, 0, 70, 1]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    inputs = on_device(
        make_inputs(
            1,
            sum(lengths),
            2,
            16,
            16,
            rule="efla",
            dtype=torch.float32,
            n_states=len(lengths),
            seed=4,
        )
    )
    o_ref, s_ref = delta_rule(
        **inputs, rule="efla", cu_seqlens=cu, output_final_state=True, backend="reference"
    )
    o, s = delta_rule(
        **inputs, rule="efla", cu_seqlens=cu, output_final_state=True, backend="triton"
    )
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


def _half_inputs(T: int, Dk: int, Dv: int, rule: str, seed: int) -> tuple[torch.dtype, dict]:
    """Inputs with q, k, v in half precision: bf16 on a GPU, fp16 in the CPU interpreter (whose
    bf16 tl.dot is wrong: numpy has no bf16; benchmarks/check_triton.py checks bf16 on the GPU)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    inputs = make_inputs(1, T, 2, Dk, Dv, rule=rule, dtype=torch.float32, seed=seed)
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    return dtype, on_device(inputs)


def test_half_precision_inputs():
    dtype, inputs = _half_inputs(80, 32, 32, "delta", seed=6)
    o_ref, _ = delta_rule(**{n: t.double() for n, t in inputs.items()}, backend="reference")
    o, _ = delta_rule(**inputs, backend="triton")
    assert o.dtype == dtype and rel_err(o, o_ref) <= 1e-2


def _fwd_bwd(inputs: dict, backend: str, **kwargs) -> list:
    """Outputs and all six gradients of a loss that weighs every output and the final state."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def assert_fused_backward_matches(inputs: dict, tol: float = 1e-4, **kwargs) -> None:
    ref = _fwd_bwd(inputs, "reference", **kwargs)
    got = _fwd_bwd(inputs, "triton", **kwargs)
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= tol, name


@pytest.mark.parametrize("negative_eigenvalues", [False, True])
@pytest.mark.parametrize("rule", TRITON_RULES)
def test_fused_backward_every_rule(rule, negative_eigenvalues):
    # T = 70: a full chunk and a ragged one; Dk != Dv; β absent for the rules that need none.
    if rule == "trapezoid" and negative_eigenvalues:
        pytest.skip("μ ∈ (−3, 1]: diverges by design (the op warns)")
    inputs = on_device(make_inputs(1, 70, 2, 16, 24, rule=rule, dtype=torch.float32, seed=8))
    if not RULES[rule].needs_beta:
        inputs["beta"] = None
    assert_fused_backward_matches(inputs, rule=rule, negative_eigenvalues=negative_eigenvalues)


def test_fused_backward_varlen_empty_sequences_and_t1():
    lengths = [0, 5, 64, 0, 70, 1]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    inputs = on_device(
        make_inputs(
            1, sum(lengths), 2, 16, 16, rule="efla", dtype=torch.float32, n_states=6, seed=5
        )
    )
    assert_fused_backward_matches(inputs, rule="efla", cu_seqlens=cu)
    inputs = on_device(
        make_inputs(
            2, 1, 1, 16, 16, rule="longhorn", dtype=torch.float32, decay=False, initial_state=False
        )
    )
    assert_fused_backward_matches(inputs, rule="longhorn")


def test_two_pass_forward(monkeypatch):
    # The forward for few sequences × heads: state pass with narrow value blocks, then outputs.
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", "two_pass")
    inputs = on_device(make_inputs(2, 65, 2, 16, 20, rule="delta", dtype=torch.float32, seed=4))
    assert_fused_backward_matches(inputs, rule="delta", negative_eigenvalues=True)


@pytest.mark.parametrize("rule", ["efla", "linear"])
def test_decode_kernel(rule):
    inputs = on_device(make_inputs(3, 4, 2, 16, 24, rule=rule, dtype=torch.float32, seed=2))
    o_ref, s_ref = delta_rule(**inputs, rule=rule, output_final_state=True, backend="reference")
    state = inputs["initial_state"].clone()
    pieces = {n: inputs[n] for n in ("q", "k", "v", "beta", "log_decay")}
    outs = [
        triton_backend.delta_rule_step(
            *(pieces[n][:, t : t + 2] for n in ("q", "k", "v", "beta")),
            state,
            rule=rule,
            log_decay=pieces["log_decay"][:, t : t + 2],
            negative_eigenvalues=False,
            eps=1e-6,
            scale=16**-0.5,
        )
        for t in (0, 2)
    ]
    assert rel_err(torch.cat(outs, 1), o_ref) <= 1e-4 and rel_err(state, s_ref) <= 1e-4
    if DEVICE == "cuda":  # the public entry dispatches to the kernel on CUDA
        state2 = inputs["initial_state"].clone()
        delta_rule_step(
            *(pieces[n] for n in ("q", "k", "v", "beta")),
            state2,
            rule=rule,
            log_decay=pieces["log_decay"],
        )
        assert rel_err(state2, s_ref) <= 1e-4


def test_custom_op_registration():
    # The fake (meta) implementations must agree with the real ones on shapes and strides.
    inputs = on_device(make_inputs(1, 20, 2, 16, 16, rule="delta", dtype=torch.float32))
    args = [inputs[n] for n in NAMES] + [None, 1, False, 1e-6, 0.25, 64]
    torch.library.opcheck(
        triton_backend.chunk_fwd_op, args, test_utils=("test_schema", "test_faketensor")
    )


def test_chunk_size_is_refused_not_ignored():
    # The kernels compute in chunks of 64 tokens: another chunk_size is an error, never ignored.
    inputs = on_device(make_inputs(1, 20, 2, 16, 16, rule="delta", dtype=torch.float32))
    with pytest.raises(ValueError, match="chunks of 64 tokens, got chunk_size=32"):
        delta_rule(**inputs, backend="triton", chunk_size=32)
    o, _ = delta_rule(**inputs, backend="triton", chunk_size=64)
    o_ref, _ = delta_rule(**inputs, backend="reference")
    assert rel_err(o, o_ref) <= 1e-4
    args = [inputs[n] for n in NAMES] + [None, 1, False, 1e-6, 0.25, 16]
    with pytest.raises(ValueError, match="chunk_size=16"):
        triton_backend.chunk_fwd_op(*args)


def test_half_precision_backward_with_fp32_states():
    # triton_backend.BACKWARD_STATES_FP32 gives the key-side gradient kernel narrower value
    # blocks (gradients.GRADS_BV_FP32; Dv = 48 spans two of them): same gradients either way.
    _, inputs = _half_inputs(70, 16, 48, "longhorn", seed=9)
    ref = _fwd_bwd({n: t.double() for n, t in inputs.items()}, "reference", rule="longhorn")
    for fp32_states in (False, True):
        triton_backend.BACKWARD_STATES_FP32 = fp32_states
        try:
            got = _fwd_bwd(inputs, "triton", rule="longhorn")
        finally:
            triton_backend.BACKWARD_STATES_FP32 = False
        for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
            assert rel_err(g, g_ref) <= 1e-2, (fp32_states, name)


@pytest.mark.parametrize(
    "module, flag, value",
    [
        ("prepare", "PREPARE_FOLD_STRENGTHS", False),  # on by default: the unfolded form
        ("prepare", "BACKWARD_FOLD_STRENGTHS", True),  # off by default: the folded form
        ("prepare", "BACKWARD_T_PRECISION", None),  # tf32x3 by default: the forward's
    ],
)
def test_half_precision_backward_with_t_flags(monkeypatch, module, flag, value):
    # issue 30 item 4's switches (benchmarks/bf16_floor.py FLAGS): the forward's strengths not
    # folded into T (aΓK and bV rounded for W and Ũ); the backward's prepare with the strengths
    # folded, or with T's products at the inputs' precision: the same gradients. Dv = 80 spans
    # two value blocks of the gradient kernels.
    import importlib

    monkeypatch.setattr(importlib.import_module(f"deltaflow.ops.triton.{module}"), flag, value)
    _, inputs = _half_inputs(70, 16, 80, "longhorn", seed=9)
    ref = _fwd_bwd({n: t.double() for n, t in inputs.items()}, "reference", rule="longhorn")
    got = _fwd_bwd(inputs, "triton", rule="longhorn")
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert rel_err(g, g_ref) <= 1e-2, name
