"""The trainer's side of context parallelism (``context_parallel = N`` in the config).

The world of ``world_size`` ranks is ``dp × cp``: consecutive ranks form one context-parallel
group (on one host they share the fastest links), and the ``dp`` groups draw different rows of
the global batch. Every rank of a cp group holds the same rows and takes its own ``1/cp`` of
their tokens along T. DDP / FSDP2 still span the whole world: each rank's weight gradients are
its share (its tokens) and their all-reduce over the world sums them, so with the loss scaled
by ``world_size / scored tokens`` the step is the one-process step on the same global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deltaflow.parallel.context import ContextParallel, enable_context_parallel


@dataclass
class DataLayout:
    """Which rows and which tokens of the global batch this rank trains on."""

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    group: dist.ProcessGroup | None = None  # this rank's context-parallel group (cp_size > 1)
    context: ContextParallel | None = None  # set by attach()

    @classmethod
    def create(cls, cp_size: int, rank: int, world_size: int) -> DataLayout:
        """Split the world into ``world_size / cp_size`` groups of ``cp_size`` consecutive
        ranks (every rank takes part in creating every group, as ``new_group`` requires)."""
        if cp_size == 1:
            return cls(dp_rank=rank, dp_size=world_size)
        if world_size % cp_size:
            raise ValueError(
                f"context_parallel={cp_size} must divide the number of processes ({world_size})"
            )
        group = None
        for first in range(0, world_size, cp_size):
            ranks = list(range(first, first + cp_size))
            created = dist.new_group(ranks)
            if rank in ranks:
                group = created
        return cls(rank // cp_size, world_size // cp_size, rank % cp_size, cp_size, group)

    def attach(self, model: nn.Module) -> None:
        """Make the model's delta-rule layers context-parallel (before DDP / FSDP2 wrap it)."""
        if self.cp_size > 1:
            self.context = enable_context_parallel(model, self.group)

    def allows_compile(self, mode: str) -> bool:
        """Compiled blocks (``compile``) need one graph per block; the context-parallel layers
        exchange halos and states with collectives inside the block, so under context
        parallelism ``auto`` runs eager and ``blocks`` is refused."""
        if self.cp_size == 1:
            return True
        if mode == "blocks":
            raise ValueError(
                "compile='blocks' does not support context_parallel > 1 yet (the layers' "
                "collectives sit inside each block): use compile='auto' or 'off' (eager)"
            )
        return False

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's segment of each row of ``x [B, T]``."""
        if self.cp_size == 1:
            return x
        T = x.shape[1]
        if T % self.cp_size:
            raise ValueError(
                f"context_parallel={self.cp_size}: the sequence length T={T} must be a multiple "
                "of it (each rank trains on T / context_parallel tokens of every row)"
            )
        L = T // self.cp_size
        return x[:, self.cp_rank * L : (self.cp_rank + 1) * L]

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Evaluation: every process runs whole sequences on its own."""
        if self.context is None:
            yield
            return
        with self.context.disabled():
            yield
