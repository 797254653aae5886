"""Stores without masks where the tile is whole (``states.STATES_WHOLE_STORES``: the state
pass's h where the key block is the head and the value blocks divide it, U in whole chunks):
every output and gradient bit for bit the masked stores', on packed sequences
whose last chunks are partial (an empty one, one token), with decay and initial states, through
the fused and the two-pass forward, at a head the key block covers exactly and one it does not
(the masked stores throughout), on the interpreter and a GPU."""

from __future__ import annotations

import pytest

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_log_alpha_ahead import DTYPES, packed_inputs, same_either_way  # noqa: E402

from deltaflow.ops.triton import states  # noqa: E402 - after the skip


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", [64, 48])
@pytest.mark.parametrize("mode", ["fused", "two_pass"])
def test_whole_stores_change_no_value(mode, D, dtype, monkeypatch):
    x, cu = packed_inputs([0, 130, 1, 75], D, seed=3, dtype=dtype)
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)  # the plain state pass
    monkeypatch.setattr(triton_backend, "FORWARD_MODE", mode)
    same_either_way(x, cu, monkeypatch, states, "STATES_WHOLE_STORES")
