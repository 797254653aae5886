"""Helpers for tests that spawn a 2-process gloo group on the CPU."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun would give rank ``rank`` of ``world`` on this host."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )


def spawn_ranks(fn: Callable[..., None], args: tuple, world: int, timeout: float = 240) -> None:
    """``torch.multiprocessing.spawn`` with a deadline: a rank that hangs (a collective nobody
    else joins) fails the test after ``timeout`` seconds and every rank is killed, instead of
    stalling the whole suite (CI has one time limit for everything)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: {world} ranks still running after {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
