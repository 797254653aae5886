"""Best-run selection: per (variant, cell, width), the learning rate (and weight decay) whose
seed-aggregate metric is best, with every table metric at those hyperparameters."""

from __future__ import annotations

import math
import statistics
from typing import Any

from deltaflow.lab.presets import Preset


def metric_value(record: dict[str, Any], metric: str, higher_is_better: bool) -> float:
    """A run's metric; diverged/failed runs count as the worst possible value."""
    value = record.get("eval", {}).get(metric) if record.get("status") == "ok" else None
    if value is None or not math.isfinite(value):
        return -math.inf if higher_is_better else math.inf
    return float(value)


def select_best(records: list[dict[str, Any]], preset: Preset) -> list[dict[str, Any]]:
    """Per (variant, cell, width): the learning rate (and, when the preset sweeps it, weight
    decay) whose seed-aggregate metric is best.

    Returns one row per cell with the best lr (``best_wd``: the best weight decay, or None),
    the aggregate of the headline metric over seeds (mean or max as the preset says), its
    spread, and every table metric at those hyperparameters.
    """
    metric, higher = preset.metric, preset.higher_is_better

    def agg(values: list[float]) -> float:
        if preset.seed_aggregate == "max":  # best seed, in the metric's direction
            return max(values) if higher else min(values)
        return statistics.fmean(values)  # inf/-inf (a failed seed) makes the mean worst

    # (variant, cell, width) -> (lr, weight decay) -> the seeds' records; the weight decay is
    # None for grids that do not sweep it (and for records written before it was recorded)
    groups: dict[tuple, dict[tuple[float, float | None], list[dict[str, Any]]]] = {}
    for r in records:
        wd = r.get("weight_decay", r.get("config", {}).get("weight_decay"))
        hparams = (r["lr"], wd if preset.weight_decays else None)
        cell_key = (r["variant"], r["cell"], r["width"])
        groups.setdefault(cell_key, {}).setdefault(hparams, []).append(r)
    rows = []
    for (variant, cell, width), by_hparams in groups.items():
        scored = {}
        for hparams, runs in by_hparams.items():
            values = [metric_value(r, metric, higher) for r in runs]
            scored[hparams] = agg(values)
        best = (max if higher else min)(scored, key=lambda h: scored[h])
        runs = by_hparams[best]
        row: dict[str, Any] = {
            "variant": variant,
            "cell": cell,
            "width": width,
            "best_lr": best[0],
            "best_wd": best[1],
            "value": scored[best],
            "n_seeds": len(runs),
            "status": ",".join(sorted({r["status"] for r in runs})),
            "num_params": runs[0].get("num_params"),
            "seconds": sum(r.get("seconds", 0.0) for r in runs),
        }
        ok = [metric_value(r, metric, higher) for r in runs]
        row["seed_values"] = {r["seed"]: v for r, v in zip(runs, ok)}
        row["std"] = (
            statistics.pstdev(ok) if len(ok) > 1 and all(math.isfinite(v) for v in ok) else 0.0
        )
        # the best seed at the best lr (the run a best-of-seeds table number comes from)
        best_run = (max if higher else min)(runs, key=lambda r: metric_value(r, metric, higher))
        if preset.seed_aggregate == "max":
            # best of seeds: every metric from that one run (a per-metric max would mix seeds
            # and take the largest loss)
            metrics = {
                k: float(v)
                for k, v in sorted(best_run.get("eval", {}).items())
                if isinstance(v, (int, float)) and math.isfinite(v)
            }
            spreads = {}
        else:
            metrics, spreads = {}, {}
            for key in sorted({k for r in runs for k in r.get("eval", {})}):
                vals = [metric_value(r, key, higher) for r in runs]
                vals = [v for v in vals if math.isfinite(v)]
                if vals:
                    metrics[key] = agg(vals)
                    spreads[key] = statistics.pstdev(vals) if len(vals) > 1 else 0.0
        row["metrics"] = metrics
        row["metrics_std"] = spreads  # seed spread of every metric (mean over seeds only)
        row["curve_seed"] = best_run["seed"]  # the run the curves come from (plots say so)
        row["curve"] = best_run.get("curve", [])
        row["eval_curve"] = [
            [r["step"], r[metric]] for r in best_run.get("eval_curve", []) if metric in r
        ]
        rows.append(row)
    return rows
