"""``triton_backend.SAVE_FOR_BACKWARD = "t"`` (issue 32, session 19): the forward keeps T and
first_bad alone, and the backward rebuilds W = T X and Ũ = T Y from T (``rebuild.launch_rebuild``:
the prepare's lines without the solve) instead of solving (3) again. Against the float64
token-by-token reference, and against "none" (the same lines and roundings on the same T: the
gradients are equal), on the GPU or the CPU interpreter. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule
from deltaflow.rules import RULES, triton_rules

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops import triton_ops  # noqa: E402
from deltaflow.ops.triton import states  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
STAGES = ("prepare", "rebuild", "states", "forward", "outputs", "dstates", "gradients")
# The stage launches of the forward and of the backward (the forward pinned to its fused form,
# the interpreter's; a GPU's "auto" takes the two-pass form at these few programs). "t" at key
# blocks of at most states.STATES_REBUILD_MAX_BK (every case here): the recomputed state pass
# forms W and Ũ, no rebuild (tests/test_rebuild_in_state_pass.py).
LAUNCHES = {
    "none": (["prepare", "forward"], ["prepare", "states", "dstates", "gradients"]),
    "t": (["prepare", "forward"], ["rebuild", "states", "dstates", "gradients"]),
    "t folded": (["prepare", "forward"], ["states", "dstates", "gradients"]),
}
LENGTHS = [0, 5, 66, 0, 1]  # efla-varlen's packed sequences (empty ones too, a ragged chunk)
# (make_inputs arguments, delta_rule options): every Triton rule; negative eigenvalues, decay
# and β on and off, ragged chunks, T = 1, Dk != Dv, packed sequences, initial states or none.
CASES = {
    "delta-T70-neg": (dict(B=1, T=70, Dk=16, Dv=24, rule="delta", seed=8), {"ne": True}),
    "longhorn-T1-nodecay-nostate": (
        dict(B=2, T=1, Dk=16, Dv=16, rule="longhorn", decay=False, initial_state=False),
        {},
    ),
    "kaczmarz-T65-nobeta": (dict(B=1, T=65, Dk=20, Dv=12, rule="kaczmarz", seed=3), {}),
    "efla-varlen": (dict(B=1, T=72, Dk=16, Dv=16, rule="efla", n_states=5, seed=5), {}),
    "gated_efla-T65-neg": (dict(B=1, T=65, Dk=16, Dv=16, rule="gated_efla", seed=7), {"ne": True}),
    "linear-T33-nodecay": (dict(B=1, T=33, Dk=16, Dv=16, rule="linear", decay=False), {}),
    "relaxed_kaczmarz-T33-neg": (
        dict(B=1, T=33, Dk=16, Dv=16, rule="relaxed_kaczmarz", seed=2),
        {"ne": True},
    ),
    "trapezoid-T33-nostate": (
        dict(B=1, T=33, Dk=16, Dv=16, rule="trapezoid", initial_state=False, seed=4),
        {},
    ),
}


def test_the_cases_cover_every_rule():
    assert {spec["rule"] for spec, _ in CASES.values()} == set(triton_rules())


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """The stages the backend launches, in order, from now on (the forward fused)."""
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", "fused")
    calls: list[str] = []
    for stage in STAGES:
        launch = getattr(triton_backend, f"launch_{stage}")

        def spy(*args, _launch=launch, _stage=stage, **kwargs):
            calls.append(_stage)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(triton_backend, f"launch_{stage}", spy)
    return calls


def run(inputs: dict, calls: list[str], backend: str = "triton", **kwargs) -> tuple[list, list]:
    """Outputs and gradients of a loss linear in the outputs and the final state (the incoming
    gradients do not depend on the forward's rounding), and the launches of the backward."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    calls.clear()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(x.shape, generator=g).to(DEVICE, x.dtype) for x in (o, s)]
    ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
    return [o, s, *(None if leaves[n] is None else leaves[n].grad for n in NAMES)], list(calls)


@pytest.mark.parametrize("case", list(CASES))
def test_against_the_reference_and_none(case, launches, monkeypatch):
    spec, options = CASES[case]
    spec = dict(spec)
    B, T, Dk, Dv = (spec.pop(n) for n in ("B", "T", "Dk", "Dv"))
    inputs = make_inputs(B, T, 2, Dk, Dv, dtype=torch.float32, **spec)
    inputs = {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}
    if not RULES[spec["rule"]].needs_beta:
        inputs["beta"] = None
    kwargs = dict(rule=spec["rule"], negative_eigenvalues=options.get("ne", False))
    if case == "efla-varlen":
        kwargs["cu_seqlens"] = torch.tensor([0, *LENGTHS], device=DEVICE).cumsum(0)
    double = {n: None if t is None else t.double() for n, t in inputs.items()}
    ref, _ = run(double, launches, backend="reference", **kwargs)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "none")
    off, backward_off = run(inputs, launches, **kwargs)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    assert backward_off == LAUNCHES["none"][1]
    assert states.rebuilds_w_u(inputs["k"], inputs["v"])  # fp32 (the kernels'), small heads
    for form in ("t folded", "t"):  # W, Ũ formed by the state pass, then by the rebuild
        if form == "t":
            monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)
        launches.clear()
        on, backward_on = run(inputs, launches, **kwargs)
        assert backward_on == LAUNCHES[form][1], form
        for name, g, g_off, g_ref in zip(["o", "state", *NAMES], on, off, ref):
            assert (g is None) == (g_ref is None), name
            if g is not None:
                assert torch.isfinite(g).all() and rel_err(g, g_ref) <= 1e-4, name
                # the same lines on the same values ("prepare"'s precedent: 1e-6; in fact equal)
                assert rel_err(g, g_off) <= 1e-6, (form, name)


def test_half_precision_keeps_t_rounded(monkeypatch, request):
    # bf16/fp16: T is kept in the dot dtype (prepare.t_dtype: every reader rounds it to that
    # first), half of fp32's bytes (the other modes keep fp32); the gradients are "none"'s and
    # within the reference's 1e-2. The interpreter: fp16 (no bf16 dot) at small heads on the
    # half kernels (narrow_half_kernels); a GPU: bf16 at 64-column heads, the half kernels' own.
    if DEVICE == "cuda":
        dtype, Dk, Dv = torch.bfloat16, 64, 64
    else:
        dtype, Dk, Dv = torch.float16, 16, 48
        request.getfixturevalue("narrow_half_kernels")
    inputs = make_inputs(1, 70, 2, Dk, Dv, rule="trapezoid", dtype=torch.float32, seed=9)
    inputs = {n: t.to(DEVICE) for n, t in inputs.items()}
    double = {n: t.double() for n, t in inputs.items()}
    ref, _ = run(double, [], backend="reference", rule="trapezoid")
    inputs = {n: t.to(dtype if n in "qkv" else t.dtype).to(DEVICE) for n, t in inputs.items()}
    off, _ = run(inputs, [], rule="trapezoid")
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    on, _ = run(inputs, [], rule="trapezoid")
    for name, g, g_off, g_ref in zip(["o", "state", *NAMES], on, off, ref):
        if name not in ("o", "state"):  # outputs: the forward's roundings differ (prepare's)
            assert rel_err(g, g_off) <= 1e-6, name
        assert rel_err(g, g_ref) <= 1e-2, name
    args = [inputs[n].clone().requires_grad_() for n in NAMES]
    args += [None, RULES["trapezoid"].kernel_id, False, 1e-6, 1.0, 64, "t"]
    _, _, *slots = triton_backend.chunk_fwd_op(*args)
    kept = {n: x for n, x in zip(triton_ops.KEPT, slots) if x.numel()}
    assert set(kept) == {"t", "first_bad"} and kept["t"].dtype == dtype
    assert kept["t"].shape == (2, 2, 64, 64)  # two chunks, two heads
    assert (
        triton_ops.kept_layout("prepare", inputs["q"], inputs["v"], None)["t"][1] == torch.float32
    )


def test_non_finite_values_rebuilt_as_recomputed(monkeypatch):
    # A NaN value in the second chunk: the rebuild recomputes that Ũ tile with the row zeroed
    # as the backward's prepare does, so every gradient, NaN or not, is "none"'s.
    inputs = make_inputs(1, 100, 2, 16, 16, rule="delta", dtype=torch.float32, seed=1)
    inputs["v"][0, 80, 1, 3] = float("nan")
    inputs = {n: t.to(DEVICE) for n, t in inputs.items()}
    off, _ = run(inputs, [])
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    on, _ = run(inputs, [])
    assert not torch.isfinite(off[0]).all()  # NaN outputs from token 80 on
    for name, g, g_off in zip(["o", "state", *NAMES], on, off):
        torch.testing.assert_close(g, g_off, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)


def test_custom_op_registration_packed():
    # fake and real forward agree on what "t" keeps (packed sequences: chunk rows from shapes,
    # here 3 for 2 chunks: the spare row zeroed)
    lengths = [0, 5, 3]
    inputs = make_inputs(1, sum(lengths), 2, 16, 16, dtype=torch.float32, n_states=3)
    args = [inputs[n].to(DEVICE).requires_grad_() for n in NAMES]
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    torch.library.opcheck(
        triton_backend.chunk_fwd_varlen_op, args + [cu, 1, False, 1e-6, 0.25, 64, "t"]
    )


@pytest.mark.parametrize("Dk", [100, 40, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rebuild_gives_the_backwards_prepare(dtype, Dk):
    # Ragged heads of two column tiles, one and three: W and Ũ rebuilt from a kept T are the
    # backward's prepare's to the last bit: fp32 (the fold) and fp16 (T rounded, the strengths
    # apart: the backward's half-precision path, which holds the key tiles from λ to W at up to
    # two tiles, KEEP_K, and reads them again at three).
    from deltaflow.ops.triton import prepare, rebuild
    from deltaflow.ops.triton.common import chunk_tables

    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 70, 2, Dk, 72, dtype=dtype).items()}
    k, v = x["k"], x["v"]
    common = dict(beta=x["beta"], log_decay=x["log_decay"], kernel_id=RULES["delta"].kernel_id)
    common.update(tables=chunk_tables(None, 1, 70, k.device), negative_eigenvalues=True, eps=1e-6)
    w, u, w2, u2 = (torch.full_like(y, float("nan")) for y in (k, v, k, v))
    t = torch.empty(2, 2, 64, 64, device=DEVICE, dtype=prepare.t_dtype(k.dtype, kept_alone=True))
    first_bad = torch.empty(2, 2, device=DEVICE, dtype=torch.int32)
    prepare.launch_prepare(k, v, w=w, u=u, t=t, first_bad=first_bad, **common)
    rebuild.launch_rebuild(k, v, t=t, w=w2, u=u2, **common)
    assert torch.equal(w2, w) and torch.equal(u2, u)
