"""The backward's recomputed state pass on a second CUDA stream, beside the reverse pass
(deltaflow/ops/streams.py, issue 32 session 24).

On the CPU (the interpreter) the streams are stood in for by recorders, which check the wiring:
the state pass launched inside the side stream's block, the reverse pass outside it, the join
after both and before the gradients, with the state pass's outputs named, and the gradients the
same as with the passes in turn (the two passes no longer share the initial state's gradient
buffer). On a GPU the real streams: gradients equal to the bit with and without, dense,
segmented and packed batches, with and without an initial state."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _inputs import make_inputs

from deltaflow import delta_rule
from deltaflow.ops import streams

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]


def _grads(inputs: dict, cu_seqlens=None) -> list[torch.Tensor]:
    """Outputs, final state and every input's gradient (the final state's gradient given too)."""
    leaves = {n: (x.detach().clone().requires_grad_(True) if x is not None else None)
              for n, x in inputs.items()}  # fmt: skip
    o, state = delta_rule(**leaves, rule="delta", output_final_state=True,
                          cu_seqlens=cu_seqlens, backend="triton")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g).to(o)
    ds = torch.randn(state.shape, generator=g).to(state)
    ((o.float() * do).sum() + (state.float() * ds).sum()).backward()
    return [o, state] + [leaves[n].grad for n in NAMES if leaves.get(n) is not None]


def _inputs(dtype, T=130, B=2, H=2, D=32, initial=True, n_states=None) -> dict:
    x = make_inputs(B, T, H, D, D, dtype=dtype, initial_state=initial, n_states=n_states)
    return {n: None if x[n] is None else x[n].to(DEVICE) for n in NAMES}


def test_fork_is_none_off_the_gpu(monkeypatch):
    assert streams.fork(torch.device("cpu")) is None
    with streams.on(None):
        pass
    streams.join(None, torch.zeros(1))  # nothing to wait for
    if torch.cuda.is_available():
        monkeypatch.setattr(streams, "CONCURRENT_STATE_PASSES", False)
        assert streams.fork(torch.device("cuda", torch.cuda.current_device())) is None


@pytest.mark.parametrize("initial", [True, False])
def test_the_state_pass_runs_beside_the_reverse_pass(monkeypatch, initial):
    """Stand-in streams record where each launcher ran; the gradients as with the passes in turn."""
    inputs = _inputs(torch.float32, initial=initial)
    monkeypatch.setattr(streams, "CONCURRENT_STATE_PASSES", False)
    expected = _grads(inputs)

    events: list[tuple[str, bool]] = []
    buffers: list[int] = []  # concurrent passes must not write one buffer
    side = object()
    inside = [False]

    @contextlib.contextmanager
    def on(s):
        assert s is side
        inside[0] = True
        yield
        inside[0] = False

    def join(s, *made):
        assert s is side and len(made) == 2 and all(isinstance(t, torch.Tensor) for t in made)
        events.append(("join", inside[0]))

    def recorder(name):
        real = getattr(triton_backend, name)

        def launch(*args, **kwargs):
            events.append((name, inside[0]))
            buffer = kwargs.get("final_state", kwargs.get("d_initial_state"))
            if buffer is not None:  # the state pass's final state, the reverse pass's ds0
                buffers.append(buffer.data_ptr())
            return real(*args, **kwargs)

        monkeypatch.setattr(triton_backend, name, launch)

    for name in ("launch_states", "launch_dstates", "launch_gradients"):
        recorder(name)
    monkeypatch.setattr(streams, "fork", lambda device: side)
    monkeypatch.setattr(streams, "on", on)
    monkeypatch.setattr(streams, "join", join)
    got = _grads(inputs)
    assert len(buffers) == 2 and buffers[0] != buffers[1]
    assert events == [("launch_states", True), ("launch_dstates", False), ("join", False),
                     ("launch_gradients", False)]  # fmt: skip
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="two CUDA streams: GPU only")
@pytest.mark.parametrize("case", ["dense", "dense_no_initial", "segments", "packed", "bf16_d128"])
def test_gradients_the_same_to_the_bit_on_two_streams(monkeypatch, case):
    dtype = torch.bfloat16 if case == "bf16_d128" else torch.float32
    D = 128 if case == "bf16_d128" else 64
    cu = None
    if case == "packed":  # four sequences in one row, one of a single token
        inputs = _inputs(dtype, T=1000, B=1, H=4, D=D, n_states=4)
        cu = torch.tensor([0, 1, 330, 700, 1000], device=DEVICE, dtype=torch.int32)
    else:
        inputs = _inputs(dtype, T=1000, B=4, H=4, D=D, initial=case != "dense_no_initial")
    if case == "segments":
        monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
        monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 4)
    monkeypatch.setattr(streams, "CONCURRENT_STATE_PASSES", False)
    expected = _grads(inputs, cu)
    monkeypatch.setattr(streams, "CONCURRENT_STATE_PASSES", True)
    for _ in range(3):  # the allocator's reuse across calls too
        got = _grads(inputs, cu)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
