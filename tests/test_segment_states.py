"""The sequence-parallel state passes (deltaflow/ops/triton/segment_states.py, issue 32) against
the float64 token-by-token reference, on the GPU or the CPU interpreter. The switch
(``triton_backend.SEQUENCE_PARALLEL_STATES``) is forced on with segments of one or two chunks,
so that tiny sequences still have several segments, and every test checks that the segmented
launchers ran (or, where a sequence fits one segment, that the plain pass did)."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err
from test_nonfinite_causal import BAD_INPUTS, assert_causal, planted, reference

from deltaflow import delta_rule
from deltaflow.rules import RULES, triton_rules

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton.common import CHUNK, chunk_tables  # noqa: E402
from deltaflow.ops.triton.segment_states import build_segment_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
LAUNCHERS = (
    "launch_states",
    "launch_segmented_states",
    "launch_dstates",
    "launch_segmented_dstates",
)
C = CHUNK.value


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """The switch on, segments of one chunk (tests may change SEGMENT_CHUNKS), and the names of
    the state-pass launchers the backend calls, in order. The forward pinned to its fused form
    where it runs no segments: on a GPU "auto" takes the two-pass form at these few programs
    (a second launch_states), on the interpreter the fused one (session 18, call 1)."""
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", "fused")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    calls: list[str] = []
    for name in LAUNCHERS:
        launch = getattr(triton_backend, name)

        def spy(*args, _launch=launch, _name=name, **kwargs):
            calls.append(_name)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(triton_backend, name, spy)
    return calls


def on_device(inputs: dict) -> dict:
    return {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}


def fwd_bwd(inputs: dict, backend: str, **kwargs) -> list:
    """Outputs, final state and all six gradients of a loss weighing both."""
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def assert_matches_reference(inputs: dict, tol: float = 1e-4, grads: bool = True, **kwargs):
    if grads:
        ref, got = fwd_bwd(inputs, "reference", **kwargs), fwd_bwd(inputs, "triton", **kwargs)
    else:
        ref = delta_rule(**inputs, output_final_state=True, backend="reference", **kwargs)
        got = delta_rule(**inputs, output_final_state=True, backend="triton", **kwargs)
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= tol, (name, rel_err(g, g_ref))


SEGMENTED = ["launch_segmented_states", "launch_segmented_states", "launch_segmented_dstates"]


# ---------------------------------------------------------------------------- the tables
def test_segment_tables_cover_every_chunk_once():
    lengths = [0, 5, 64, 0, 200, 1, 129]  # empty, shorter than a chunk, 1-4 segments of 1 chunk
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    tables = chunk_tables(torch.tensor(cu), 1, cu[-1], torch.device("cpu"))
    seg = build_segment_tables(cu, 1, tables, torch.device("cpu"))
    N, R = len(lengths), [max(1, -(-n // C)) for n in lengths]
    assert seg.slots == max(R) - 1 == 3
    starts = seg.segments.cu_seqlens.tolist()
    assert starts[0] == 0 and starts[-1] == cu[-1] and starts == sorted(starts)
    assert seg.fwd_row.numel() == sum(R) and seg.segments.chunk_offsets.numel() == sum(R) + 1
    assert seg.first.tolist() == [sum(R[:n]) for n in range(N)]
    assert seg.last.tolist() == [sum(R[: n + 1]) - 1 for n in range(N)]
    # every chunk of the batch is in exactly one segment, as the chunk tables number it
    chunks = [c for g in range(sum(R)) for c in range(*seg.segments.chunk_offsets[g : g + 2])]
    assert chunks == list(range(tables.n_chunks))
    # the chain's rows: segment r of sequence n reads row r·N + n forward, (R_n − 1 − r)·N + n
    # in reverse; step 1 runs the segments it needs there and leaves the others empty
    fwd, rev = seg.fwd_bounds.tolist(), seg.rev_bounds.tolist()
    for n in range(N):
        for r in range(R[n]):
            g = seg.first[n] + r
            lo, hi = starts[g], starts[g + 1]
            assert seg.fwd_row[g] == r * N + n and seg.rev_row[g] == (R[n] - 1 - r) * N + n
            if r < R[n] - 1:
                assert fwd[r * N + n] == [lo, hi, seg.segments.chunk_offsets[g]]
            if r > 0:
                assert rev[(R[n] - 1 - r) * N + n] == [lo, hi, seg.segments.chunk_offsets[g]]
        for r in range(R[n] - 1, seg.slots):
            assert fwd[r * N + n] == [0, 0, 0] and rev[r * N + n] == [0, 0, 0]


def test_segment_length_from_the_load(monkeypatch):
    # the design's numbers (benchmarks/NOTES.md, issue 32, session 17), at 132 SMs
    for mode, B, T, H, want in [
        ("auto", 2, 8192, 8, 16),
        ("auto", 1, 32768, 16, 57),
        ("auto", 8, 4096, 16, None),  # 256 programs fill 132 SMs: sequential
        ("on", 8, 4096, 16, 32),
        ("on", 1, 256, 2, None),  # 4 chunks, segments of at least SEGMENT_MIN_CHUNKS: one
    ]:
        monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", mode)
        monkeypatch.setattr(triton_backend, "interpreting", lambda: True)  # 132 SMs off a GPU
        tables = chunk_tables(None, B, T, torch.device("cpu"))
        seg = triton_backend._segments(tables, B, T, False, H, 128, 64)
        assert (seg and seg.chunks) == want, (mode, B, T, H)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "yes")
    with pytest.raises(ValueError, match="must be 'off', 'on' or 'auto'"):
        triton_backend._segments(tables, 1, 256, False, 2, 128, 64)


def test_dense_segments_is_the_segments_decision(monkeypatch):
    # dense_segments (benchmarks/kernels.py's warm-up asks it) answers from shapes what
    # _segments decides by building the tables (a row of more than one segment): they agree
    monkeypatch.setattr(triton_backend, "interpreting", lambda: True)  # 132 SMs off a GPU
    seen = set()
    for mode in ("auto", "on", "off"):
        for segment_chunks in (0, 1, 3):
            monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", mode)
            monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", segment_chunks)
            for B, T, H, Dv, block_v in [
                (1, 65, 2, 32, 64), (1, 256, 2, 32, 64), (1, 320, 2, 32, 64), (2, 8192, 8, 128, 64),
                (1, 32768, 16, 128, 16), (8, 4096, 16, 128, 64), (64, 256, 4, 64, 64),
                (2, 4096, 2, 32, 64), (3, 130, 1, 16, 32), (1, 0, 2, 32, 64),
            ]:  # fmt: skip
                tables = chunk_tables(None, B, T, torch.device("cpu"))
                built = triton_backend._segments(tables, B, T, False, H, Dv, block_v) is not None
                assert triton_backend.dense_segments(B, T, H, Dv, 132, block_v) == built, (
                    mode, segment_chunks, B, T, H, Dv, block_v
                )  # fmt: skip
                seen.add(built)
    assert seen == {False, True}
    # no block given: any of the op's three passes (kernels.py's SHAPES at 132 SMs, auto)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "auto")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 0)
    dense = [triton_backend.dense_segments(*shape, 132) for shape in [(1, 32768, 16, 128),
             (8, 4096, 16, 128), (1, 65, 2, 32)]]  # fmt: skip
    assert dense == [True, False, False]


# ---------------------------------------------------------------------------- forward, backward
# Each rule once in the forward and once in the backward, negative eigenvalues on in one of the
# two (never for trapezoid: μ ∈ (−3, 1] diverges by design, the op warns). The segmented passes
# take no rule and no flag: both reach them only through prepare's W and Ũ (and the gradient
# kernels after them), whose every rule x flag tests/test_triton_interpret.py checks.
FORWARD_RULES = [(r, i % 2 == 1) for i, r in enumerate(triton_rules())]
BACKWARD_RULES = [(r, i % 2 == 0 and r != "trapezoid") for i, r in enumerate(triton_rules())]


@pytest.mark.parametrize("rule, ne", FORWARD_RULES)
def test_forward_every_rule(rule, ne, launches):
    # T = 200: four chunks (the last ragged), four segments; Dk != Dv; β where the rule reads it
    inputs = on_device(make_inputs(2, 200, 2, 16, 24, rule=rule, dtype=torch.float32, seed=1))
    if not RULES[rule].needs_beta:
        inputs["beta"] = None
    assert_matches_reference(inputs, grads=False, rule=rule, negative_eigenvalues=ne)
    assert launches == ["launch_segmented_states"]


@pytest.mark.parametrize("rule, negative_eigenvalues", BACKWARD_RULES)
def test_backward_every_rule(rule, negative_eigenvalues, launches):
    inputs = on_device(make_inputs(1, 150, 2, 16, 24, rule=rule, dtype=torch.float32, seed=8))
    if not RULES[rule].needs_beta:
        inputs["beta"] = None
    assert_matches_reference(inputs, rule=rule, negative_eigenvalues=negative_eigenvalues)
    assert launches == SEGMENTED


@pytest.mark.parametrize(
    "T, segment_chunks, segmented",
    [(1, 1, False), (63, 1, False), (65, 1, True), (65, 2, False), (200, 2, True), (321, 2, True)],
)
@pytest.mark.parametrize("state", [False, True])
def test_lengths_and_segment_sizes(T, segment_chunks, segmented, state, launches, monkeypatch):
    # T = 1 and 63: one chunk; 65 with segments of 1 chunk: a last segment of one token; with
    # segments of 2: T shorter than a segment (the plain pass); 321 / 2: three segments
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", segment_chunks)
    decay = T % 2 == 1
    x = make_inputs(2, T, 1, 16, 16, rule="longhorn", decay=decay, initial_state=state, seed=T)
    assert_matches_reference(
        on_device({n: None if t is None else t.float() for n, t in x.items()}), rule="longhorn"
    )
    plain = ["launch_states", "launch_dstates"]  # the fused forward (pinned), its backward
    assert launches == (SEGMENTED if segmented else plain)


def test_packed_sequences_of_unequal_lengths(launches):
    lengths = [0, 5, 64, 0, 200, 1, 129]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    x = make_inputs(1, sum(lengths), 2, 16, 16, rule="efla", n_states=len(lengths), seed=5)
    inputs = on_device({n: t.float() for n, t in x.items()})
    assert_matches_reference(inputs, rule="efla", cu_seqlens=cu)
    without_states = dict(inputs, initial_state=None)
    assert_matches_reference(without_states, rule="efla", negative_eigenvalues=True, cu_seqlens=cu)
    assert launches == SEGMENTED * 2


def test_half_precision(launches, narrow_half_kernels):
    # bf16 on a GPU, fp16 in the interpreter (whose bf16 dot is wrong); the transition columns
    # are rounded as operands exactly as the state is, so the error stays the half type's
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    inputs = make_inputs(1, 200, 2, 32, 32, rule="delta", dtype=torch.float32, seed=6)
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    inputs = on_device(inputs)
    ref = fwd_bwd({n: t.double() for n, t in inputs.items()}, "reference")
    got = fwd_bwd(inputs, "triton")
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert rel_err(g, g_ref) <= 1e-2, name
    assert launches == SEGMENTED


@pytest.mark.parametrize("save", ["prepare", "states", "t"])
def test_with_save_for_backward(save, launches, monkeypatch):
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", save)
    inputs = on_device(make_inputs(1, 200, 2, 16, 16, rule="delta", dtype=torch.float32, seed=3))
    assert_matches_reference(inputs, rule="delta")
    # "states" keeps the forward's (segmented) state pass: the backward runs the reverse only
    assert launches == (SEGMENTED[::2] if save == "states" else SEGMENTED)


def test_auto_and_off(launches, monkeypatch):
    inputs = on_device(make_inputs(1, 200, 2, 16, 16, rule="delta", dtype=torch.float32, seed=2))
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "auto")  # 2 programs < 132
    assert_matches_reference(inputs, rule="delta")
    assert launches == SEGMENTED
    launches.clear()
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "off")
    assert_matches_reference(inputs, rule="delta")
    assert launches == ["launch_states", "launch_dstates"]  # the fused forward, its backward


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name, value", BAD_INPUTS[::3])
@pytest.mark.parametrize("at", [20, 84, 150])
def test_non_finite_inputs_stay_causal(name, value, at, launches):
    # a NaN / inf in the first, second (a segment of its own) or third segment
    x = planted("delta", name, value, at, T=200, dtype=torch.float32)
    o_ref, s_ref = reference(x, "delta")
    x = on_device(x)
    o, s = delta_rule(**x, rule="delta", output_final_state=True, backend="triton")
    assert_causal(o.cpu(), s.cpu(), o_ref, s_ref, at, 1e-4)
    assert launches == ["launch_segmented_states"]
