"""Every random number generator a training step may touch: saved with each checkpoint (one
state per rank), restored on resume, so a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deltaflow.train.dist import global_rank, is_distributed


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may touch, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective: all ranks must call)."""
    if not is_distributed():
        return [rng_state()]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def restore_rng_states(states: dict[str, Any] | list[dict[str, Any]]) -> None:
    """This rank's saved RNG states (rank 0's if the run had fewer ranks)."""
    if isinstance(states, dict):  # checkpoints from before per-rank RNG states
        states = [states]
    rank = global_rank()
    set_rng_state(states[rank] if rank < len(states) else states[0])
