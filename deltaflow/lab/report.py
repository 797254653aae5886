"""The report of a comparison: markdown tables from the rows of
:func:`deltaflow.lab.select.select_best`, the per-seed margin line, the lines that say what ran,
and the note on unfinished runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deltaflow.lab.grid import RunSpec
from deltaflow.lab.paired import paired_difference
from deltaflow.lab.presets import VARIANTS, Preset


def _fmt(value: float | None, std: float = 0.0) -> str:
    if value is None or not math.isfinite(value):
        return "failed"
    text = f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return text + (f" ± {std:.3f}" if std > 0 else "")


def columns(rows: list[dict[str, Any]], preset: Preset) -> list[tuple[str, int | None, str]]:
    """(cell, width, metric) per table column, in the preset's order."""
    metrics = preset.table_metrics or [preset.metric]
    widths = preset.widths or [None]
    return [(c, w, m) for c in preset.cells for w in widths for m in metrics]


def column_label(col: tuple[str, int | None, str], preset: Preset) -> str:
    cell, width, metric = col
    parts = []
    if len(preset.cells) > 1 or (len(preset.widths or [None]) == 1 and not preset.table_metrics):
        parts.append(cell)
    if len(preset.widths or [None]) > 1:
        parts.append(f"d={width}")
    if preset.table_metrics and len(preset.table_metrics) > 1:
        parts.append(metric)
    return " ".join(parts) or metric


def results_table(rows: list[dict[str, Any]], preset: Preset) -> str:
    """Variants as rows, (cell x width x metric) as columns: the headline value at the best lr."""
    index = {(r["variant"], r["cell"], r["width"]): r for r in rows}
    cols = columns(rows, preset)
    sweeps_wd = bool(preset.weight_decays)
    best = "best lr, wd" if sweeps_wd else "best lr"
    header = ["model"] + [column_label(c, preset) for c in cols] + ["params", best]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for variant in preset.variants:
        cells, lrs, params = [], [], None
        for cell, width, metric in cols:
            row = index.get((variant, cell, width))
            if row is None:
                cells.append("-")
                continue
            mark = "*" if row.get("runs_finished") else ""  # interim: sweep unfinished
            if metric == preset.metric:
                cells.append(_fmt(row["value"], row["std"]) + mark)
            else:
                std = row.get("metrics_std", {}).get(metric, 0.0)
                cells.append(_fmt(row["metrics"].get(metric), std) + mark)
            hparams = f"{row['best_lr']:g}"
            if sweeps_wd and row.get("best_wd") is not None:
                hparams += f", {row['best_wd']:g}"
            lrs.append(hparams)
            params = row["num_params"] if params is None else params
        if all(c == "-" for c in cells):
            continue
        unique_lrs = sorted(set(lrs), key=lrs.index)
        size = f"{params / 1e6:.2f}M" if params else "-"
        if len(preset.widths or [None]) > 1:
            size = "varies"
        lines.append("| " + " | ".join([variant, *cells, size, "/".join(unique_lrs)]) + " |")
    return "\n".join(lines)


def contrast_line(rows: list[dict[str, Any]], preset: Preset) -> str:
    """Per-seed margin of ``contrast = (winner, baseline)`` (the cell's, else the preset's) in
    each (cell, width), whether the winner leads on every seed by more than the larger of
    the two seed spreads, and (two seeds or more) the mean margin with its 95% t-interval."""
    index = {(r["variant"], r["cell"], r["width"]): r for r in rows}
    parts = []
    for cell, spec in preset.cells.items():
        contrast = spec.get("contrast", preset.contrast)
        if contrast is None:
            continue
        winner, baseline = contrast
        for width in preset.widths or [None]:
            w, b = index.get((winner, cell, width)), index.get((baseline, cell, width))
            if w is None or b is None:
                continue
            try:  # the winner's lead on each common seed, in the metric's good direction
                paired = paired_difference(
                    w.get("seed_values", {}),
                    b.get("seed_values", {}),
                    higher_is_better=preset.higher_is_better,
                )
            except ValueError:  # no common seed, or a failed (non-finite) run
                parts.append(f"{cell}: a run failed, no margin")
                continue
            margins = paired.diffs
            spread = max(w["std"], b["std"])
            ok = min(margins) > spread
            verdict = "separated on every seed" if ok else "NOT separated"
            where = cell + (f" d={width}" if width is not None else "")
            per_seed = ", ".join(f"{m:+.3f}" for m in margins)
            interval = (
                f"; mean {paired.mean:+.3f} ± {paired.half_width:.3f} (95% t-interval, "
                f"{paired.verdict(winner, baseline)})"
                if paired.n > 1
                else ""
            )
            parts.append(
                f"{where}: {winner} - {baseline} per seed {per_seed}; smallest margin "
                f"{min(margins):.3f} vs spread (larger std) {spread:.3f}: {verdict}{interval}"
            )
    return "\n".join(f"Margin, {p}" for p in parts)


def markdown_report(
    rows: list[dict[str, Any]],
    preset: Preset,
    *,
    command: str,
    device: str,
    steps: int,
    plots: list[str],
    details: list[str] | None = None,
    note: str | None = None,
    pending: str = "",
) -> str:
    # seed counts over the variants (a preset may give a few variants more seeds)
    counts = sorted({len(preset.variant_seeds(v)) for v in preset.variants}) or [1]
    agg = "best of" if preset.seed_aggregate == "max" else "mean ± std over"
    if counts == [1]:
        seed_text = "one seed"
    elif len(counts) == 1:
        seed_text = f"{agg} {counts[0]} seeds"
    else:
        seed_text = f"{agg} {counts[0]}-{counts[-1]} seeds (per variant)"
    direction = "higher" if preset.higher_is_better else "lower"
    lines = [
        f"# deltaflow compare: `{preset.name}`",
        "",
        *([f"> **{note}**", ""] if note else []),
        preset.description,
        "",
        f"Metric: **{preset.metric}** ({direction} is better) on the validation set at the best "
        f"learning rate of {[f'{lr:g}' for lr in preset.lrs]}"
        + (
            f" x weight decay of {[f'{wd:g}' for wd in preset.weight_decays]}"
            if preset.weight_decays
            else ""
        )
        + " per cell, "
        f"{seed_text}. "
        f"{steps} training steps per run; device {device}.",
        "",
        results_table(rows, preset),
        "",
        *([pending, ""] if pending else []),  # unfinished runs, right under the table
    ]
    margin = contrast_line(rows, preset)
    if margin:
        lines += [margin, ""]
    if details:
        lines += [f"- {d}" for d in details] + [""]
    if preset.expect:
        lines += [f"Expected: {preset.expect}", ""]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["Runs that diverged or failed at the best lr: "]
        lines += [f"- {r['variant']} {r['cell']} w={r['width']}: {r['status']}" for r in failed]
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    lines += ["", "Reproduce:", "", "```", command, "```", ""]
    return "\n".join(lines)


def run_details(
    preset: Preset,
    specs: list[RunSpec],
    records: list[dict[str, Any]],
    finished: list[dict[str, Any]],
    *,
    train: bool,
    seconds: float,
) -> list[str]:
    """The report's lines on what ran: each cell's task (after --set overrides), the shared
    model and training settings, the runs and minutes, train vs validation loss, peak GPU
    memory, and the unfinished runs' ids (up to 20)."""
    details = []
    for cell in preset.cells:  # what actually ran (after --set overrides), self-describing
        cfg = next(s.config for s in specs if s.cell == cell)
        kwargs = {k: v for k, v in cfg.task_kwargs.items() if k != "seed"}
        details.append(f"cell `{cell}`: task `{cfg.task}` {json.dumps(kwargs)}")
    if specs:
        cfg = specs[0].config
        skip = set(VARIANTS[specs[0].variant]) | ({"hidden_size"} if preset.widths else set())
        model = {k: v for k, v in cfg.model.items() if k not in skip}
        details.append(
            f"shared model args {json.dumps(model)}; batch {cfg.batch_size}, warmup "
            f"{cfg.resolved_warmup_steps}, weight decay "
            f"{preset.weight_decays if preset.weight_decays else cfg.weight_decay}, "
            f"grad clip {cfg.grad_clip}"
        )
    unfinished = [r for r in records if r["status"] == "partial"]
    run_seconds = sum(r.get("seconds", 0.0) for r in records if r["status"] != "partial")
    details.append(
        f"{len(records) - len(unfinished)} finished runs, {run_seconds / 60:.1f} run-minutes "
        + (
            f"in total; this invocation took {seconds / 60:.1f} min wall"
            if train
            else "in total (report only: this invocation trained nothing)"
        )
    )
    # a large gap between the two says the models memorise their training data
    pairs = [
        (r["train_loss"], r["eval"]["loss"])
        for r in finished
        if r["status"] == "ok" and r.get("train_loss") is not None and "loss" in r.get("eval", {})
    ]
    if pairs:
        train_losses, valid_losses = zip(*pairs)
        details.append(
            f"last logged training loss {min(train_losses):.3f}-{max(train_losses):.3f} vs "
            f"validation loss {min(valid_losses):.3f}-{max(valid_losses):.3f} (all finished runs)"
        )
    # early_stop (Zoology's protocol): where each run ended, so a table of runs that stopped at
    # step 4000 and of runs that trained every step is not read as one budget
    watched = [r for r in finished if r["status"] == "ok" and "stopped_early_at" in r]
    if watched:
        stops = sorted(r["stopped_early_at"] for r in watched if r["stopped_early_at"] is not None)
        rules = ", ".join(sorted({str(r.get("config", {}).get("early_stop")) for r in watched}))
        details.append(
            f"early_stop {rules}: {len(stops)} of {len(watched)} runs stopped early"
            + (f", at steps {stops[0]}-{stops[-1]}" if stops else "")
            + (
                f"; {len(watched) - len(stops)} trained every step"
                if len(stops) < len(watched)
                else ""
            )
        )
    peaks = [r["peak_gpu_memory_gib"] for r in records if r.get("peak_gpu_memory_gib")]
    if peaks:
        details.append(f"peak GPU memory per run {min(peaks):.2f}-{max(peaks):.2f} GiB")
    if unfinished and len(unfinished) <= 20:
        details.append("unfinished: " + ", ".join(r["id"] for r in unfinished))
    return details


def pending_note(
    records: list[dict[str, Any]],
    incomplete: set[tuple],
    *,
    train: bool,
    command: str,
    runs_dir: Path,
) -> str:
    """What the report says about unfinished runs and the command that continues them ("" when
    every run finished). ``incomplete``: the (variant, cell, width) keys missing runs."""
    unfinished = [r for r in records if r["status"] == "partial"]
    if not unfinished:
        return ""
    again = command if " --resume" in f"{command} " else f"{command} --resume"
    if train:
        return (
            f"**{len(unfinished)} of {len(records)} runs unfinished** (time limit reached; "
            f"{len(incomplete)} cells left out of the table; runs stopped in flight have "
            f"checkpoints in {runs_dir}). To continue, run the same command with --resume"
            + (f":\n\n    {again}" if command else ".")
        )
    # a report of a grid that is still being trained, command by command
    return (
        f"**{len(unfinished)} of {len(records)} runs not trained yet**: a value marked "
        "* is the best of its cell's runs finished so far, not of the whole sweep "
        f"({len(incomplete)} cells incomplete; `runs_finished` in summary.json). To "
        "train the rest, run the command without --report-only, with --resume"
        + (f":\n\n    {again.replace(' --report-only', '')}" if command else ".")
    )
