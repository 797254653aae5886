"""The sequential passes' log α (and the fused forward's first_bad) loaded a chunk ahead, and
the lean key side's before its value loop (``common.LOG_ALPHA_AHEAD``; issue 32, session 28):
every output and gradient bit for bit what the step-by-step loads give, NaNs where they fall
included, on packed sequences (an empty one, one token, lengths off the chunk), with decay and
initial states, through the fused and the two-pass forward, the state pass reading W and Ũ or
forming them from T, the lean gradient kernels, on the interpreter and on a GPU."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_grads_variants import _fwd_bwd  # noqa: E402

from deltaflow.ops.triton import common, gradients, states  # noqa: E402 - after the skip

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on a GPU only: the interpreter's bf16 products are not the GPU's (overflowing numpy)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def packed_inputs(lengths: list[int], D: int, seed: int, dtype: torch.dtype):
    """delta's inputs for packed sequences of ``lengths`` (decay, initial states, D-wide heads)
    on DEVICE, with their offsets."""
    x = make_inputs(1, sum(lengths), 2, D, D, rule="delta", seed=seed, n_states=len(lengths),
                    dtype=dtype)  # fmt: skip
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    return x, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)


def same_either_way(x, cu, monkeypatch, module, switch: str) -> list:
    """The outputs and gradients with ``module.switch`` off, then on, asserted equal bit for bit
    (NaN where NaN); the runs returned."""
    runs = []
    for on in (False, True):
        monkeypatch.setattr(module, switch, on)
        runs.append(_fwd_bwd(x, "triton", cu_seqlens=cu))
    for a, b in zip(*runs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return runs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("rebuild", [64, 0], ids=["w_from_t", "w_read"])
@pytest.mark.parametrize("mode", ["fused", "two_pass"])
def test_log_alpha_ahead_changes_no_value(mode, rebuild, poisoned, dtype, monkeypatch):
    x, cu = packed_inputs([0, 130, 1, 75], 64, seed=7, dtype=dtype)
    if poisoned:  # a non-finite value in the second sequence's second chunk (log α is refused)
        x["v"][0, 100, 1, 3] = float("nan")
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", rebuild)
    monkeypatch.setattr(gradients, "GRADS_LEAN", "on")  # the key side's log α read early
    runs = same_either_way(x, cu, monkeypatch, common, "LOG_ALPHA_AHEAD")
    if poisoned:
        o = runs[1][0]  # NaN from the bad token on in its head, nowhere before it
        assert o[0, 100:130, 1].isnan().all() and not o[0, :100].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("passes", ["split", "segments"])
def test_log_alpha_ahead_in_split_and_segment_passes(passes, dtype, monkeypatch):
    """The forward with the state in row blocks (states_split.py: STATES_SPLIT_K lowered so a
    64-row key block splits) and the segments' state pass (segment_states.py: two chunks a
    segment) take the same loads a step ahead, bit for bit."""
    x, cu = packed_inputs([0, 200, 1, 75], 64, seed=11, dtype=dtype)
    if passes == "split":
        monkeypatch.setattr(states, "STATES_SPLIT_K", 32)
        monkeypatch.setattr(states, "SPLIT_MIN_ROWS", 32)
    else:
        monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
        monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 2)
    same_either_way(x, cu, monkeypatch, common, "LOG_ALPHA_AHEAD")
