"""Paired comparison of two variants over seeds: does one beat the other beyond seed noise?

Runs of the same seed share their data stream and initialisation stream (grid.py), so the
per-seed difference removes most of what the seeds vary, and its mean gets a Student-t
interval: with n seeds, mean ± t(0.975, n − 1) · sd / √n. The verdict says which variant is
ahead only when that 95% interval excludes zero; with one seed there is no interval at all.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# two-sided 95% quantiles of Student's t by degrees of freedom (n seeds − 1); 1.96 beyond 30
T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042,
}  # fmt: skip


def t95(dof: int) -> float:
    """The two-sided 95% t quantile for ``dof`` degrees of freedom (the table's next lower
    entry where it skips, which errs on the wide side)."""
    if dof < 1:
        raise ValueError(f"dof: expected >= 1 degree of freedom, got {dof}")
    if dof > max(T95):
        return 1.96
    return T95[max(k for k in T95 if k <= dof)]


@dataclass(frozen=True)
class PairedDifference:
    """``diffs[i]``: how far A is ahead of B on ``seeds[i]`` (positive: A better, in the
    metric's direction)."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs)

    @property
    def half_width(self) -> float:
        """Half the 95% interval of the mean difference (inf with one seed)."""
        if self.n < 2:
            return math.inf
        return t95(self.n - 1) * statistics.stdev(self.diffs) / math.sqrt(self.n)

    @property
    def wins(self) -> int:
        """Seeds on which A is ahead."""
        return sum(d > 0 for d in self.diffs)

    def verdict(self, a: str, b: str) -> str:
        if self.n < 2:
            return "one seed: no interval"
        low, high = self.mean - self.half_width, self.mean + self.half_width
        if low > 0:
            return f"{a} ahead"
        if high < 0:
            return f"{b} ahead"
        return "no difference resolved"


def paired_difference(
    a: dict[int, float], b: dict[int, float], *, higher_is_better: bool
) -> PairedDifference:
    """Pair ``a`` and ``b`` (seed -> metric value) on their common seeds."""
    seeds = tuple(sorted(set(a) & set(b)))
    if not seeds:
        raise ValueError(f"a and b share no seed (a: {sorted(a)}, b: {sorted(b)})")
    values = [(a[s], b[s]) for s in seeds]
    if not all(math.isfinite(x) and math.isfinite(y) for x, y in values):
        raise ValueError(f"a non-finite value (a failed run) on seeds {seeds}: {values}")
    sign = 1.0 if higher_is_better else -1.0
    return PairedDifference(seeds, tuple(sign * (x - y) for x, y in values))
