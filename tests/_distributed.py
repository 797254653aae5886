"""Helpers for tests that spawn a 2-process gloo group on the CPU."""

from __future__ import annotations

import os
import socket


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
