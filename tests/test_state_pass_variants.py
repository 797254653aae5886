"""The state passes with the state in row blocks (``states.STATES_SPLIT_K``, the kernels of
deltaflow/ops/triton/states_split.py; issue 32) against the float64 token-by-token reference, on
the GPU or the CPU interpreter. Every test turns the switch on and checks which kernels ran: the
split ones wherever the key block is wider than a block, today's elsewhere.

On the interpreter the shapes are small and mostly fp32 with blocks of 16 rows
(``states.SPLIT_MIN_ROWS`` lowered), so a 64-row key block splits in four; on a GPU the same
tests run four times wider heads in 64-row blocks (blocks under 64 rows are not launched there).
One half-precision case, in 64-row blocks on both (common.HALF_MIN_BLOCK)."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err
from test_nonfinite_causal import INF, NAN, assert_causal

from deltaflow import delta_rule
from deltaflow.rules import RULES, triton_rules

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.triton import dstates, segment_states, states  # noqa: E402
from deltaflow.ops.triton.common import key_block  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
KERNELS = (
    "chunk_forward_kernel",
    "chunk_states_kernel",
    "chunk_dstates_kernel",
    "split_forward_kernel",
    "split_states_kernel",
    "split_dstates_kernel",
)
FWD_BWD = ["split_forward_kernel", "split_states_kernel", "split_dstates_kernel"]
# the narrowest block, and the key head of four of them (the fp32 tests' block and head)
ROWS = 64 if DEVICE == "cuda" else 16
DK4 = 4 * ROWS


class _Spy:
    """Stands in for a jit kernel in ``states`` or ``dstates``: records its name and each
    launch's BKS."""

    def __init__(self, kernel, name: str, calls: list):
        self.kernel, self.name, self.calls = kernel, name, calls
        self.value_blocks: list = []  # each launch's BV
        self.has_p: list = []  # each launch's HAS_P (the split kernels': P read, not formed)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append((self.name, kwargs.get("BKS")))
            self.value_blocks.append(kwargs.get("BV"))
            self.has_p.append(kwargs.get("HAS_P"))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def split(monkeypatch):
    """Returns ``on(rows)``: sets STATES_SPLIT_K and returns the list of (kernel, BKS) launched
    from then on."""
    calls: list = []
    for name in KERNELS:
        module = dstates if "dstates" in name else states  # the launcher's module
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), name, calls))

    def on(rows: int) -> list:
        monkeypatch.setattr(states, "STATES_SPLIT_K", rows)
        monkeypatch.setattr(states, "SPLIT_MIN_ROWS", ROWS)
        # the interpreter's "auto" forward is fused; a GPU's, at these few programs, two-pass
        # (triton_backend._use_two_pass): the same form on both (tests override it)
        monkeypatch.setattr(triton_backend, "FORWARD_MODE", "fused")
        return calls

    return on


def on_device(inputs: dict) -> dict:
    return {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}


def inputs_for(rule: str, B: int, T: int, Dk: int, Dv: int, dtype=torch.float32, **kw) -> dict:
    x = make_inputs(B, T, 1, Dk, Dv, rule=rule, dtype=dtype, **kw)
    if not RULES[rule].needs_beta:
        x["beta"] = None
    return on_device(x)


def run(inputs: dict, backend: str, grads: bool, **kwargs) -> list:
    """Outputs and final state, then (``grads``) all six gradients of a loss weighing both."""
    if not grads:
        return list(delta_rule(**inputs, output_final_state=True, backend=backend, **kwargs))
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def assert_matches_reference(inputs: dict, tol: float = 1e-4, grads: bool = True, **kwargs):
    reference = {n: None if t is None else t.double() for n, t in inputs.items()}
    ref, got = run(reference, "reference", grads, **kwargs), run(inputs, "triton", grads, **kwargs)
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= tol, (name, rel_err(g, g_ref))


# ---------------------------------------------------------------------------- the block rows
def test_split_rows(monkeypatch):
    for rows, BK, dtype, want in [
        (0, 256, torch.bfloat16, 0),  # off
        (64, 256, torch.bfloat16, 64),
        (128, 256, torch.bfloat16, 128),
        (128, 128, torch.bfloat16, 0),  # not below the key block: today's kernels
        (32, 128, torch.bfloat16, 64),  # half precision: never under HALF_MIN_BLOCK
        (16, 64, torch.float16, 0),
        (16, 64, torch.float32, 16),
        (16, 256, torch.float32, 64),  # at most four blocks
        (16, 16, torch.float32, 0),
    ]:
        monkeypatch.setattr(states, "STATES_SPLIT_K", rows)
        monkeypatch.setattr(states, "SPLIT_MIN_ROWS", 16)
        assert states.split_rows(BK, dtype) == want, (rows, BK, dtype)
    monkeypatch.undo()
    monkeypatch.setattr(states, "STATES_SPLIT_K", 16)
    assert states.SPLIT_MIN_ROWS == 64  # what the GPU launches: never a block under 64 rows
    assert [states.split_rows(BK, torch.float32) for BK in (64, 128, 256)] == [0, 64, 64]


# ---------------------------------------------------------------------------- forward, backward
# Each rule once, negative eigenvalues on every other one (never trapezoid: μ ∈ (−3, 1] diverges
# by design, the op warns). The split kernels take no rule and no flag: both reach them only
# through prepare's W and Ũ (and the gradient kernels after them), whose every rule x flag
# tests/test_triton_interpret.py checks; each rule's values pass through them here.
EVERY_RULE = [(r, i % 2 == 0 and r != "trapezoid") for i, r in enumerate(triton_rules())]


@pytest.mark.parametrize("rule, ne", EVERY_RULE)
def test_every_rule(rule, ne, split):
    # four blocks of the key head; Dk != Dv; two chunks, the second ragged
    calls = split(ROWS)
    inputs = inputs_for(rule, 1, 100, DK4, 32, seed=2)
    assert_matches_reference(inputs, rule=rule, negative_eigenvalues=ne)
    assert set(calls) == {(name, ROWS) for name in FWD_BWD}


# Dk, Dv, STATES_SPLIT_K. (100, 72): a key block of 128 whose last block holds 4 real rows (in
# 32-row blocks); (16, 64): fp32's key block of 64 for a wider value head, three of its four
# blocks all padding. On a GPU (64-row blocks): 8 real rows, and one block all padding.
HEADS = [(128, 64, 64), (64, 128, 16), (100, 72, 32), (16, 64, 16)]
if DEVICE == "cuda":
    HEADS = [(128, 64, 64), (256, 128, 64), (200, 72, 64), (130, 64, 64)]


@pytest.mark.parametrize("T", [1, 65, 130])
@pytest.mark.parametrize("Dk, Dv, rows", HEADS)
def test_lengths_and_heads(T, Dk, Dv, rows, split, monkeypatch):
    calls = split(rows)
    state, decay = T != 65, T != 130
    x = inputs_for("longhorn", 1, T, Dk, Dv, decay=decay, initial_state=state, seed=T + Dk)
    mode = "two_pass" if T == 65 else "fused"  # the forward's two forms
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    assert_matches_reference(x, rule="longhorn")
    first = "split_states_kernel" if mode == "two_pass" else "split_forward_kernel"
    names = [first, "split_states_kernel", "split_dstates_kernel"]
    assert calls == [(name, rows) for name in names]


def test_packed_sequences_of_unequal_lengths(split):
    calls = split(ROWS)
    lengths = [0, 5, 64, 0, 130, 1, 65]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    x = inputs_for("efla", 1, sum(lengths), DK4, 48, n_states=len(lengths), seed=5)
    assert_matches_reference(x, rule="efla", cu_seqlens=cu)
    without_states = dict(x, initial_state=None)
    assert_matches_reference(without_states, rule="efla", negative_eigenvalues=True, cu_seqlens=cu)
    assert calls == [(name, ROWS) for name in FWD_BWD] * 2


def test_half_precision(split):
    # bf16 on a GPU, fp16 in the interpreter (whose bf16 dot is wrong): two 64-row blocks
    calls = split(64)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = make_inputs(1, 130, 1, 128, 64, rule="delta", dtype=torch.float32, seed=6)
    for n in ("q", "k", "v"):
        x[n] = x[n].to(dtype)
    x = on_device(x)
    ref = run({n: t.double() for n, t in x.items()}, "reference", True, rule="delta")
    got = run(x, "triton", True, rule="delta")
    for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
        assert rel_err(g, g_ref) <= 1e-2, (name, rel_err(g, g_ref))
    assert calls == [(name, 64) for name in FWD_BWD]


def test_wide_head_blocks_not_split_below_the_switch(split):
    # a key block no wider than STATES_SPLIT_K runs today's kernels
    calls = split(64)
    assert_matches_reference(inputs_for("delta", 1, 70, 64, 32, seed=3), rule="delta")
    assert calls == [(n, None) for n in KERNELS[:3]]


def test_reverse_pass_rows_by_default():
    # the reverse pass in 64-row blocks at D = 256 only (DSTATES_SPLIT_ABOVE_BK), 128-row blocks
    # nowhere else: D = 128 and narrower stay whole, in every dtype
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert states.split_rows(256, dtype, dstates.dstates_split_k(256)) == 64
        assert states.split_rows(256, dtype) == 128  # the other passes'
        for BK in (16, 32, 64, 128):
            assert states.split_rows(BK, dtype, dstates.dstates_split_k(BK)) == 0, (BK, dtype)


@pytest.mark.parametrize("Dk, Dv", [(DK4, 32), (100 if DEVICE == "cpu" else 200, 72)])
def test_reverse_pass_split_alone(Dk, Dv, split, monkeypatch):
    # DSTATES_SPLIT_K: the reverse pass alone in row blocks, the forward's and the recomputed
    # state pass unsplit; its value block (DSTATES_BV, here the fp32 floor's 16 columns) reaches
    # the split launch
    calls = split(0)
    monkeypatch.setattr(dstates, "DSTATES_SPLIT_K", ROWS)
    monkeypatch.setattr(dstates, "DSTATES_SPLIT_ABOVE_BK", 0)  # at every key block (128 by default)
    monkeypatch.setattr(dstates, "DSTATES_BV", ROWS // 2)
    x = inputs_for("gated_efla", 1, 130, Dk, Dv, initial_state=True, seed=Dk + Dv)
    assert_matches_reference(x, rule="gated_efla")
    rows = states.split_rows(key_block(Dk, Dv, torch.float32), torch.float32, ROWS)
    assert rows  # (100, 72): a key block of 128 in blocks of 32, its fourth holding 4 real rows
    assert calls == [(KERNELS[0], None), (KERNELS[1], None), ("split_dstates_kernel", rows)]
    assert dstates.split_dstates_kernel.value_blocks == [ROWS // 2]


@pytest.mark.parametrize("stages, warps", [(1, 0), (2, 8)])
def test_split_forward_alone(stages, warps, split, monkeypatch):
    # SPLIT_FORWARD_*: the fused forward in its own row blocks, stages (one: the keys loaded
    # again for the update, KEEP_K off) and warps; the backward's passes unsplit
    calls = split(0)
    for name, value in [("SPLIT_FORWARD_K", ROWS), ("SPLIT_FORWARD_STAGES", stages),
                        ("SPLIT_FORWARD_WARPS", warps)]:  # fmt: skip
        monkeypatch.setattr(states, name, value)
    x = inputs_for("delta", 1, 130, DK4, 32, initial_state=True, seed=stages)
    assert_matches_reference(x, rule="delta")
    assert calls[0] == ("split_forward_kernel", ROWS)
    assert all(bks is None for _, bks in calls[1:]), calls


def test_split_forward_takes_p_where_it_was_checked():
    # on by default at D = 256 (the split forward) in bf16 and fp32; never in fp16 (wrong on the
    # H200, session 23 call 5), nor where the forward does not split (D ≤ 128)
    assert states.SPLIT_FORWARD_P
    assert states.forward_takes_p(256, 256, torch.bfloat16)
    assert states.forward_takes_p(256, 256, torch.float32)
    assert not states.forward_takes_p(256, 256, torch.float16)
    assert not states.forward_takes_p(128, 128, torch.bfloat16)


def test_split_forward_reads_p(split, monkeypatch):
    # SPLIT_FORWARD_P: the prepare forms (5)'s P once a chunk and the split forward reads it;
    # packed sequences of unequal lengths (empty and partial chunks: P's rows are per chunk),
    # initial states, and outputs equal to the P-forming kernel's to fp32 summation order
    lengths = [0, 5, 64, 0, 130, 1, 65]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    x = inputs_for("gated_efla", 1, sum(lengths), DK4, 48, n_states=len(lengths), seed=9)
    calls = split(ROWS)
    monkeypatch.setattr(states, "SPLIT_FORWARD_P", True)
    assert_matches_reference(x, rule="gated_efla", cu_seqlens=cu)
    assert calls[0] == ("split_forward_kernel", ROWS)
    with_p = run(x, "triton", False, rule="gated_efla", cu_seqlens=cu)
    monkeypatch.setattr(states, "SPLIT_FORWARD_P", False)
    without = run(x, "triton", False, rule="gated_efla", cu_seqlens=cu)
    for name, a, b in zip(["o", "state"], with_p, without):
        assert rel_err(a, b) <= 1e-6, name


def test_reverse_pass_takes_p_where_it_splits(monkeypatch):
    # DSTATES_P on by default (session 24 call 3): at D = 256 (where the reverse pass splits) in
    # bf16 and fp32, never in fp16 (DSTATES_P_SKIP, as the forward's) nor at D ≤ 128 (unsplit)
    assert dstates.DSTATES_P and dstates.dstates_takes_p(256, 256, torch.bfloat16)
    assert dstates.dstates_takes_p(256, 256, torch.float32)
    assert not dstates.dstates_takes_p(256, 256, torch.float16)
    for dtype in (torch.bfloat16, torch.float32):
        assert not dstates.dstates_takes_p(128, 128, dtype)
    monkeypatch.setattr(dstates, "DSTATES_P", False)
    assert not dstates.dstates_takes_p(256, 256, torch.bfloat16)


# rule, T, decay, negative eigenvalues, packed lengths (None: one sequence of T tokens)
REVERSE_P = [
    ("delta", 130, True, True, None),
    ("kaczmarz", 65, False, False, None),
    ("delta", 1, True, False, None),
    ("gated_efla", None, True, True, [0, 5, 64, 0, 130, 1, 65]),
]


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rule, T, decay, ne, lengths", REVERSE_P)
def test_split_reverse_pass_reads_p(rule, T, decay, ne, lengths, half, split, monkeypatch):
    # DSTATES_P: the backward's rebuild (SAVE_FOR_BACKWARD "t") forms scale·P once a chunk and
    # the split reverse pass reads it, the forward's passes unsplit: every gradient the float64
    # reference's, and the P-forming pass's to its summation order (P's one rounding to DT in
    # half precision). fp32 in blocks of ROWS; half precision (fp16 in the interpreter, with
    # DSTATES_P_SKIP emptied: bf16 on a GPU) in 64-row blocks of a 128-row key head.
    dtype = (torch.bfloat16 if DEVICE == "cuda" else torch.float16) if half else torch.float32
    rows, Dk, Dv = (64, 128, 64) if half else (ROWS, DK4, 32)
    calls = split(0)
    for name, value in [("DSTATES_SPLIT_K", rows), ("DSTATES_SPLIT_ABOVE_BK", 0),
                        ("DSTATES_P_SKIP", ())]:  # fmt: skip
        monkeypatch.setattr(dstates, name, value)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "off")
    assert triton_backend.SAVE_FOR_BACKWARD == "t"  # the rebuild runs: the only P's source
    n = 1 if lengths is None else len(lengths)
    kw = dict(rule=rule, negative_eigenvalues=ne)
    if lengths is not None:
        kw["cu_seqlens"] = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    x = make_inputs(1, T or sum(lengths), 1, Dk, Dv, rule=rule, dtype=torch.float32,
                    decay=decay, n_states=n, seed=Dk + (T or 7))  # fmt: skip
    if not RULES[rule].needs_beta:
        x["beta"] = None
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    x = on_device(x)
    ref = run({m: None if t is None else t.double() for m, t in x.items()}, "reference", True, **kw)
    monkeypatch.setattr(dstates, "DSTATES_P", True)
    with_p = run(x, "triton", True, **kw)
    monkeypatch.setattr(dstates, "DSTATES_P", False)
    without = run(x, "triton", True, **kw)
    assert calls == [(KERNELS[0], None), (KERNELS[1], None), ("split_dstates_kernel", rows)] * 2
    assert dstates.split_dstates_kernel.has_p == [True, False]
    tol, same = (1e-2, 2e-3) if half else (1e-4, 1e-5)
    for name, g, g0, g_ref in zip(["o", "state", *NAMES], with_p, without, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= tol, (name, rel_err(g, g_ref))
            assert rel_err(g, g0) <= same, (name, rel_err(g, g0))


def test_sequence_parallel_passes(split, monkeypatch):
    # the segmented passes' step 3 is launch_states / launch_dstates: split there too
    calls = split(ROWS)
    # the reverse pass's step 3 at its own rows (segment_states.SEGMENT_DSTATES_SPLIT_K: 64 on
    # a GPU, where the interpreter's head of four 16-row blocks would not split)
    monkeypatch.setattr(segment_states, "SEGMENT_DSTATES_SPLIT_K", ROWS)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    x = inputs_for("delta", 1, 200, DK4, 32, seed=9)
    assert_matches_reference(x, rule="delta")
    assert calls == [("split_states_kernel", ROWS)] * 2 + [("split_dstates_kernel", ROWS)]


def test_segments_step_3_in_its_own_blocks_and_register_cap(split, monkeypatch):
    # SEGMENT_STATES_* / SEGMENT_DSTATES_*: the segments' step 3 split (and capped) while a
    # sequence-long pass would not be (STATES_SPLIT_K off)
    calls = split(0)
    for name, value in [("STATES_SPLIT_K", ROWS), ("STATES_MAXNREG", 168),
                        ("DSTATES_SPLIT_K", ROWS), ("DSTATES_MAXNREG", 168)]:  # fmt: skip
        monkeypatch.setattr(segment_states, f"SEGMENT_{name}", value)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    x = inputs_for("kaczmarz", 1, 200, DK4, 32, initial_state=True, seed=10)
    assert_matches_reference(x, rule="kaczmarz")
    assert calls == [("split_states_kernel", ROWS)] * 2 + [("split_dstates_kernel", ROWS)]


@pytest.mark.parametrize(
    "mode, name, value, p",
    [("fused", "k", NAN, False), ("fused", "k", INF, True), ("two_pass", "v", INF, False)],
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_stays_causal(mode, name, value, p, split, monkeypatch):
    # test_nonfinite_causal's check at a head the blocks split: a bad token in the second chunk
    # (with P from the prepare too: the bad key's column of P is masked above the diagonal)
    calls = split(ROWS)
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    monkeypatch.setattr(states, "SPLIT_FORWARD_P", p)
    x = make_inputs(2, 130, 2, DK4, 24, rule="delta", dtype=torch.float32, seed=84)
    x[name][1, 84, 1, 3] = value
    o_ref, s_ref = delta_rule(**x, rule="delta", output_final_state=True, backend="reference")
    o, s = delta_rule(**on_device(x), rule="delta", output_final_state=True, backend="triton")
    assert_causal(o.cpu(), s.cpu(), o_ref, s_ref, 84, 1e-4)
    first = "split_forward_kernel" if mode == "fused" else "split_states_kernel"
    assert calls == [(first, ROWS)]


# ---------------------------------------------------------------------------- bf16 on the GPU
# The launch settings benchmarks/NOTES.md (issue 32, session 18) times (split128 won in session
# 19 and is the default), each compiled and checked in bf16 at both head sizes before any timing
# (a kernel that faults takes the timing run with it)
GPU_VARIANTS = {
    "split64": dict(STATES_SPLIT_K=64),
    "split64_wide8": dict(STATES_SPLIT_K=64, SPLIT_WIDE_WARPS=8),
    "split128": dict(STATES_SPLIT_K=128),
    "split64_fused1": dict(STATES_SPLIT_K=64, FUSED_STAGES=1),
    "split64_states2": dict(STATES_SPLIT_K=64, STATES_STAGES=2),
}


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 kernels: the interpreter's bf16 dot is wrong")
@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("variant", sorted(GPU_VARIANTS))
def test_bf16_variants_no_worse_than_today(variant, D, monkeypatch):
    # fused forward and backward in bf16 against the float64 reference, each output's error
    # within 1.5x today's kernels' (+1e-3: the split forward rounds U, not the keys, for (6))
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", "fused")
    x = make_inputs(2, 300, 2, D, D, rule="delta", dtype=torch.float32, seed=D)
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.bfloat16)
    x = on_device(x)
    ref = run({n: t.double() for n, t in x.items()}, "reference", True, rule="delta")
    monkeypatch.setattr(states, "STATES_SPLIT_K", 0)  # the unsplit kernels (128 is the default)
    today = run(x, "triton", True, rule="delta")
    for name, value in GPU_VARIANTS[variant].items():
        monkeypatch.setattr(states, name, value)
    assert states.split_rows(D, torch.bfloat16) or D == 128 and variant == "split128"
    got = run(x, "triton", True, rule="delta")
    for name, g, g0, g_ref in zip(["o", "state", *NAMES], got, today, ref):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, g_ref) <= 1.5 * rel_err(g0, g_ref) + 1e-3, (name, rel_err(g, g_ref))
