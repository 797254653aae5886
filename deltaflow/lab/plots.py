"""PNG plots of a compare grid (matplotlib, Agg backend: works headless).

Each variant keeps one colour in every panel and plot (its place in the preset's variant
list). Metric-vs-width and metric-vs-length draw what the table reports (the seed aggregate);
the training curves are one run's, each variant's best seed, and their legends say which.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from deltaflow.lab.presets import Preset  # noqa: E402


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def _colors(preset: Preset) -> dict[str, str]:
    """One colour per variant for every panel (matplotlib's cycle, in preset order)."""
    return {v: f"C{i % 10}" for i, v in enumerate(preset.variants)}


def _curve_label(variant: str, row: dict[str, Any], preset: Preset) -> str:
    """``efla (lr 0.003, seed 2: best of 3)``: which run a curve is, when there are seeds."""
    label = f"{variant} (lr {row['best_lr']:g}"
    if row.get("n_seeds", 1) > 1 and "curve_seed" in row:
        label += f", seed {row['curve_seed']}: best of {row['n_seeds']}"
    return label + ")"


def _curve_title(cell: str, width: int | None, preset: Preset, rows: list[dict]) -> str:
    title = cell + (f", d={width}" if width else "")
    if any(r.get("n_seeds", 1) > 1 for r in rows) and preset.seed_aggregate != "max":
        title += f"\n(best seed's run; the table: {preset.seed_aggregate} of seeds)"
    return title


def _save(fig: plt.Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def plot_metric_vs_width(rows: list[dict[str, Any]], preset: Preset, out: Path) -> str | None:
    """Headline metric vs model width (the Zoology MQAR figure), one panel per cell."""
    if not preset.widths or len(preset.widths) < 2:
        return None
    cells = list(preset.cells)
    colors = _colors(preset)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        for variant in preset.variants:
            pts = sorted(
                (r["width"], r["value"])
                for r in rows
                if r["variant"] == variant and r["cell"] == cell and _finite(r["value"])
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=variant, color=colors[variant])
        ax.set_xscale("log", base=2)
        ax.set_xticks(preset.widths, [str(w) for w in preset.widths])
        ax.set_xlabel("model width (hidden size)")
        ax.set_ylabel(preset.metric)
        ax.set_title(cell)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    return _save(fig, out / "metric_vs_width.png")


def plot_loss_curves(rows: list[dict[str, Any]], preset: Preset, out: Path) -> str | None:
    """Training loss of the reported run (best lr, best seed) per variant; widest model only."""
    width = max(preset.widths) if preset.widths else None
    cells = list(preset.cells)
    colors = _colors(preset)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    drew = False
    for ax, cell in zip(axes[0], cells):
        for variant in preset.variants:
            for r in rows:
                if (r["variant"], r["cell"], r["width"]) == (variant, cell, width) and r["curve"]:
                    steps, losses = zip(*[(s, v) for s, v in r["curve"] if _finite(v)])
                    label = _curve_label(variant, r, preset)
                    ax.plot(steps, losses, label=label, color=colors[variant])
                    drew = True
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.set_title(_curve_title(cell, width, preset, rows), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not drew:
        plt.close(fig)
        return None
    return _save(fig, out / "loss_curves.png")


def plot_metric_vs_length(rows: list[dict[str, Any]], preset: Preset, out: Path) -> str | None:
    """Metric vs evaluation length from the per-length metrics (``name@L``): extrapolation."""
    base = preset.metric
    pattern = re.compile(rf"^{re.escape(base)}@(\d+)$")
    width = max(preset.widths) if preset.widths else None
    cells = [
        c
        for c in preset.cells
        if any(pattern.match(k) for r in rows if r["cell"] == c for k in r["metrics"])
    ]
    if not cells:
        return None
    colors = _colors(preset)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        lengths: set[int] = set()
        for variant in preset.variants:
            for r in rows:
                if (r["variant"], r["cell"], r["width"]) != (variant, cell, width):
                    continue
                pts = sorted(
                    (int(m.group(1)), v)
                    for k, v in r["metrics"].items()
                    if (m := pattern.match(k)) and _finite(v)
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=variant, color=colors[variant])
                    lengths.update(p[0] for p in pts)
        ax.set_xscale("log", base=2)
        if lengths:
            ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])
        if not preset.higher_is_better:
            ax.set_yscale("log")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel(base)
        ax.set_title(cell)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out / f"{base}_vs_length.png")


def plot_metric_curves(rows: list[dict[str, Any]], preset: Preset, out: Path) -> str | None:
    """Validation headline metric during training (runs with periodic evaluation)."""
    width = max(preset.widths) if preset.widths else None
    cells = [
        c for c in preset.cells if any(r["cell"] == c and len(r["eval_curve"]) > 1 for r in rows)
    ]
    if not cells:
        return None
    colors = _colors(preset)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        for variant in preset.variants:
            for r in rows:
                if (r["variant"], r["cell"], r["width"]) == (variant, cell, width):
                    pts = [(s, v) for s, v in r["eval_curve"] if _finite(v)]
                    if pts:
                        label = _curve_label(variant, r, preset)
                        ax.plot(*zip(*pts), marker="o", label=label, color=colors[variant])
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation {preset.metric}")
        ax.set_title(_curve_title(cell, width, preset, rows), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out / f"{preset.metric}_curves.png")


def make_plots(rows: list[dict[str, Any]], preset: Preset, out_dir: str | Path) -> list[str]:
    out = Path(out_dir)
    if not rows:  # nothing finished yet (a grid stopped by its time limit)
        return []
    made = [
        plot_metric_vs_width(rows, preset, out),
        plot_metric_vs_length(rows, preset, out),
        plot_loss_curves(rows, preset, out),
        plot_metric_curves(rows, preset, out),
    ]
    return [m for m in made if m]
