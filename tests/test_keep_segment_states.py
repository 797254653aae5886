"""``triton_backend.KEEP_SEGMENT_STATES`` (issue 32, session 20): a forward that runs its state
pass in segments keeps the state entering each segment, and the backward's recompute of that
pass starts every segment from it, running neither ``segment_states_kernel`` nor the chain
again. The gradients must be the recompute's to the bit: every check compares with the switch
off (today's recompute), on the GPU or the CPU interpreter, with segments of one chunk
(``SEGMENT_CHUNKS``) so that tiny sequences have several."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err
from _op_runs import record_launches
from test_segment_graph_safety import watch  # noqa: F401  (the fixture: host syncs counted)

from deltaflow import delta_rule
from deltaflow.rules import RULES

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops import triton_ops  # noqa: E402
from deltaflow.ops.triton import segment_chain, segment_states, states  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
LENGTHS = [0, 5, 200, 1, 129]  # packed: empty, shorter than a chunk, 4 and 3 segments
# The backward's segment launches: its reverse pass's always; the state pass's step 1 and chain
# again only where the forward kept nothing.
REVERSE = ["segment_dstates_kernel", "segment_chain_kernel"]
RECOMPUTE = ["segment_states_kernel", "segment_chain_kernel", *REVERSE]
# (make_inputs arguments, delta_rule options): dense and packed, an initial state or none, a
# rule without β (kaczmarz), negative eigenvalues, decay on and off, Dk != Dv.
CASES = {
    "delta-dense-state-neg": (dict(B=2, T=200, Dk=16, Dv=24, rule="delta", seed=1), {"ne": True}),
    "kaczmarz-dense-nostate-nobeta": (
        dict(B=1, T=193, Dk=16, Dv=16, rule="kaczmarz", initial_state=False, seed=2),
        {},
    ),
    "efla-packed-state": (
        dict(B=1, T=sum(LENGTHS), Dk=16, Dv=16, rule="efla", n_states=len(LENGTHS), seed=3),
        {"cu": True},
    ),
    "gated_efla-packed-nostate-neg": (
        dict(B=1, T=sum(LENGTHS), Dk=16, Dv=16, rule="gated_efla", initial_state=False, seed=4),
        {"cu": True, "ne": True},
    ),
    "longhorn-dense-nodecay": (
        dict(B=2, T=130, Dk=24, Dv=16, rule="longhorn", decay=False, seed=5),
        {},
    ),
}


@pytest.fixture
def seen(monkeypatch) -> list[tuple[str, dict]]:
    """Segments of one chunk, the switch on, and the segment kernels' launches recorded."""
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    kernels = {
        segment_states: ["segment_states_kernel", "segment_dstates_kernel"],
        segment_chain: ["segment_chain_kernel"],
    }
    return record_launches(monkeypatch, kernels)


def case_inputs(case: str, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    spec, options = CASES[case]
    spec = dict(spec)
    B, T, Dk, Dv = (spec.pop(n) for n in ("B", "T", "Dk", "Dv"))
    x = make_inputs(B, T, 2, Dk, Dv, dtype=torch.float32, **spec)
    inputs = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    if not RULES[spec["rule"]].needs_beta:
        inputs["beta"] = None
    kwargs = dict(rule=spec["rule"], negative_eigenvalues=options.get("ne", False))
    if options.get("cu"):
        kwargs["cu_seqlens"] = torch.tensor([0, *LENGTHS], device=DEVICE).cumsum(0)
    return inputs, kwargs


def run(inputs: dict, seen: list, backend: str = "triton", **kwargs) -> tuple[list, list[str]]:
    """Outputs and every gradient of a loss linear in the outputs and the final state, and the
    segment kernels the backward launched."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    seen.clear()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(x.shape, generator=g).to(DEVICE, x.dtype) for x in (o, s)]
    ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
    grads = [None if leaves[n] is None else leaves[n].grad for n in NAMES]
    return [o, s, *grads], [name for name, _ in seen]


def on_and_off(inputs: dict, seen: list, monkeypatch, **kwargs) -> tuple[list, list, list, list]:
    """run() with KEEP_SEGMENT_STATES on, then off: (results, launches) of each."""
    on, launched_on = run(inputs, seen, **kwargs)
    monkeypatch.setattr(triton_backend, "KEEP_SEGMENT_STATES", False)
    off, launched_off = run(inputs, seen, **kwargs)
    monkeypatch.setattr(triton_backend, "KEEP_SEGMENT_STATES", True)
    return on, off, launched_on, launched_off


def assert_bitwise(on: list, off: list) -> None:
    for name, x, y in zip(["o", "state", *NAMES], on, off):
        assert (x is None) == (y is None), name
        if x is not None:  # NaN where the recompute has NaN, every other bit equal
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=name)


# Each save mode that recomputes the state pass on dense and on packed sequences ("none": fp32
# inputs, whose forward's prepare is the backward's), each case once or twice.
SAVES = [
    ("delta-dense-state-neg", "t"),
    ("delta-dense-state-neg", "none"),
    ("kaczmarz-dense-nostate-nobeta", "prepare"),
    ("efla-packed-state", "t"),
    ("efla-packed-state", "prepare"),
    ("gated_efla-packed-nostate-neg", "none"),
    ("longhorn-dense-nodecay", "t"),
]


def test_the_cases_cover_every_save_mode_dense_and_packed():
    covered = {(save, "packed" in case) for case, save in SAVES}
    assert covered == {(s, p) for s in ("none", "prepare", "t") for p in (False, True)}
    assert {case for case, _ in SAVES} == set(CASES)


@pytest.mark.parametrize("case, save", SAVES)
def test_gradients_are_the_recomputes(case, save, seen, monkeypatch):
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", save)
    inputs, kwargs = case_inputs(case)
    on, off, launched_on, launched_off = on_and_off(inputs, seen, monkeypatch, **kwargs)
    assert_bitwise(on, off)
    assert launched_off == RECOMPUTE
    assert launched_on == REVERSE  # no segment_states_kernel, one chain: the reverse pass's
    if save == "t":  # and right: against the float64 token-by-token reference
        double = {n: None if t is None else t.double() for n, t in inputs.items()}
        ref, _ = run(double, seen, backend="reference", **kwargs)
        for name, g, g_ref in zip(["o", "state", *NAMES], on, ref):
            if g is not None:
                assert torch.isfinite(g).all() and rel_err(g, g_ref) <= 1e-4, name


def test_torch_chain_writes_the_kept_states(seen, monkeypatch):
    # segment_chain.SEGMENT_CHAIN = "torch" (the fallback; also every key head over 128 columns)
    # returns its own tensor, copied into the kept buffer
    monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", "torch")
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    inputs, kwargs = case_inputs("efla-packed-state")
    on, off, launched_on, launched_off = on_and_off(inputs, seen, monkeypatch, **kwargs)
    assert_bitwise(on, off)
    assert (launched_on, launched_off) == (["segment_dstates_kernel"], RECOMPUTE[::2])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("at", [70, 130])
def test_non_finite_inputs(at, seen, monkeypatch):
    # A NaN value in the second or third segment: the kept states after it are NaN as the
    # recomputed ones are (first_bad's poison), and every gradient is the recompute's.
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    inputs, kwargs = case_inputs("delta-dense-state-neg")
    inputs["v"][0, at, 1, 3] = float("nan")
    on, off, launched_on, _ = on_and_off(inputs, seen, monkeypatch, **kwargs)
    assert not torch.isfinite(off[0]).all()
    assert_bitwise(on, off)
    assert launched_on == REVERSE


@pytest.mark.parametrize("save, kept", [("t", True), ("none", False)])
def test_half_precision(save, kept, seen, monkeypatch, narrow_half_kernels):
    # fp16 (the interpreter's half type; bf16 on a GPU): "t" runs the backward's prepare in the
    # forward, so its W and Ũ, and the segments' states, are the recompute's: kept. "none"
    # rounds its forward's prepare otherwise (prepare.low_precision): nothing kept, the backward
    # recomputes as before. The gradients are the recompute's either way.
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", save)
    inputs, kwargs = case_inputs("delta-dense-state-neg", dtype)
    on, off, launched_on, launched_off = on_and_off(inputs, seen, monkeypatch, **kwargs)
    assert_bitwise(on, off)
    assert launched_off == RECOMPUTE
    assert launched_on == (REVERSE if kept else RECOMPUTE)
    q, v = inputs["q"], inputs["v"]
    save_mode = "segments" if save == "none" else save
    rows = triton_ops.kept_layout(save_mode, q, v, None)["entering"][0][0]
    assert rows == (2 * 4 if kept else 0)  # B = 2 rows of 4 segments


def test_other_backward_blocks_recompute(seen, monkeypatch):
    # The backward's state pass in other value blocks than the forward's (states.BWD_STATES_BV):
    # other segments (segment_length weighs the programs) and step-1 blocks, so other states:
    # nothing kept, the backward recomputes them.
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    monkeypatch.setattr(states, "BWD_STATES_BV", 16)
    inputs, kwargs = case_inputs("delta-dense-state-neg")
    assert triton_ops.kept_layout("t", inputs["q"], inputs["v"], None)["entering"][0][0] == 0
    on, off, launched_on, launched_off = on_and_off(inputs, seen, monkeypatch, **kwargs)
    assert_bitwise(on, off)
    assert launched_on == launched_off == RECOMPUTE


def test_save_mode_none_keeps_the_segments_states_where_a_backward_runs(monkeypatch):
    # SAVE_FOR_BACKWARD "none" is the op's "segments" where autograd will run a backward (the
    # entering states alone, where kept_segment_rows keeps any), "none" for inference and with
    # the switch off; the other modes name themselves
    x = torch.ones(1, requires_grad=True)
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "none")  # the default is "t"
    assert triton_backend._save_mode(x) == "segments"
    assert triton_backend._save_mode(x.detach()) == "none"
    with torch.no_grad():
        assert triton_backend._save_mode(x) == "none"
    monkeypatch.setattr(triton_backend, "KEEP_SEGMENT_STATES", False)
    assert triton_backend._save_mode(x) == "none"
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "t")
    assert triton_backend._save_mode(x) == "t"


def test_kept_rows_from_shapes(monkeypatch):
    # The fake implementation's rows (kept_layout: shapes alone) at the shape on 132
    # multiprocessors (an H100's / H200's; the interpreter's stand-in): 9 segments of 57 chunks
    # a head, 9 · 128 · 128 · 4 B / 32768 tokens = 18 B per token and head. bf16 "none" keeps
    # none (its forward's prepare rounds apart); "states" keeps h itself.
    monkeypatch.setattr(triton_backend, "interpreting", lambda: True)
    q = torch.empty(1, 32768, 16, 128, dtype=torch.bfloat16, device="meta")
    rows = {
        save: triton_ops.kept_layout(save, q, q, None).get("entering", ((None,), None))[0][0]
        for save in ("segments", "prepare", "states", "t")
    }
    assert rows == {"segments": 0, "prepare": 9, "states": None, "t": 9}
    assert 9 * 16 * 128 * 128 * 4 / (32768 * 16) == 18
    fp32 = q.to(torch.float32)
    assert triton_ops.kept_layout("segments", fp32, fp32, None)["entering"][0] == (9, 16, 128, 128)
    # one packed sequence of those tokens: the bound, N + SEGMENT_WAVES · 132 // programs, here
    # 1 + 264 // 32: the 9 segments of 57 chunks exactly
    cu = torch.empty(2, dtype=torch.int64, device="meta")
    assert triton_ops.kept_layout("t", q, q, cu)["entering"][0][0] == 9
    # sequences x heads that fill the GPU run no segments: nothing kept
    wide = torch.empty(8, 4096, 16, 128, dtype=torch.bfloat16, device="meta")
    assert triton_ops.kept_layout("t", wide, wide, None)["entering"][0][0] == 0
    monkeypatch.setattr(triton_backend, "KEEP_SEGMENT_STATES", False)
    assert triton_ops.kept_layout("t", q, q, None)["entering"][0][0] == 0


@pytest.mark.parametrize("SEGMENT_CHUNKS", [0, 1, 3])
def test_packed_bound_holds(SEGMENT_CHUNKS, monkeypatch):
    # The packed sequences' rows, a bound from shapes, against the segments the forward runs,
    # over layouts from one long sequence to many short ones (0: segments from the load)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", SEGMENT_CHUNKS)
    from deltaflow.ops.triton.common import chunk_tables

    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 5, 17):
        for _ in range(8):
            lengths = torch.randint(0, 2000, (N,), generator=g).tolist()
            T = sum(lengths)
            cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
            q = torch.empty(1, T, 2, 16, device=DEVICE)  # a GPU's multiprocessors: not "meta"
            rows = triton_ops.kept_layout("t", q, q, cu)["entering"][0][0]
            tables = chunk_tables(cu, 1, T, q.device)
            segments = triton_backend._segments(tables, 1, T, True, 2, 16, states.TWO_PASS_BV)
            if segments is not None:
                assert 0 < segments.fwd_row.numel() <= rows, (lengths, SEGMENT_CHUNKS)


def test_custom_op_registration(monkeypatch):
    # fake and real forward agree on the kept states' rows (dense: every segment; packed: the
    # bound, its spare rows zeroed), and autograd runs the backward op on them
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    for case in ("kaczmarz-dense-nostate-nobeta", "efla-packed-state"):
        inputs, kwargs = case_inputs(case)
        args = [None if inputs[n] is None else inputs[n].requires_grad_() for n in NAMES]
        args += [kwargs.get("cu_seqlens"), RULES[kwargs["rule"]].kernel_id, False, 1e-6, 0.25]
        op = triton_ops.chunk_fwd_for(kwargs.get("cu_seqlens"))
        with torch.no_grad():
            _, _, *slots = op(*args, 64, "t")
        entering = dict(zip(triton_ops.KEPT, slots))["entering"]
        assert entering.shape[0] >= 4 and torch.isfinite(entering).all(), case
        torch.library.opcheck(op, [*args, 64, "t"])


def test_dense_path_makes_no_host_sync(watch, monkeypatch):  # noqa: F811
    # CUDA-graph safety: the forward keeping the states and the backward taking them read
    # nothing back from the device (shapes alone)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    x, kwargs = case_inputs("delta-dense-state-neg")
    kw = dict(beta=x["beta"], log_decay=x["log_decay"], initial_state=x["initial_state"])
    kw.update(cu_seqlens=None, kernel_id=RULES["delta"].kernel_id, negative_eigenvalues=True)
    kw.update(eps=1e-6, scale=0.25)
    triton_backend._forward(x["q"], x["k"], x["v"], save="t", **kw)  # the tables built
    with watch:
        _, _, kept = triton_backend._forward(x["q"], x["k"], x["v"], save="t", **kw)
        grad_o = torch.ones_like(x["v"])
        triton_backend._backward(
            x["q"], x["k"], x["v"], grad_o=grad_o, grad_state=None, kept=kept, **kw
        )
    assert kept["entering"].shape[0] == 2 * 4
    assert dict(watch.syncs) == {}
