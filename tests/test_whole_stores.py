"""Stores without masks where the tile is whole (``states.STATES_WHOLE_STORES``: the state
pass's h where the key block is the head and the value blocks divide it, U in whole chunks):
every output and gradient bit for bit the masked stores', on packed sequences
whose last chunks are partial (an empty one, one token), with decay and initial states, through
the fused and the two-pass forward, at a head the key block covers exactly and one it does not
(the masked stores throughout), on the interpreter and a GPU."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_grads_variants import _fwd_bwd  # noqa: E402

from deltaflow.ops.triton import states  # noqa: E402 - after the skip

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", [64, 48])
@pytest.mark.parametrize("mode", ["fused", "two_pass"])
def test_whole_stores_change_no_value(mode, D, dtype, monkeypatch):
    lengths = [0, 130, 1, 75]
    x = make_inputs(1, sum(lengths), 2, D, D, rule="delta", seed=3, n_states=len(lengths),
                    dtype=dtype)  # fmt: skip
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)  # the plain state pass
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    runs = []
    for whole in (False, True):
        monkeypatch.setattr(states, "STATES_WHOLE_STORES", whole)
        runs.append(_fwd_bwd(x, "triton", cu_seqlens=cu))
    for a, b in zip(*runs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
