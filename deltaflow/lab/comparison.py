"""``deltaflow compare``, the whole job: expand a preset's grid, train it, keep the best learning
rate per cell, write results.md, summary.json, command.txt and the plots.

Each step is its own module: :mod:`deltaflow.lab.grid` (the runs), :mod:`deltaflow.lab.runner`
(training them; its docstring says how runs resume), :mod:`deltaflow.lab.select` (best runs),
:mod:`deltaflow.lab.report` (tables and prose), :mod:`deltaflow.lab.plots`.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from deltaflow.lab.grid import expand_grid
from deltaflow.lab.presets import Preset
from deltaflow.lab.runner import default_jobs, device_name, run_grid, training_deadline
from deltaflow.lab.select import select_best


def compare(
    preset: Preset,
    out_dir: str | Path,
    *,
    device: str = "auto",
    steps: int | None = None,
    scale: float = 1.0,
    shared: str | None = None,
    overrides: dict[str, Any] | None = None,
    command: str = "",
    progress: bool = True,
    jobs: int | None = None,
    threads: int | None = None,
    note: str | None = None,
    resume: bool = False,
    time_limit_minutes: float | None = None,
    checkpoint_minutes: float | None = 2.0,
    keep_run_dirs: bool = False,
    train: bool = True,
) -> tuple[list[dict[str, Any]], str]:
    """Run the grid, then write results.md, summary.json and PNG plots into ``out_dir``.

    ``jobs``: parallel runs (default: one per CPU core on CPU, 1 on GPU). ``resume``: keep the
    finished runs of ``out_dir/runs.jsonl`` and continue unfinished ones from their
    checkpoints instead of training everything again. ``time_limit_minutes``: wall-time budget
    of this call; training stops (checkpointed) when it is nearly used (see
    :func:`~deltaflow.lab.runner.training_deadline`), the table then holds the finished runs'
    cells only and says how many runs are unfinished. ``checkpoint_minutes``,
    ``keep_run_dirs``: see :func:`~deltaflow.lab.runner.run_grid`. ``train=False``: train
    nothing; report the runs finished in ``out_dir/runs.jsonl`` (e.g. after several partial
    commands into the same folder); a cell whose sweep is unfinished shows the best of its
    finished runs, marked ``*``. Returns (best rows, markdown table; with the preset's
    ``contrast``, the per-seed margin line under it; the unfinished runs' line and how to
    continue them).
    """
    from deltaflow.lab.plots import make_plots
    from deltaflow.lab.report import (
        contrast_line,
        markdown_report,
        pending_note,
        results_table,
        run_details,
    )

    out = Path(out_dir)
    start = time.perf_counter()
    deadline = None
    if time_limit_minutes is not None:
        deadline = training_deadline(time.time(), time_limit_minutes)
    specs = expand_grid(
        preset, device=device, steps=steps, scale=scale, shared=shared, overrides=overrides
    )
    jobs = default_jobs(specs) if jobs is None else jobs
    if specs and specs[0].config.eval_lengths and len(specs[0].config.eval_lengths) > 1:
        preset = copy.deepcopy(preset)  # one table column per evaluation length
        preset.table_metrics = [f"{preset.metric}@{n}" for n in specs[0].config.eval_lengths]
    records = run_grid(
        specs,
        out,
        metric=preset.metric,
        progress=progress,
        jobs=jobs,
        threads=threads,
        resume=resume,
        deadline=deadline,
        checkpoint_minutes=checkpoint_minutes,
        keep_run_dirs=keep_run_dirs,
        train=train,
    )
    unfinished = [r for r in records if r["status"] == "partial"]
    incomplete = {(r["variant"], r["cell"], r["width"]) for r in unfinished}
    if train:  # a cell's best lr is chosen over all of its runs: leave out cells missing some
        finished = [r for r in records if (r["variant"], r["cell"], r["width"]) not in incomplete]
    else:  # an interim report: every cell with a finished run, marked while runs are missing
        finished = [r for r in records if r["status"] != "partial"]
    rows = select_best(finished, preset)
    if not train:
        for row in rows:
            key = (row["variant"], row["cell"], row["width"])
            if key in incomplete:
                cell_runs = [r for r in records if (r["variant"], r["cell"], r["width"]) == key]
                done = sum(r["status"] != "partial" for r in cell_runs)
                row["runs_finished"] = f"{done}/{len(cell_runs)}"
    plots = make_plots(rows, preset, out)
    seconds = time.perf_counter() - start
    n_steps = specs[0].config.steps if specs else 0
    where = device_name(specs[0].config.device if specs else device)
    if not train:  # the runs' own record of where they trained, not this machine
        names = sorted({r["device_name"] for r in finished if r.get("device_name")})
        where = ", ".join(names) or (specs[0].config.device if specs else device)
    elif jobs > 1:
        where += f", {jobs} runs in parallel ({threads or 1} thread each)"
    details = run_details(preset, specs, records, finished, train=train, seconds=seconds)
    pending = pending_note(records, incomplete, train=train, command=command, runs_dir=out / "runs")
    report = markdown_report(
        rows,
        preset,
        command=command,
        device=where,
        steps=n_steps,
        plots=plots,
        details=details,
        note=note,
        pending=pending,
    )
    _atomic_text(out / "results.md", report)
    summary = [{k: v for k, v in r.items() if k not in ("curve", "eval_curve")} for r in rows]
    _atomic_text(out / "summary.json", json.dumps(summary, indent=2))
    if command:
        _atomic_text(out / "command.txt", command + "\n")
    table = results_table(rows, preset)
    margin = contrast_line(rows, preset)
    return rows, "\n\n".join(part for part in (table, margin, pending) if part)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
