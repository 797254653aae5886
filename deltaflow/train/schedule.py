"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay (wsd) or constant.

- ``cosine``: a half cosine from ``lr`` to ``min_lr_ratio * lr`` over the steps after warmup.
- ``wsd`` (warmup-stable-decay, the schedule of current LM recipes): ``lr`` held until the last
  ``decay_fraction`` of the run, then linear to ``min_lr_ratio * lr``. Up to its decay a run
  follows the curve of any longer one, so a checkpoint from the stable phase can be continued
  to more steps (``--fork`` with a larger ``--steps``) on the very curve it was on.
- ``constant``: ``lr`` after warmup, to the end.

A warmup longer than the run (a config's ``warmup_steps: 20`` with ``--steps 10``) is shortened
to the run, the same way everywhere (config, trainer, lab grids): :func:`effective_warmup`;
the trainer says so in one line (:meth:`TrainConfig.warmup_note`).

The schedule is a pure function of the step, so resuming only needs the step counter
(no scheduler object whose hidden state could drift from the checkpoint).
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd", "constant")


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """Warmup steps actually used: at most the run's length."""
    return min(warmup_steps, total_steps)


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup ramps linearly to ``base_lr`` over ``warmup_steps`` steps (the first step already
    uses ``base_lr / warmup_steps``, never 0; a warmup longer than ``total_steps`` is shortened
    to it), then ``schedule`` (module docstring) ends at ``min_lr_ratio * base_lr`` at
    ``total_steps`` (cosine, wsd) or stays at ``base_lr`` (constant).
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    warmup_steps = effective_warmup(warmup_steps, total_steps)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    floor = min_lr_ratio * base_lr
    if schedule == "wsd":
        # the decay takes the last decay_fraction of the run, never the warmup's steps
        decay_steps = max(1, min(round(decay_fraction * total_steps), total_steps - warmup_steps))
        progress = (step - (total_steps - decay_steps)) / decay_steps
        if progress <= 0:
            return base_lr
        return floor + (base_lr - floor) * max(0.0, 1.0 - progress)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (base_lr - floor) * cosine
