"""A second CUDA stream for the backward's two state passes (issue 32, session 24).

The backward recomputes the forward state pass (h and U, ``triton/states.py``) and runs the
reverse state-gradient pass (dh and dU). Both read the rebuild's W but neither reads the other's
outputs, and each is one chain of chunks per sequence, head and value block: at D ≤ 128 a chain
waits on its loads more than on the GPU's bandwidth (session 22's ncu: the reverse pass at
(8, 4096, 16, 128) takes 0.54 ms for bytes a 0.2 ms floor moves). Run side by side, one pass's
programs fill the other's waits (``benchmarks/NOTES.md``, "Issue 32, session 24").

Usage: ``side = fork(device)``; the work inside ``with on(side):`` runs on the side stream,
concurrent with whatever the current stream is given next; ``join(side, *made)`` makes the
current stream wait for it. Every step is a no-op where ``fork`` returned None (off, or not
CUDA), so callers need no second code path. CUDA-graph capture records the fork and join as
graph edges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

# The backward's recomputed state pass beside its reverse pass (False: one after the other, the
# order of every session before 24; the gradients are the same either way, to the bit).
CONCURRENT_STATE_PASSES = True

_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # one side stream a device, made on first use


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """A side stream that has waited for everything the current stream was given so far, or
    None where the work stays on one stream."""
    if not CONCURRENT_STATE_PASSES or device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    side = _SIDE[device]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


@contextlib.contextmanager
def on(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Launches (and allocations) inside go to ``side`` when it is a stream."""
    if side is None:
        yield
    else:
        with torch.cuda.stream(side):
            yield


def join(side: torch.cuda.Stream | None, *made: Tensor | None) -> None:
    """The current stream waits for ``side``'s work; ``made`` (tensors allocated on the side
    stream and used afterwards) are marked in use by the current stream, so that the caching
    allocator does not hand their memory to the side stream again before the current stream's
    work on them is done."""
    if side is None:
        return
    current = torch.cuda.current_stream(side.device)
    current.wait_stream(side)
    for tensor in made:
        if tensor is not None:
            tensor.record_stream(current)
