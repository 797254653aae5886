"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The schedule is a pure function of the step, so resuming only needs the step counter
(no scheduler object whose hidden state could drift from the checkpoint).
"""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup ramps linearly to ``base_lr`` over ``warmup_steps`` steps (the first step already
    uses ``base_lr / warmup_steps``, never 0), then a half cosine takes it to
    ``min_lr_ratio * base_lr`` at ``total_steps``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
