"""The backward's recomputed state pass forming W and Ũ from the kept T itself
(``states.rebuilds_w_u``, ``states.STATES_REBUILD_MAX_BK``; issue 32, session 25) instead of the
rebuild kernel (rebuild.py): every gradient the float64 reference's and the rebuild's (to the
bit on the interpreter, which runs both forms' products alike), the rebuild not launched where
the pass folds it and launched where it does not (wider key blocks, split or segmented passes),
on the GPU or the CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow.rules import RULES

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_state_pass_variants import DEVICE, NAMES, run  # noqa: E402

from deltaflow.ops.triton import states  # noqa: E402

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter has no bf16 dots


@pytest.fixture
def rebuilds(monkeypatch):
    """Counts the rebuild kernel's launches (a list the test reads)."""
    calls: list = []
    launch = triton_backend.launch_rebuild

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "launch_rebuild", counted)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "off")
    assert triton_backend.SAVE_FOR_BACKWARD == "t"  # the kept T the pass reads
    return calls


def _inputs(rule, T, Dk, Dv, dtype, decay=True, lengths=None, seed=0):
    n = 1 if lengths is None else len(lengths)
    x = make_inputs(1, T if lengths is None else sum(lengths), 2, Dk, Dv, rule=rule,
                    dtype=torch.float32, decay=decay, n_states=n, seed=seed)  # fmt: skip
    if not RULES[rule].needs_beta:
        x["beta"] = None
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    x = {m: None if t is None else t.to(DEVICE) for m, t in x.items()}
    kw = {} if lengths is None else {"cu_seqlens": torch.tensor([0] + lengths).cumsum(0).to(DEVICE)}
    return x, kw


def _run(inputs, backend, **kw):
    """The six input gradients (test_state_pass_variants.run's, without o and the state)."""
    return run(inputs, backend, True, **kw)[2:]


# rule, T (None: packed lengths), Dk, Dv, half precision, decay, negative eigenvalues, lengths
CASES = [
    ("delta", 130, 32, 32, False, True, True, None),
    ("kaczmarz", 65, 16, 32, True, False, False, None),
    ("gated_efla", None, 32, 16, False, True, True, [0, 5, 64, 0, 130, 1, 65]),
    ("longhorn", 1, 32, 32, True, True, False, None),
    ("delta", 70, 64, 64, True, True, False, None),
]


@pytest.mark.parametrize("rule, T, Dk, Dv, half, decay, ne, lengths", CASES)
def test_gradients_as_the_rebuilds(rule, T, Dk, Dv, half, decay, ne, lengths, rebuilds,
                                   monkeypatch):  # fmt: skip
    dtype = HALF if half else torch.float32
    x, kw = _inputs(rule, T, Dk, Dv, dtype, decay, lengths, seed=Dk + Dv)
    kw.update(rule=rule, negative_eigenvalues=ne)
    ref = _run({m: None if t is None else t.double() for m, t in x.items()}, "reference", **kw)
    folded = _run(x, "triton", **kw)
    assert not rebuilds  # the pass formed W and Ũ
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)
    rebuilt = _run(x, "triton", **kw)
    assert rebuilds == [1]
    tol, same = (1e-2, 2e-3) if half else (1e-4, 1e-6)
    if DEVICE == "cpu":
        same = 0.0  # the interpreter: the same products in the same order
    for name, g, g0, g_ref in zip(NAMES, folded, rebuilt, ref):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= tol, (name, rel_err(g, g_ref))
            assert rel_err(g, g0) <= same, (name, rel_err(g, g0))


def test_a_value_row_that_is_not_finite(rebuilds, monkeypatch):
    # the rebuild zeroes a value row that is not finite before Ũ's product; the folding pass
    # does the same over the same columns: the same gradients, NaN where the rebuild's are
    x, kw = _inputs("delta", 100, 32, 32, torch.float32, seed=3)
    x["v"][0, 70, 1, 5] = float("nan")
    folded = _run(x, "triton", **kw)
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)
    rebuilt = _run(x, "triton", **kw)
    assert rebuilds == [1]
    for name, g, g0 in zip(NAMES, folded, rebuilt):
        if g is not None:
            assert torch.equal(g.isnan(), g0.isnan()), name
            if DEVICE == "cpu":
                assert torch.equal(g.nan_to_num(), g0.nan_to_num()), name


def test_where_the_pass_folds_the_rebuild(monkeypatch):
    k = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    assert states.STATES_REBUILD_MAX_BK == 64  # session 25 call 1: a win at D = 64 only
    assert states.rebuilds_w_u(k, k)
    assert states.rebuilds_w_u(k.float(), k.float())
    wide = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    assert not states.rebuilds_w_u(wide, wide) and not states.rebuilds_w_u(wide, k)
    monkeypatch.setattr(states, "STATES_SPLIT_K", 16)  # the pass in row blocks: no fold
    monkeypatch.setattr(states, "SPLIT_MIN_ROWS", 16)
    assert not states.rebuilds_w_u(k.float(), k.float())
    monkeypatch.undo()
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)
    assert not states.rebuilds_w_u(k, k)


def test_segmented_pass_keeps_the_rebuild(rebuilds, monkeypatch):
    # the segments' passes read W and Ũ: the rebuild runs, the gradients as without segments
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 2)
    x, kw = _inputs("delta", 300, 32, 32, torch.float32, seed=4)
    ref = _run({m: None if t is None else t.double() for m, t in x.items()}, "reference", **kw)
    got = _run(x, "triton", **kw)
    assert rebuilds == [1]
    for name, g, g_ref in zip(NAMES, got, ref):
        if g is not None:
            assert rel_err(g, g_ref) <= 1e-4, (name, rel_err(g, g_ref))
