"""When a Trainer stops or checkpoints on its own: signals (Ctrl-C, SIGTERM), the deadline
and timed checkpoints, agreed by every rank (a mixin of
:class:`deltaflow.train.trainer.Trainer`)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class StoppingMixin:
    """A Trainer's stops and timed checkpoints (signals, deadline, ``checkpoint_seconds``)."""

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """With ``handle_signals``: SIGINT/SIGTERM set a flag that the loop reads after the
        step in flight (it then saves and stops); a second signal quits at once."""
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self._signal is not None:
                raise KeyboardInterrupt
            self._signal = signal.Signals(signum).name
            self.note(
                f"\n{self._signal}: saving a checkpoint after the current step, then stopping "
                "(send it again to quit without saving)"
            )

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_or_due(self, last_save: float) -> tuple[str | None, bool]:
        """(why the run stops now: 'deadline', 'SIGINT', 'SIGTERM' or None; whether a timed
        checkpoint is due). Deadline and timed checkpoints act at log steps only, so a deadline
        stop never splits a log window (every trainer of a cut run ends on a log record)."""
        deadline = due = False
        if self.step % self.config.log_every == 0:
            deadline, due = self._clock_says(last_save)
        signal_name = self._signal_received()
        return ("deadline" if deadline else signal_name), due

    def _signal_received(self) -> str | None:
        """The signal that asks this run to stop, agreed by every rank (any rank's counts)."""
        if not self.handle_signals:
            return None
        if self.dist.world_size > 1:
            names = ("SIGINT", "SIGTERM")
            flag = torch.tensor(
                [float(names.index(self._signal) + 1) if self._signal in names else 0.0],
                device=self.device,
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return names[int(flag.item()) - 1] if flag.item() > 0 else None
        return self._signal

    def _clock_says(self, last_save: float) -> tuple[bool, bool]:
        """(deadline passed, timed checkpoint due); rank 0's clock decides for every rank, so
        that all ranks stop (and join the checkpoint's collectives) at the same step."""
        stop = self.deadline is not None and time.time() >= self.deadline
        due = (
            self.checkpoint_seconds is not None
            and time.perf_counter() - last_save >= self.checkpoint_seconds
        )
        timed = self.deadline is not None or self.checkpoint_seconds is not None
        if self.dist.world_size > 1 and timed:
            flags = torch.tensor([float(stop), float(due)], device=self.device)
            dist.broadcast(flags, src=0)
            stop, due = bool(flags[0]), bool(flags[1])
        return stop, due
