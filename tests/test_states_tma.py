"""The recomputed state pass's trial forms (issue 32, session 28): h and U stored through TMA
descriptors (``states.STATES_TMA_STORE``), k, W, Ũ loaded through them (``STATES_TMA_LOAD``),
log α read a chunk ahead (``STATES_G_AHEAD``). Every output and gradient bit for bit the plain
pass's, on packed sequences (an empty one, one token, lengths off the chunk), with decay and
initial states, on the interpreter and on a GPU; the forms were taken (not silently off)."""

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
FORMS = {
    "store": {"STATES_TMA_STORE": True},
    "load": {"STATES_TMA_LOAD": True},
    "g_ahead": {"STATES_G_AHEAD": True},
    "all": {"STATES_TMA_STORE": True, "STATES_TMA_LOAD": True, "STATES_G_AHEAD": True},
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("D", [64, 96])  # the key block the head (h stored by TMA), or wider
def test_state_pass_forms_change_no_value(form, D, monkeypatch):
    lengths = [0, 70, 1, 133]
    x = make_inputs(1, sum(lengths), 2, D, D, rule="delta", seed=D, n_states=len(lengths),
                    dtype=torch.bfloat16)  # fmt: skip
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    monkeypatch.setattr(states, "STATES_REBUILD_MAX_BK", 0)  # W and Ũ read: the loads' path
    plain = _fwd_bwd(x, "triton", cu_seqlens=cu)
    taken = []
    tma_args = states._tma_args

    def spy(*args):
        got = tma_args(*args)
        taken.append(got)
        return got

    monkeypatch.setattr(states, "_tma_args", spy)
    for name, value in FORMS[form].items():
        monkeypatch.setattr(states, name, value)
    trial = _fwd_bwd(x, "triton", cu_seqlens=cu)
    assert taken, "the unsplit state pass did not run"
    if "STATES_TMA_STORE" in FORMS[form]:
        assert all(t["TMA_ST"] == (D == 64) for t in taken)
    if "STATES_TMA_LOAD" in FORMS[form]:
        assert all(t["TMA_LD"] for t in taken)
    for a, b in zip(plain, trial):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
