"""Distributed setup: which process this is (``DistInfo``), its device, the process group
and the collectives that keep ranks agreeing."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, dist_info: DistInfo) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_info.local_rank)
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r}: no CUDA GPU is available here (torch.cuda.is_available() "
                "is False); use --device cpu or auto"
            )
        if device.index is None:
            device = torch.device("cuda", dist_info.local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )
    return device


def join_process_group(info: DistInfo) -> bool:
    """Start the process group a multi-process run needs, unless one is up already; True when
    this call started it (its owner destroys it)."""
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        return True
    return False


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    """FSDP2's counterpart of DDP's ``no_sync``: accumulate unsharded gradients locally."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------- collectives
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns whenever it runs without a process group; for us that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def agree(error: str | None, kind: type[Exception]) -> None:
    """Raise rank 0's ``error`` (if any) as ``kind`` on every rank, so that no rank waits in a
    collective for a rank that has given up."""
    if is_distributed():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise kind(errno.EIO, error) if issubclass(kind, OSError) else kind(error)


def first_error(error: str | None) -> str | None:
    """The first rank's error of a step every rank took part in (a collective)."""
    if not is_distributed():
        return error
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
