"""The lean gradient kernels (``gradients.GRADS_LEAN``, ``deltaflow/ops/triton/gradients_lean.py``)
against the float64 token-by-token reference, forward and backward: on the GPU when there is
one, else on the CPU interpreter (tests/conftest.py). Every Triton rule with and without negative
eigenvalues, T = 1, 65, 130, Dk ≠ Dv both ways, packed sequences of unequal lengths (empty ones
too) with initial states, fp16 operands (also with fp32 states), and the lean launch settings.
Each test also checks that the lean kernels ran, and where the inputs are half precision that
the gradients are the plain kernels' up to fp32 summation order."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule
from deltaflow.rules import RULES, triton_rules

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton import gradients, gradients_lean  # noqa: E402 - after the skip

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["o", "state", "q", "k", "v", "beta", "log_decay", "initial_state"]
# fp32 inputs: tf32x3 products, within ~1e-6 of fp32 (as tests/test_triton_interpret.py)
TOL = 1e-4


@pytest.fixture
def lean(monkeypatch) -> list[torch.dtype]:
    """GRADS_LEAN on for the test (the fused kernel, which comes first, off); the dtypes of the
    lean launches, which the test checks."""
    monkeypatch.setattr(gradients, "GRADS_LEAN", "on")
    monkeypatch.setattr(gradients, "GRADS_FUSED", "off")
    launches: list[torch.dtype] = []
    launch = gradients_lean.launch_lean

    def counted(pointers: dict, *args) -> None:
        launches.append(pointers["q_ptr"].dtype)
        launch(pointers, *args)

    monkeypatch.setattr(gradients_lean, "launch_lean", counted)
    return launches


def _fwd_bwd(inputs: dict, backend: str, **kwargs) -> list:
    """Outputs, final state and all six gradients of a loss weighing every output and the
    final state (None where an input is absent)."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [None if leaves[n] is None else leaves[n].grad for n in NAMES[2:]]


def _check(inputs: dict, launches: list, tol: float = TOL, **kwargs) -> list:
    """The Triton backend (lean kernels) against the reference run in float64 on the same
    values; returns the Triton results."""
    inputs = {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}
    ref = _fwd_bwd({n: None if t is None else t.double() for n, t in inputs.items()},
                   "reference", **kwargs)  # fmt: skip
    got = _fwd_bwd(inputs, "triton", **kwargs)
    assert launches, "the lean kernels did not run"
    for name, g, g_ref in zip(NAMES, got, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            err = rel_err(g, g_ref)
            assert torch.isfinite(g).all() and err <= tol, f"{name}: {err:.2e} > {tol:.0e}"
    return got


def _without_unused_beta(inputs: dict, rule: str) -> dict:
    if not RULES[rule].needs_beta:
        inputs["beta"] = None
    return inputs


# Each rule once, negative eigenvalues on every other one (never trapezoid: μ ∈ (−3, 1]
# diverges by design, the op warns). The rule and the flag are runtime arguments of one compiled
# kernel pair, and the flag's branch is the same for every rule (rules.strengths / derivatives:
# a, b and their derivatives doubled after the rule's entry, gated_efla's decay terms too), so
# each rule's entry runs here, and the flag's branch with four rules (gated_efla among them),
# as in test_lengths, test_key_and_value_heads_differ, test_packed_sequences, test_half_precision.
EVERY_RULE = [(r, i % 2 == 0 and r != "trapezoid") for i, r in enumerate(triton_rules())]


@pytest.mark.parametrize("rule, negative_eigenvalues", EVERY_RULE)
def test_every_rule(lean, rule, negative_eigenvalues):
    # T = 65: a full chunk and a one-token one; Dk != Dv; β absent where the rule needs none
    inputs = make_inputs(1, 65, 2, 16, 32, rule=rule, dtype=torch.float32, seed=21)
    _check(_without_unused_beta(inputs, rule), lean, rule=rule,
           negative_eigenvalues=negative_eigenvalues)  # fmt: skip


@pytest.mark.parametrize(
    "T, rule, decay, state",
    [(1, "longhorn", False, False), (1, "gated_efla", True, True), (130, "delta", True, True),
     (130, "kaczmarz", False, False)],
)  # fmt: skip
def test_lengths(lean, T, rule, decay, state):
    # T = 1 (B = 2: one ragged chunk each); T = 130: two full chunks and a two-token one
    inputs = make_inputs(2 if T == 1 else 1, T, 2, 16, 16, rule=rule, dtype=torch.float32,
                         decay=decay, initial_state=state, seed=22)  # fmt: skip
    _check(_without_unused_beta(inputs, rule), lean, rule=rule, negative_eigenvalues=T > 1)


@pytest.mark.parametrize("Dk, Dv", [(32, 64), (64, 32), (24, 40)])
def test_key_and_value_heads_differ(lean, Dk, Dv):
    # wider values than keys, wider keys than values, and heads that no block fits (masked)
    inputs = make_inputs(1, 70, 1, Dk, Dv, rule="efla", dtype=torch.float32, seed=23)
    _check(inputs, lean, rule="efla", negative_eigenvalues=Dk > Dv)


@pytest.mark.parametrize("rule, negative_eigenvalues", [("efla", False), ("delta", True)])
def test_packed_sequences(lean, rule, negative_eigenvalues):
    # unequal lengths, empty sequences, a one-token one, chunks ending mid-sequence; a row of
    # the scratch past a sequence's end must never reach the next one
    lengths = [5, 64, 0, 70, 1, 33]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(DEVICE)
    inputs = make_inputs(1, sum(lengths), 2, 16, 24, rule=rule, dtype=torch.float32,
                         n_states=len(lengths), seed=24)  # fmt: skip
    _check(inputs, lean, rule=rule, cu_seqlens=cu, negative_eigenvalues=negative_eigenvalues)


def _half(rule: str, T: int, Dk: int, Dv: int, seed: int) -> dict:
    """q, k, v in half precision: bf16 on a GPU, fp16 on the interpreter (whose bf16 tl.dot is
    wrong: numpy has no bf16). Their key side rounds dU S_0ᵀ as a hi + lo pair (fp32: none)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    inputs = make_inputs(1, T, 2, Dk, Dv, rule=rule, dtype=torch.float32, seed=seed)
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    return inputs


@pytest.mark.parametrize("fp32_states", [False, True])
@pytest.mark.usefixtures("narrow_half_kernels")  # 32/48-column heads on the half kernels
def test_half_precision(lean, monkeypatch, fp32_states):
    monkeypatch.setattr(triton_backend, "BACKWARD_STATES_FP32", fp32_states)
    inputs = _half("gated_efla", 70, 32, 48, seed=25)
    got = _check(inputs, lean, tol=1e-2, rule="gated_efla", negative_eigenvalues=True)
    assert lean == [inputs["q"].dtype]
    # the plain kernels on the same inputs: the same roundings, fp32 sums in another order
    monkeypatch.setattr(gradients, "GRADS_LEAN", "off")
    plain = _fwd_bwd({n: None if t is None else t.to(DEVICE) for n, t in inputs.items()},
                     "triton", rule="gated_efla", negative_eigenvalues=True)  # fmt: skip
    for name, g, g_plain in zip(NAMES, got, plain):
        assert rel_err(g, g_plain) <= 1e-4, name


@pytest.mark.parametrize(
    "settings",
    [
        {"GRADS_LEAN_V_MAXNREG": 0},
        {"GRADS_LEAN_STAGES": 2},
        {"GRADS_LEAN_DQ_FIRST_MIN_BK": 1, "GRADS_LEAN_K_WARPS": 4},
    ],
)
def test_launch_settings(lean, monkeypatch, settings):
    # the settings --variant may set (register cap, pipeline stages) change no result
    for name, value in settings.items():
        monkeypatch.setattr(gradients, name, value)
    inputs = make_inputs(1, 65, 2, 16, 16, rule="relaxed_kaczmarz", dtype=torch.float32, seed=26)
    _check(inputs, lean, rule="relaxed_kaczmarz")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dq_first_is_the_same_arithmetic(lean, monkeypatch, dtype):
    # dq in a loop of its own (GRADS_LEAN_DQ_FIRST_MIN_BK, the wide heads' key side) sums the
    # same products in the same order: every result bitwise the one-loop kernel's
    inputs = make_inputs(1, 130, 2, 32, 48, rule="gated_efla", dtype=torch.float32, seed=28)
    inputs = {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    runs = []
    for min_bk in (0, 1):
        monkeypatch.setattr(gradients, "GRADS_LEAN_DQ_FIRST_MIN_BK", min_bk)
        runs.append(_fwd_bwd(inputs, "triton", rule="gated_efla"))
    assert len(lean) == 2
    for name, one, two in zip(NAMES, *runs):
        assert (one is None) == (two is None), name
        if one is not None:
            assert torch.equal(one, two), name


def test_scratch_of_the_other_kernels_is_refused(monkeypatch):
    # a row scratch sized for the plain kernels must not reach the lean ones (their rows differ)
    from deltaflow.ops.triton.common import chunk_tables

    monkeypatch.setattr(gradients, "GRADS_LEAN", "on")
    q = torch.zeros(1, 64, 1, 16)
    t = torch.zeros(1, 1, 64, 64)
    kw = {n: q for n in ("dq", "dk", "dv", "v_new", "du", "grad_o")}
    with pytest.raises(ValueError, match="scratch_r has 3 rows"):
        gradients.launch_gradients(
            q, q, q, beta=None, log_decay=None, t=t, h=t, dh=t,
            tables=chunk_tables(None, 1, 64, q.device), kernel_id=1,
            negative_eigenvalues=False, eps=1e-6, scale=1.0, scratch_m=t.repeat(1, 1, 2, 1),
            scratch_r=torch.zeros(1, 1, 3, 64), dbeta=None, dlog_decay=None, **kw,
        )  # fmt: skip


def _launch(lean: bool, inputs: dict, H: int, n: int) -> dict:
    """launch_gradients on ``inputs`` (one chunk-aligned sequence), lean or plain: the gradients
    it writes."""
    from deltaflow.ops.triton.common import chunk_tables

    gradients.GRADS_LEAN = "on" if lean else "off"
    q = inputs["q"]
    rows = gradients.scratch_rows(q.shape[3], inputs["v"].shape[3], q.dtype)
    B, T = q.shape[:2]
    out = {n_: torch.full_like(inputs[like], float("nan"), dtype=dt)
           for n_, like, dt in [("dq", "q", q.dtype), ("dk", "k", q.dtype), ("dv", "v", q.dtype),
                                ("dbeta", "beta", torch.float32),
                                ("dlog_decay", "log_decay", torch.float32)]}  # fmt: skip
    gradients.launch_gradients(
        q, inputs["k"], inputs["v"], beta=inputs["beta"], log_decay=inputs["log_decay"],
        t=inputs["t"], h=inputs["h"], v_new=inputs["v_new"], dh=inputs["dh"], du=inputs["du"],
        grad_o=inputs["do"], tables=chunk_tables(None, B, T, q.device), kernel_id=2,
        negative_eigenvalues=False, eps=1e-6, scale=0.25,
        scratch_m=torch.empty(n, H, 2, 64, 64, dtype=q.dtype, device=q.device),
        scratch_r=torch.empty(n, H, rows, 64, device=q.device), **out,
    )  # fmt: skip
    return out


def test_half_precision_key_side_against_the_plain_kernels(monkeypatch):
    # dk = aΓ dX + the rule's term alone (dO, U, G zero): dX = −Tᵀ (dU S_0ᵀ) with dU S_0ᵀ as a
    # hi + lo pair in both kernel pairs, so they agree to fp32 summation order; the lo half is
    # ~2⁻¹¹ of dX in fp16, under the reference tests' tolerances, not under this one.
    monkeypatch.setattr(gradients, "GRADS_LEAN", "off")  # restored after the test
    g = torch.Generator().manual_seed(27)
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    B, T, H, Dk, Dv = 1, 128, 2, 32, 48
    n = B * T // 64

    def randn(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    inputs = {"q": randn(B, T, H, Dk), "k": randn(B, T, H, Dk) * 0.3, "v": randn(B, T, H, Dv),
              "beta": randn(B, T, H, dtype=torch.float32).sigmoid(),
              "log_decay": -randn(B, T, H, dtype=torch.float32).abs() * 0.1,
              "t": randn(n, H, 64, 64, dtype=torch.float32).tril() * 0.2, "h": randn(n, H, Dk, Dv),
              "du": randn(B, T, H, Dv)}  # fmt: skip
    inputs["t"] += torch.eye(64, device=DEVICE)
    zeros = torch.zeros_like(inputs["du"])
    inputs.update(v_new=zeros, do=zeros, dh=torch.zeros_like(inputs["h"]))
    plain = _launch(False, inputs, H, n)
    lean = _launch(True, inputs, H, n)
    assert inputs["h"].abs().sum() > 0 and plain["dk"].abs().sum() > 0
    for name in ("dq", "dk", "dv", "dbeta", "dlog_decay"):
        assert torch.isfinite(lean[name]).all(), name
        assert rel_err(lean[name], plain[name]) <= 2e-5, name
