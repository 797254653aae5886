"""Token ids checked against the vocabulary: an id >= vocab_size is an IndexError on the CPU and a
device-side assert that kills the process on CUDA, so the models check their inputs first, and
a caller that checked them on the host already (the trainer) says so with
:func:`token_ids_checked`, sparing the GPU sync of each check."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

# True inside token_ids_checked(): the caller checked the ids on the host already.
_TOKEN_IDS_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "deltaflow_token_ids_checked", default=False
)


@contextlib.contextmanager
def token_ids_checked() -> Iterator[None]:
    """Within, the models skip :func:`check_token_ids`' value check, for a caller that checked
    the same ids on the CPU before moving them to the GPU (the trainer: free there). On a GPU
    each check is a host sync, input ids and labels, at the start of the forward: the host then
    waits for the previous step's work to drain before it queues any of this one."""
    token = _TOKEN_IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _TOKEN_IDS_CHECKED.reset(token)


def check_token_ids(
    input_ids: torch.Tensor, vocab_size: int, *, name: str = "input_ids", ignore: int | None = None
) -> None:
    """Token ids must index the embedding (labels: the logits, ``ignore`` = -100 aside): an id
    >= vocab_size is otherwise an IndexError on CPU, and a device-side assert that kills the
    process on CUDA. One reduction and one host sync; skipped while compiling or capturing a
    CUDA graph, and inside :func:`token_ids_checked`."""
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {input_ids.dtype}")
    if input_ids.numel() == 0 or torch.compiler.is_compiling() or input_ids.is_meta:
        return
    if _TOKEN_IDS_CHECKED.get():
        return
    if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if ignore is not None:
        bad &= input_ids != ignore
    if bool(bad.any()):
        lo, hi = int(input_ids[bad].min()), int(input_ids[bad].max())
        also = f" or {ignore} (not scored)" if ignore is not None else ""
        raise ValueError(
            f"{name} must be token ids in [0, vocab_size={vocab_size}){also}, got values from "
            f"{lo} to {hi} (a tokenizer or task with a larger vocabulary than the model's?)"
        )
