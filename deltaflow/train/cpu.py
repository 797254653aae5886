"""Training on a CPU: the torch thread count, and a warning when a model is GPU-sized.

The default model (width 512, 8 layers: ~32M parameters with MQAR's vocabulary) is sized for a
GPU; on a 2-core CPU one step of it takes most of a minute. ``deltaflow train`` keeps that
default (a config names the same model on every machine) and says so instead: before training
when the parameter count alone gives it away, and after two steps with the measured time.

Threads: measured with ``benchmarks/cpu_threads.py`` on a 2-core machine (docs/lab.md, "CPU
threads"): when the machine is otherwise idle, two torch threads train the lab's small models
1.2-1.6x faster than one; when other processes want the cores, two threads are 2-5x *slower*
(OpenMP threads spin while they wait for each other; the issue that asked for ``--threads``
saw 10x). One thread never lost more than 1.6x, so ``--threads`` defaults to 1 on CPU, and a
long run on a machine with idle cores is told that ``--threads N`` may help.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
# torch is imported inside the functions: the help text below is read by `deltaflow CMD
# --help`, which should not wait for torch.

# Above this many parameters a model counts as GPU-sized on CPU (the shipped CPU configs and
# the lab's CPU presets use 0.06M-1.5M; the default model is ~32M).
GPU_SIZED_PARAMS = 5_000_000
# Warn when the measured rate says the whole run takes longer than this on CPU.
WARN_MINUTES = 10.0
DEFAULT_CPU_THREADS = 1
DEFAULT_THREADS_HELP = (
    f"torch CPU threads (default on CPU: {DEFAULT_CPU_THREADS}: more threads were up to 1.6x "
    "faster on an idle machine but up to 5x slower on a busy one; docs/lab.md)"
)
CPU_SIZED_MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2}
CPU_SIZED_FLAGS = "--hidden-size 128 --num-layers 2 --num-heads 2"


def set_threads(threads: int | None, device: str | torch.device) -> int | None:
    """Apply ``--threads`` (or the CPU default when not given); returns the count set, or
    None when nothing was changed (GPU runs without the flag)."""
    import torch

    if threads is None:
        if torch.device(device).type != "cpu":
            return None
        threads = DEFAULT_CPU_THREADS
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


def count_parameters(config: Any, vocab_size: int) -> int:
    """Parameters of the model a TrainConfig builds, without allocating it (meta device)."""
    import torch

    from deltaflow.train.build import build_model

    with torch.device("meta"):
        model = build_model(config, vocab_size)
    return sum(p.numel() for p in model.parameters())


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e6:.2f}M"


def _fmt_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def warn(message: str) -> None:
    """A warning line on stderr that does not break a progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(f"deltaflow train: warning: {message}", file=sys.stderr)


def smaller_setting(config: Any, vocab_size: int, num_params: int) -> str | None:
    """The CPU-sized flags and the parameter count they give with this task, or None when
    they would not make this model much smaller."""
    small = config.replace(model={**config.model, **CPU_SIZED_MODEL})
    small_params = count_parameters(small, vocab_size)
    if small_params > num_params / 2:
        return None
    return f"{CPU_SIZED_FLAGS} ({_fmt_params(small_params)} parameters)"


def warn_if_gpu_sized(config: Any, vocab_size: int, num_params: int) -> bool:
    """Before training: a GPU-sized model on CPU is said up front, with a smaller setting."""
    if num_params < GPU_SIZED_PARAMS:
        return False
    small = smaller_setting(config, vocab_size, num_params)
    warn(
        f"{_fmt_params(num_params)} parameters is a GPU-sized model; on CPU a step of "
        f"{config.batch_size} sequences takes a long time (the measured time follows after "
        "two steps). "
        + (f"A CPU-sized model: {small}; or run" if small else "Use a smaller model, or run")
        + " on a GPU (--device cuda)"
    )
    return True


class CpuTimeCheck:
    """Training callback: after the second step, project the run's time from the measured
    rate and warn when it exceeds ``WARN_MINUTES`` (on CPU a step's cost hardly varies)."""

    def __init__(self, config: Any, vocab_size: int, num_params: int, gpu_sized: bool) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.num_params = num_params
        self.gpu_sized = gpu_sized
        self.first: tuple[int, float] | None = None
        self.done = False

    def __call__(self, trainer: Any, step: int) -> None:
        import torch

        if self.done:
            return
        now = time.perf_counter()
        if self.first is None:  # the first step pays one-off costs: time from its end
            self.first = (step, now)
            return
        self.done = True
        per_step = (now - self.first[1]) / max(1, step - self.first[0])
        left = (self.config.steps - step) * per_step
        if left < WARN_MINUTES * 60:
            return
        small = smaller_setting(self.config, self.vocab_size, self.num_params)
        if self.gpu_sized:
            hint = "a smaller model (see above)"
        else:
            hint = f"a smaller model, e.g. {small}" if small else "a smaller model"
        warn(
            f"measured {per_step:.2g} s/step on {torch.get_num_threads()} CPU thread(s): "
            f"{self.config.steps} steps take ~{_fmt_duration(left + step * per_step)} "
            f"(~{_fmt_duration(left)} left). For a shorter CPU run: fewer --steps, {hint}, "
            "or a GPU" + idle_cores_hint()
        )


def idle_cores_hint() -> str:
    """``; --threads N may help ...`` when cores look idle (1-minute load average) and this
    process uses fewer threads than the machine has cores."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    idle = int(cores - load)  # our own busy thread is part of the load
    import torch

    threads = torch.get_num_threads()
    if cores <= threads or idle <= 0:
        return ""
    return (
        f"; this machine has ~{idle} idle core(s): --threads {threads + idle} may be faster "
        "while it stays idle"
    )
