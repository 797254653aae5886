"""The Triton kernels against the reference: on the GPU when there is one, else on the CPU
interpreter (TRITON_INTERPRET=1, set in conftest.py). Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule, delta_rule_step
from deltaflow.ops.triton_ops import KEPT
from deltaflow.rules import RULES, triton_rules

# The rules with a Triton form (every built-in rule, gated_efla included); user rules run on the
# torch backend only.
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
    bf16 tl.dot is wrong: numpy has no bf16; benchmarks/check_triton.py checks bf16 on the GPU).
    Their heads are narrower than 64 columns (the interpreter is slow), which the op runs on the
    fp32 kernels: the tests of the half-precision kernels take ``narrow_half_kernels``."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    inputs = make_inputs(1, T, 2, Dk, Dv, rule=rule, dtype=torch.float32, seed=seed)
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    return dtype, on_device(inputs)


def test_half_precision_inputs(narrow_half_kernels):
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


@pytest.mark.parametrize("case", ["T1", "T65-strong-decay-neg", "varlen", "half"])
def test_gated_efla_against_the_reference(case, narrow_half_kernels):
    # The rule whose strengths read the decay: its entry reads the op's log α = expm1(the
    # layer's), mapped on the host, and d log α collects the recurrence's part and the
    # strengths' (∂a/∂g, ∂b/∂g, then the chain rule through expm1). T = 1 (one ragged chunk),
    # α down to e^{−6} (the op's decay near its floor e^{−1}) with negative eigenvalues, packed
    # sequences (empty ones too) with initial states, half-precision operands.
    rule, kw = "gated_efla", {}
    if case == "T1":
        inputs = make_inputs(2, 1, 2, 16, 16, rule=rule, dtype=torch.float32, seed=11)
    elif case == "T65-strong-decay-neg":
        inputs = make_inputs(1, 65, 2, 16, 24, rule=rule, dtype=torch.float32, seed=12)
        g = torch.Generator().manual_seed(12)
        inputs["log_decay"] = -6.0 * torch.rand(inputs["beta"].shape, generator=g)
        kw = {"negative_eigenvalues": True}
    elif case == "varlen":
        lengths = [0, 5, 64, 0, 70, 1]
        inputs = make_inputs(1, 140, 2, 16, 16, rule=rule, dtype=torch.float32, n_states=6)
        kw = {"cu_seqlens": torch.tensor([0, *lengths], device=DEVICE).cumsum(0)}
    else:
        _, inputs = _half_inputs(70, 16, 32, rule, seed=13)
        ref = _fwd_bwd({n: t.double() for n, t in inputs.items()}, "reference", rule=rule)
        got = _fwd_bwd(inputs, "triton", rule=rule)
        for name, x, x_ref in zip(["o", "state", *NAMES], got, ref):
            assert rel_err(x, x_ref) <= 1e-2, name
        return
    assert_fused_backward_matches(on_device(inputs), rule=rule, **kw)


def test_two_pass_forward(monkeypatch):
    # The forward for few sequences × heads: state pass with narrow value blocks, then outputs.
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", "two_pass")
    inputs = on_device(make_inputs(2, 65, 2, 16, 20, rule="delta", dtype=torch.float32, seed=4))
    assert_fused_backward_matches(inputs, rule="delta", negative_eigenvalues=True)


@pytest.mark.parametrize("rule", ["efla", "linear", "gated_efla"])
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


def _op_args(varlen: bool, save: str, grad: bool) -> list:
    """chunk_fwd's arguments: one sequence of 20 tokens, or four packed ones (two empty)."""
    lengths = [0, 5, 64, 1] if varlen else [20]
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0) if varlen else None
    n_states = len(lengths) if varlen else None
    inputs = make_inputs(
        1, sum(lengths), 2, 16, 16, rule="delta", dtype=torch.float32, n_states=n_states
    )
    tensors = [inputs[n].to(DEVICE).requires_grad_(grad) for n in NAMES]
    return tensors + [cu, 1, False, 1e-6, 0.25, 64, save]


@pytest.mark.parametrize(
    "save, varlen",
    [
        ("none", False),
        ("segments", True),
        ("prepare", True),
        ("states", True),
        ("states_fp32", False),
    ],
)
def test_custom_op_registration(save, varlen):
    # The fake (meta) implementations must agree with the real ones on shapes, strides and
    # dtypes, what the forward keeps included (packed sequences: chunk rows bounded from
    # shapes, and segment rows: "segments" and "prepare" keep a bound's, zeroed, since
    # "auto" would split these few programs' passes on the interpreter's 132 SMs); autograd's
    # registration and AOT dispatch (forward and backward) hold for each SAVE_FOR_BACKWARD mode
    # (the op's save argument).
    torch.library.opcheck(triton_backend.chunk_fwd_op, _op_args(varlen, save, grad=True))
    # the backward op, given what the forward kept (None where it keeps nothing)
    args = _op_args(varlen, save, grad=False)
    o, state, *slots = triton_backend.chunk_fwd_op(*args)
    kept = [x if name in triton_backend.SAVE_MODES[save] else None for name, x in zip(KEPT, slots)]
    bwd_args = [*args[:7], torch.randn_like(o), torch.randn_like(state), *kept, *args[7:12]]
    torch.library.opcheck(
        triton_backend.chunk_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor")
    )


def test_chunk_size_is_refused_not_ignored():
    # The kernels compute in chunks of 64 tokens: another chunk_size is an error, never ignored.
    inputs = on_device(make_inputs(1, 20, 2, 16, 16, rule="delta", dtype=torch.float32))
    with pytest.raises(ValueError, match="chunks of 64 tokens, got chunk_size=32"):
        delta_rule(**inputs, backend="triton", chunk_size=32)
    o, _ = delta_rule(**inputs, backend="triton", chunk_size=64)
    o_ref, _ = delta_rule(**inputs, backend="reference")
    assert rel_err(o, o_ref) <= 1e-4
    args = [inputs[n] for n in NAMES] + [None, 1, False, 1e-6, 0.25, 16, "none"]
    with pytest.raises(ValueError, match="chunk_size=16"):
        triton_backend.chunk_fwd_op(*args)


def test_half_precision_backward_with_fp32_states(narrow_half_kernels):
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
def test_half_precision_backward_with_t_flags(
    monkeypatch, narrow_half_kernels, module, flag, value
):
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


# ---------------------------------------------------------------------------------------------
# SAVE_FOR_BACKWARD: the backward reuses what the forward computed instead of recomputing it.

# (make_inputs arguments, delta_rule options): rules with and without β and decay, a ragged
# chunk, T = 1, packed sequences (empty ones too) with initial states, negative eigenvalues.
REUSE_CASES = {
    "delta-T70-neg": (dict(B=1, T=70, Dk=16, Dv=24, rule="delta", seed=8), {"ne": True}),
    "longhorn-T1": (
        dict(B=2, T=1, Dk=16, Dv=16, rule="longhorn", decay=False, initial_state=False),
        {},
    ),
    "kaczmarz-T65-nobeta": (dict(B=1, T=65, Dk=20, Dv=12, rule="kaczmarz", seed=3), {}),
    "efla-varlen": (dict(B=1, T=140, Dk=16, Dv=16, rule="efla", n_states=6, seed=5), {}),
    "gated_efla-T65": (dict(B=1, T=65, Dk=16, Dv=16, rule="gated_efla", seed=7), {}),
}
REUSE_LENGTHS = [0, 5, 64, 0, 70, 1]  # efla-varlen's sequences (140 tokens)
STAGES = ("prepare", "states", "forward", "outputs", "dstates", "gradients")
# The stage launches of the forward and of the backward per mode (the interpreter's forward is
# the fused one; keeping h takes the two-pass form).
LAUNCHES = {
    "none": (["prepare", "forward"], ["prepare", "states", "dstates", "gradients"]),
    "prepare": (["prepare", "forward"], ["states", "dstates", "gradients"]),
    "states": (["prepare", "states", "outputs"], ["dstates", "gradients"]),
}


def _record_launches(monkeypatch) -> list[str]:
    """The stages the backend launches, in order, from now on."""
    calls: list[str] = []
    for stage in STAGES:
        launch = getattr(triton_backend, f"launch_{stage}")

        def spy(*args, _launch=launch, _stage=stage, **kwargs):
            calls.append(_stage)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(triton_backend, f"launch_{stage}", spy)
    return calls


def _reuse_run(
    inputs: dict, calls: list[str], backend: str = "triton", **kwargs
) -> tuple[list, list, list]:
    """Outputs and gradients of a loss linear in the outputs and the final state (so that the
    backward's incoming gradients do not depend on the forward's rounding), with the launches
    of the forward and of the backward."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    calls.clear()
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    forward = list(calls)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(x.shape, generator=g).to(DEVICE) for x in (o, s)]
    ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
    grads = [None if leaves[n] is None else leaves[n].grad for n in NAMES]
    return [o, s, *grads], forward, calls[len(forward) :]


@pytest.mark.parametrize("save", ["prepare", "states"])
@pytest.mark.parametrize("case", list(REUSE_CASES))
def test_backward_reuses_the_forward(monkeypatch, case, save):
    # With the switch on, the backward skips the launches whose results the forward kept, and
    # its gradients are those of the switch off (the same kernels on the same values, so equal
    # to fp32 rounding at most); the outputs differ by the forward's form (fused, two-pass).
    spec, options = REUSE_CASES[case]
    spec = dict(spec)
    B, T, Dk, Dv = (spec.pop(n) for n in ("B", "T", "Dk", "Dv"))
    inputs = on_device(make_inputs(B, T, 2, Dk, Dv, dtype=torch.float32, **spec))
    if spec["rule"] == "kaczmarz":
        inputs["beta"] = None
    kwargs = dict(rule=spec["rule"], negative_eigenvalues=options.get("ne", False))
    if case == "efla-varlen":
        kwargs["cu_seqlens"] = torch.tensor([0, *REUSE_LENGTHS], device=DEVICE).cumsum(0)
    calls = _record_launches(monkeypatch)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "none")  # the default is "t"
    off, *launches_off = _reuse_run(inputs, calls, **kwargs)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", save)
    on, *launches_on = _reuse_run(inputs, calls, **kwargs)
    assert tuple(launches_off) == LAUNCHES["none"] and tuple(launches_on) == LAUNCHES[save]
    for name, g, g_off in zip(["o", "state", *NAMES], on, off):
        assert (g is None) == (g_off is None), name
        if g is not None:
            tol = 1e-5 if name in ("o", "state") else 1e-6
            assert torch.isfinite(g).all() and rel_err(g, g_off) <= tol, name


@pytest.mark.parametrize("fp32_states", [False, True])
def test_half_precision_backward_reuses_the_forward(monkeypatch, narrow_half_kernels, fp32_states):
    # Half precision: the forward's prepare keeps T with the backward's roundings (prepare.
    # BACKWARD_*), so the gradients are the switch-off ones; h kept in float32 where the
    # backward's states are (BACKWARD_STATES_FP32). Against the float64 reference as before.
    _, inputs = _half_inputs(70, 16, 48, "trapezoid", seed=9)
    monkeypatch.setattr(triton_backend, "BACKWARD_STATES_FP32", fp32_states)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "none")
    off, *_ = _reuse_run(inputs, [], rule="trapezoid")
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "states")
    on, *_ = _reuse_run(inputs, [], rule="trapezoid")
    double = {n: t.double() for n, t in inputs.items()}
    ref, *_ = _reuse_run(double, [], backend="reference", rule="trapezoid")
    for name, g, g_off, g_ref in zip(["o", "state", *NAMES], on, off, ref):
        assert rel_err(g, g_off) <= (5e-3 if name in ("o", "state") else 1e-6), name
        assert rel_err(g, g_ref) <= 1e-2, name


def test_nothing_is_kept_without_a_backward(monkeypatch):
    # Inference (no grad, or no input that requires one) keeps nothing whatever the switch;
    # an unknown value is refused with one line.
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "states")
    x = torch.ones(1, requires_grad=True)
    assert triton_backend._save_mode(None, x) == "states"
    assert triton_backend._save_mode(None, x.detach()) == "none"
    with torch.no_grad():
        assert triton_backend._save_mode(x) == "none"
    monkeypatch.setattr(triton_backend, "BACKWARD_STATES_FP32", True)
    assert triton_backend._save_mode(x) == "states_fp32"
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", True)
    with pytest.raises(ValueError, match="SAVE_FOR_BACKWARD must be"):
        triton_backend._save_mode(x)


def test_compiled_fullgraph_reads_the_kept_tensors(monkeypatch):
    # torch.compile(fullgraph=True) traces the op with what the forward keeps as outputs; the
    # backward that inductor's partitioner cuts reads them from the forward's saved tensors
    # (never runs chunk_fwd again) and gives eager's gradients.
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "states")
    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=keep_backward,
        partition_fn=min_cut_rematerialization_partition,
    )

    def step(q, k, v, beta, log_decay, initial_state):
        o, s = delta_rule(
            q,
            k,
            v,
            beta,
            log_decay=log_decay,
            initial_state=initial_state,
            output_final_state=True,
            backend="triton",
            check_values=False,
        )
        return o.sin().sum() + s.pow(2).sum()

    inputs = on_device(make_inputs(1, 70, 2, 16, 16, rule="delta", dtype=torch.float32))
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        leaves = [inputs[n].clone().requires_grad_() for n in NAMES]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    (graph,) = backward_graphs
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.deltaflow.chunk_fwd.default not in ops
    (node,) = [n for n in graph.graph.nodes if n.target is torch.ops.deltaflow.chunk_bwd.default]
    kept = dict(zip(KEPT, node.args[9 : 9 + len(KEPT)]))
    assert {n for n, a in kept.items() if a is not None} == set(triton_backend.SAVE_MODES["states"])
    assert all(a.op == "placeholder" for a in kept.values() if a is not None), kept
    for g, g_ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)
