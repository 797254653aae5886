"""How one chain's ‖S_t‖ behaved (:func:`verdict`), and the markdown that shows it: a table
cell per setting (:func:`cell`), numbers (:func:`fmt`) and tables (:func:`table`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaflow.analysis import growth

OVERFLOW = {"fp16": 65504.0}  # largest finite state entry per state dtype; others ~3.4e38

FP32_MAX = 3.4028234663852886e38


def fmt(x: float | None, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.{nd}g}"


def table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


@dataclass
class Verdict:
    """How one chain's ‖S_t‖ behaved in one precision."""

    status: str  # "non-finite" | "diverging" | "growing" | "bounded"
    first_nonfinite: int | None
    final_norm: float
    exponent: float  # d log‖S‖ / d log t over the second half: 0 bounded, 0.5 sqrt(t)
    dec_per_10k: float  # decades of growth per 10k steps over the second half
    projected_overflow: float | None  # step where the state dtype would overflow, if diverging


def verdict(res: growth.GrowthResult, prec: str, i: int) -> Verdict:
    """Classify chain i: non-finite; diverging (faster than t^1.5 over the last decade of t, i.e.
    exponential: a random walk with |mu| = 1 grows like t^0.5); growing (faster than t^0.2);
    bounded. A diverging chain gets the step at which its growth rate would overflow the state
    dtype (fp16: 65504, others: 3.4e38)."""
    fb = int(res.first_nonfinite[prec][i])
    if fb >= 0:
        return Verdict("non-finite", fb, math.inf, math.nan, math.nan, None)
    y = res.norms[prec][:, i]
    t = res.steps.double()
    y1, t1 = float(y[-1]), float(t[-1])
    # Slope of log‖S‖ on log t over the last decade of the run: robust to the fluctuations of
    # a bounded state (slope ~0) where a two-point ratio is not.
    m = (t >= t1 / 10) & (y > 0)
    if int(m.sum()) < 3:
        return Verdict("bounded", None, y1, math.nan, math.nan, None)
    x, ly = t[m].log(), y[m].log()
    x0 = x - x.mean()
    expo = float((x0 * (ly - ly.mean())).sum() / (x0 * x0).sum())
    half = t >= t1 / 2
    rate = float((y[half][-1] / y[half][0]).log10() / (t[half][-1] - t[half][0]).clamp_min(1)) * 1e4
    if expo > 1.5:
        limit = OVERFLOW.get(prec.split("/")[-1], FP32_MAX)
        proj = t1 + (math.log10(limit) - math.log10(y1)) / rate * 1e4 if rate > 0 else None
        return Verdict("diverging", None, y1, expo, rate, proj)
    return Verdict("growing" if expo > 0.2 else "bounded", None, y1, expo, rate, None)


def cell(res: growth.GrowthResult, prec: str, ix: list[int]) -> str:
    """Markdown table cell for chains ix (the seeds of one setting), worst case first:
    '**inf@81** (3/3)', '**1.2e+14 exp**' (diverging), '182 ~t^0.5' (growing) or '16.5'."""
    vs = [verdict(res, prec, i) for i in ix]
    bad = [v for v in vs if v.status == "non-finite"]
    if bad:
        return f"**inf@{min(v.first_nonfinite for v in bad)}** ({len(bad)}/{len(vs)})"
    worst = max(v.final_norm for v in vs)
    div = [v for v in vs if v.status == "diverging"]
    if div:
        return f"**{worst:.3g} exp** ({len(div)}/{len(vs)})"
    grow = [v.exponent for v in vs if v.status == "growing"]
    if grow:
        return f"{worst:.3g} ~t^{max(grow):.1f}"
    return f"{worst:.3g}"


def chain_index(res: growth.GrowthResult, **attrs) -> list[int]:
    return [
        i for i, c in enumerate(res.chains) if all(getattr(c, k) == v for k, v in attrs.items())
    ]
