"""Run a preset's grid, keep the best learning rate per cell, write tables and plots.

Every finished run is appended to ``<out>/runs.jsonl`` (its config, final metrics, loss and
eval curves). By default a grid trains from scratch: an existing ``runs.jsonl`` is moved aside
to ``runs.prev.jsonl``, so what is printed was computed by this invocation. With
``resume=True`` (``deltaflow compare --resume``) runs already in ``runs.jsonl`` are skipped, so
a long grid that was interrupted continues where it stopped; changing a run's config changes
its id, so stale results are never reused.

Each run trains in its own directory ``<out>/runs/<run id>/`` (logs and checkpoints, every
``checkpoint_minutes`` of wall time and when it stops). A run cut off, by a kill or by the
grid's ``deadline`` (``deltaflow compare --time-limit``), continues from its latest checkpoint
under ``resume=True`` and ends as the uninterrupted run would have (same weights on CPU, same
loss and eval curves: the trainer's log in the run directory covers the whole run). Only
finished runs are written to ``runs.jsonl``; their directories are then deleted (unless
``keep_run_dirs``). Without ``resume``, an old ``runs/`` folder is moved to ``runs.prev/``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from deltaflow.lab.presets import VARIANTS, Preset
from deltaflow.train import DivergenceError, TrainConfig, Trainer

# TrainConfig fields that came after grids were committed and say how a run is executed, not
# what it trains (timed checkpoints; torch.compile of the same model, like the kernel backend):
# left out of run ids, so committed grids keep their ids (--resume, --report-only).
RUNTIME_ONLY_FIELDS = ("ckpt_minutes", "compile")


@dataclass(frozen=True)
class RunSpec:
    variant: str
    cell: str
    width: int | None
    lr: float
    seed: int
    config: TrainConfig
    weight_decay: float | None = None  # set when the preset sweeps weight decay
    shared: str | None = None  # the --shared folder substituted into the task's paths

    @property
    def run_id(self) -> str:
        config = self.config.to_dict()
        for name in RUNTIME_ONLY_FIELDS:  # added after grids were committed; ids stay valid
            config.pop(name, None)
        if str(config.get("device", "")).startswith("cuda:"):  # which GPU of a host ran it is
            config["device"] = "cuda"  # not part of the run: 'cuda:1' resumes a 'cuda' run
        text = json.dumps(config, sort_keys=True)
        if self.shared:  # the same run on another machine (another checkout path): same id
            prefix = json.dumps(self.shared.rstrip("/") + "/")[:-1]  # '"<shared>/': path starts
            text = text.replace(prefix, '"{shared}/')
        digest = hashlib.sha1(text.encode())
        width = f"-w{self.width}" if self.width is not None else ""
        # only swept weight decays appear in the id, so ids of older grids stay valid
        wd = f"-wd{self.weight_decay:g}" if self.weight_decay is not None else ""
        return (
            f"{self.variant}-{self.cell}{width}-lr{self.lr:g}{wd}-s{self.seed}-"
            f"{digest.hexdigest()[:8]}"
        )


def _fill(value: Any, shared: str | None) -> Any:
    """Substitute ``{shared}`` in string task arguments (paths into the shared data folder)."""
    if isinstance(value, str) and "{shared}" in value:
        if shared is None:
            raise ValueError(
                "this preset reads shared data: pass --shared DIR (the folder with corpus/)"
            )
        return value.replace("{shared}", shared)
    return value


def expand_grid(
    preset: Preset,
    *,
    device: str = "auto",
    steps: int | None = None,
    scale: float = 1.0,
    shared: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[RunSpec]:
    """All runs of a preset, in the order they will be trained (cheapest widths first)."""
    base = copy.deepcopy(preset.base)
    for key, value in (overrides or {}).items():  # section overrides merge: model.x=... keeps model
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    n_steps = steps if steps is not None else max(1, round(base.get("steps", 1000) * scale))
    base["steps"] = n_steps
    if base.get("warmup_steps") is not None:
        base["warmup_steps"] = min(base["warmup_steps"], n_steps)
    if base.get("eval_every"):
        base["eval_every"] = min(base["eval_every"], n_steps)
    base.update(device=device, progress=False, out_dir=None)
    specs = []
    for width in preset.widths or [None]:
        for cell, cell_spec in preset.cells.items():
            for variant in cell_variants(preset, cell):
                for lr, wd in itertools.product(preset.lrs, preset.weight_decays or [None]):
                    for seed in preset.variant_seeds(variant):
                        data = copy.deepcopy(base)
                        preset.variant_model(variant)  # validates the name
                        data["model"] = {**base.get("model", {}), **VARIANTS[variant]}
                        if width is not None:
                            data["model"]["hidden_size"] = width
                        data["task"] = cell_spec["task"]
                        task_kwargs = {
                            k: _fill(v, shared) for k, v in cell_spec.get("task_kwargs", {}).items()
                        }
                        extra = base.get("task_kwargs", {})  # from --set task_kwargs.x=...
                        data["task_kwargs"] = {**task_kwargs, **extra, "seed": seed}
                        for key, value in cell_spec.items():  # per-cell TrainConfig overrides
                            if key not in CELL_KEYS:
                                data[key] = copy.deepcopy(value)
                        data.update(lr=lr, seed=seed)
                        if wd is not None:
                            data["weight_decay"] = wd
                        config = TrainConfig.from_dict(data)
                        specs.append(RunSpec(variant, cell, width, lr, seed, config, wd, shared))
    return specs


# keys of a cell spec that describe the cell; any other key overrides a TrainConfig field
CELL_KEYS = ("task", "task_kwargs", "variants", "contrast")


def cell_variants(preset: Preset, cell: str) -> list[str]:
    """The preset's variants that run on ``cell`` (a cell may name a subset: ``variants``)."""
    wanted = preset.cells[cell].get("variants")
    return [v for v in preset.variants if wanted is None or v in wanted]


def load_runs(path: Path) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # torn last line of a killed grid
                continue
            runs[record["id"]] = record
    return runs


def run_dir_name(run_id: str) -> str:
    """A run id as a directory name (ids are already tame; this guards odd cell names)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


# statuses of runs that are done: kept in runs.jsonl, skipped by resume, run directory deleted
FINISHED = ("ok", "diverged")


def finished_run_dirs(runs_jsonl: Path) -> set[str]:
    """Directory names of the runs that ``runs_jsonl`` lists as finished (kept, never resumed)."""
    runs = load_runs(runs_jsonl).values()
    return {run_dir_name(r["id"]) for r in runs if r.get("status") in FINISHED}


# the status of a run that has not started (or not finished): not a result, never written
NOT_STARTED = {"status": "partial", "step": None, "seconds": 0.0}


def _record_head(spec: RunSpec, cfg: TrainConfig) -> dict[str, Any]:
    """What every record of a run starts with: its grid point and config."""
    return {
        "id": spec.run_id,
        "variant": spec.variant,
        "cell": spec.cell,
        "width": spec.width,
        "lr": spec.lr,
        "weight_decay": cfg.weight_decay,
        "seed": spec.seed,
        "config": cfg.to_dict(),
    }


def run_one(
    spec: RunSpec,
    *,
    progress: bool = False,
    runs_root: Path | None = None,
    deadline: float | None = None,
    checkpoint_seconds: float | None = None,
    export_final: bool = False,
) -> dict[str, Any]:
    """Train one grid point; failures (divergence, errors) become records, not exceptions.

    With ``runs_root`` the run trains in ``runs_root/<run id>`` and continues from a checkpoint
    found there. ``deadline`` (a ``time.time()`` value): stop with a checkpoint at the first log
    step past it, or do not start at all once it has passed; the record's status is then
    "partial" (to be continued by a later, resumed grid). ``checkpoint_seconds`` None: no
    timed checkpoints. ``export_final``: write the finished model to ``<run dir>/final/``.
    """
    cfg = spec.config.replace(progress=progress)
    start = time.perf_counter()
    record = _record_head(spec, cfg)
    if deadline is not None and time.time() >= deadline:  # queued past the time limit
        return {**record, **NOT_STARTED}
    # the run directory goes into the trainer's config only: record and run id stay as before
    run_cfg = cfg
    if runs_root is not None:
        run_dir = str(runs_root / run_dir_name(spec.run_id))
        run_cfg = cfg.replace(out_dir=run_dir, resume=True, ckpt_minutes=0)
    trainer = None
    on_cuda = _uses_cuda(cfg.device)
    if on_cuda:  # a worker process trains run after run: measure this run's peak alone
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = Trainer(
            run_cfg,
            deadline=deadline,
            checkpoint_seconds=checkpoint_seconds,
            export_final=export_final,
        )
        summary = trainer.train()
        if not summary["finished"]:
            stopped = {"status": "partial", "step": summary["step"], "seconds": summary["seconds"]}
            return {**record, **stopped}
        record.update(status="ok", eval=summary["eval"], train_loss=summary["train_loss"])
        record["device_name"] = _device_name(cfg.device)
        record["num_params"] = summary["num_params"]
    except DivergenceError as err:
        record.update(status="diverged", error=str(err), eval={})
    except Exception as err:  # noqa: BLE001 -- one broken grid point must not kill the grid
        record.update(status="error", error=f"{type(err).__name__}: {err}", eval={})
        record["traceback"] = traceback.format_exc(limit=8)
    if trainer is not None:
        # after a resume the logger holds the whole run (it reads back the run's log.jsonl)
        record["curve"] = [[r["step"], r["loss"]] for r in trainer.logger.of_kind("train")]
        record["eval_curve"] = [
            {k: v for k, v in r.items() if k != "kind"} for r in trainer.logger.of_kind("eval")
        ]
        record.setdefault("num_params", trainer.num_params)
        record["tokens_per_s"] = statistics.median(
            [r["tokens_per_s"] for r in trainer.logger.of_kind("train")] or [0.0]
        )
    if on_cuda:  # for planning how many runs share one GPU (this invocation's part of the run)
        record["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # over every invocation that trained this run (up to the checkpoints it resumed from)
    record["seconds"] = trainer.seconds() if trainer is not None else time.perf_counter() - start
    return record


def _uses_cuda(device: str) -> bool:
    return (device.startswith("cuda") or device == "auto") and torch.cuda.is_available()


def _init_worker(threads: int, counter: Any = None, num_gpus: int = 0) -> None:
    """Worker setup: torch threads, and on multi-GPU hosts one GPU per worker (round robin).

    ``counter`` is a shared integer: each worker takes the next index and sees only GPU
    ``index % num_gpus`` (of those the parent could see, if CUDA_VISIBLE_DEVICES was set).
    """
    if counter is not None and num_gpus > 1:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(num_gpus)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[index % len(ids)]  # before CUDA initializes

    torch.set_num_threads(threads)


def gpus_to_spread_over(specs: list[RunSpec]) -> int:
    """How many GPUs the worker processes of a parallel grid are spread over (0: leave
    CUDA_VISIBLE_DEVICES alone).

    Only runs on an unpinned device ('auto' or 'cuda') are spread: each worker then sees one
    GPU as cuda:0. A grid pinned to 'cuda:1' keeps every worker on that GPU, and a CPU grid
    has nothing to spread.
    """

    unpinned = all(s.config.device in ("auto", "cuda") for s in specs)
    if not specs or not unpinned or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def default_jobs(specs: list[RunSpec]) -> int:
    """CPU grids: one single-threaded run per core (small models waste a second thread, and
    oversubscribed OpenMP threads spin). GPU grids: one run at a time."""

    on_gpu = any(
        s.config.device.startswith("cuda")
        or (s.config.device == "auto" and torch.cuda.is_available())
        for s in specs
    )
    return 1 if on_gpu else max(1, min(len(specs), os.cpu_count() or 1))


def run_grid(
    specs: list[RunSpec],
    out_dir: str | Path,
    *,
    metric: str | None = None,
    progress: bool = True,
    run_progress: bool = False,
    jobs: int = 1,
    threads: int | None = None,
    resume: bool = False,
    deadline: float | None = None,
    checkpoint_minutes: float | None = 2.0,
    keep_run_dirs: bool = False,
    train: bool = True,
) -> list[dict[str, Any]]:
    """Train every spec (with ``resume``: every spec not already in ``out_dir/runs.jsonl``,
    continuing unfinished ones from their checkpoints); returns the records of ``specs``.

    ``jobs > 1`` trains that many runs at once in worker processes (``threads`` torch threads
    each, default 1; on a multi-GPU host the workers are spread over the GPUs); results do
    not depend on ``jobs``. ``deadline`` (a ``time.time()`` value): runs stop, checkpointed,
    at their first log step past it and queued runs do not start; their records (status
    "partial") are returned but not written to runs.jsonl. ``checkpoint_minutes``: wall time
    between a run's checkpoints (None: only when it stops or finishes). ``keep_run_dirs``:
    keep finished runs' directories (final checkpoint, logs) instead of deleting them.
    ``train=False``: train nothing, touch nothing; the runs not finished in runs.jsonl come back
    as "partial" records (for a report of what has finished so far).
    """
    if not train:
        done = load_runs(Path(out_dir) / "runs.jsonl")
        return [
            done[s.run_id]
            if done.get(s.run_id, {}).get("status") in FINISHED
            else {**_record_head(s, s.config), **NOT_STARTED}
            for s in specs
        ]
    if checkpoint_minutes is not None and not checkpoint_minutes > 0:
        raise ValueError(f"checkpoint_minutes must be > 0 (or None), got {checkpoint_minutes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "runs.jsonl"
    runs_root = out / "runs"
    if not resume:  # start over, but never destroy finished runs
        if log_path.exists():
            os.replace(log_path, out / "runs.prev.jsonl")
        if runs_root.exists():  # unfinished runs of an earlier grid must not be continued
            shutil.rmtree(out / "runs.prev", ignore_errors=True)
            os.replace(runs_root, out / "runs.prev")
    done = load_runs(log_path)
    todo = [s for s in specs if done.get(s.run_id, {}).get("status") not in FINISHED]
    run = functools.partial(
        run_one,
        runs_root=runs_root,
        deadline=deadline,
        checkpoint_seconds=None if checkpoint_minutes is None else 60.0 * checkpoint_minutes,
        export_final=keep_run_dirs,  # a deleted run directory needs no final/ folder
    )
    bar = tqdm(
        total=len(specs),
        initial=len(specs) - len(todo),
        desc="compare",
        unit="run",
        disable=not progress,
    )
    if jobs > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = mp.get_context("spawn")  # fork + OpenMP (or CUDA) can deadlock
        # worker i (in start order) gets GPU i % num_gpus: with --jobs 4 on 2 GPUs, two runs each
        num_gpus = gpus_to_spread_over(todo)
        pool = ProcessPoolExecutor(
            max_workers=min(jobs, len(todo)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(threads or 1, ctx.Value("i", 0), num_gpus),
        )
        futures = [pool.submit(run, spec) for spec in todo]
        results = (f.result() for f in as_completed(futures))
        bar.set_postfix_str(f"{min(jobs, len(todo))} parallel jobs")
    else:
        pool = None
        if threads is not None:
            _init_worker(threads)
        results = (run(spec, progress=run_progress) for spec in todo)
    by_id = {s.run_id: s for s in todo}
    with contextlib.ExitStack() as stack:
        if pool is not None:  # on Ctrl-C, drop queued runs instead of waiting for them
            stack.callback(pool.shutdown, cancel_futures=True)
        log = stack.enter_context(open(log_path, "a"))
        for record in results:
            spec = by_id[record["id"]]
            done[spec.run_id] = record
            if record["status"] == "partial":  # not a result: its checkpoint carries it on
                where = "not started"
                if record["step"]:
                    where = f"stopped at step {record['step']}/{spec.config.steps}"
                bar.write(f"[unfinished] {spec.run_id}: {where} (time limit; --resume continues)")
                continue
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
            if record["status"] in FINISHED and not keep_run_dirs:  # the record is all we keep
                shutil.rmtree(runs_root / run_dir_name(spec.run_id), ignore_errors=True)
            bar.update(1)
            if record["status"] != "ok":
                bar.write(f"[{record['status']}] {spec.run_id}: {record.get('error', '')[:200]}")
            elif metric is not None and metric in record["eval"]:
                took = f"{record['seconds']:.0f}s"
                bar.write(f"{spec.run_id}: {metric}={record['eval'][metric]:.4g} ({took})")
    bar.close()
    return [done[s.run_id] for s in specs]


# ---------------------------------------------------------------------------- selection
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
        row["curve"] = best_run.get("curve", [])
        row["eval_curve"] = [
            [r["step"], r[metric]] for r in best_run.get("eval_curve", []) if metric in r
        ]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- the whole job
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
    :func:`training_deadline`), the table then holds the finished runs' cells only and says
    how many runs are unfinished. ``checkpoint_minutes``, ``keep_run_dirs``: see
    :func:`run_grid`. ``train=False``: train nothing; report the runs finished in
    ``out_dir/runs.jsonl`` (e.g. after several partial commands into the same folder); a cell
    whose sweep is unfinished shows the best of its finished runs, marked ``*``. Returns (best
    rows, markdown table; with the preset's ``contrast``, the per-seed margin line under it;
    the unfinished runs' line and how to continue them).
    """
    from deltaflow.lab.plots import make_plots
    from deltaflow.lab.report import contrast_line, markdown_report, results_table

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
    device_name = _device_name(specs[0].config.device if specs else device)
    if not train:  # the runs' own record of where they trained, not this machine
        names = sorted({r["device_name"] for r in finished if r.get("device_name")})
        device_name = ", ".join(names) or (specs[0].config.device if specs else device)
    elif jobs > 1:
        device_name += f", {jobs} runs in parallel ({threads or 1} thread each)"
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
    peaks = [r["peak_gpu_memory_gib"] for r in records if r.get("peak_gpu_memory_gib")]
    if peaks:
        details.append(f"peak GPU memory per run {min(peaks):.2f}-{max(peaks):.2f} GiB")
    pending = ""
    if unfinished:
        again = command if " --resume" in f"{command} " else f"{command} --resume"
        if train:
            pending = (
                f"**{len(unfinished)} of {len(records)} runs unfinished** (time limit reached; "
                f"{len(incomplete)} cells left out of the table; runs stopped in flight have "
                f"checkpoints in {out / 'runs'}). To continue, run the same command with --resume"
                + (f":\n\n    {again}" if command else ".")
            )
        else:  # a report of a grid that is still being trained, command by command
            pending = (
                f"**{len(unfinished)} of {len(records)} runs not trained yet**: a value marked "
                "* is the best of its cell's runs finished so far, not of the whole sweep "
                f"({len(incomplete)} cells incomplete; `runs_finished` in summary.json). To "
                "train the rest, run the command without --report-only, with --resume"
                + (f":\n\n    {again.replace(' --report-only', '')}" if command else ".")
            )
        if len(unfinished) <= 20:
            details.append("unfinished: " + ", ".join(r["id"] for r in unfinished))
    report = markdown_report(
        rows,
        preset,
        command=command,
        device=device_name,
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


def training_deadline(now: float, time_limit_minutes: float) -> float:
    """When training must stop for a call given ``time_limit_minutes`` from ``now``: a reserve
    of 10% of the limit (at least 10 s, at most 60 s) is left for what follows the deadline:
    running on to the next log step, the checkpoint, a last run's final evaluation, the report."""
    if not time_limit_minutes > 0:
        raise ValueError(f"time limit must be > 0 minutes, got {time_limit_minutes}")
    limit = 60.0 * time_limit_minutes
    return now + limit - min(60.0, max(10.0, 0.1 * limit))


def _device_name(device: str) -> str:

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name()})"
    return f"cpu ({os.cpu_count()} cores)"


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
