"""Train a grid's runs: one at a time or in a pool of worker processes, resumably.

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
import functools
import json
import os
import re
import shutil
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from deltaflow.lab.grid import RunSpec, upgrade_record
from deltaflow.train import DivergenceError, TrainConfig, Trainer


def load_runs(path: Path) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # torn last line of a killed grid
                continue
            record = upgrade_record(record)  # a renamed variant's record, under today's name
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


def record_head(spec: RunSpec, cfg: TrainConfig) -> dict[str, Any]:
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
    ``export_final``: write the finished model to ``<run dir>/final/``.

    With ``runs_root`` the run trains in ``runs_root/<run id>`` and continues from a checkpoint
    found there. ``deadline`` (a ``time.time()`` value): stop with a checkpoint at the first log
    step past it, or do not start at all once it has passed; the record's status is then
    "partial" (to be continued by a later, resumed grid).
    """
    cfg = spec.config.replace(progress=progress)
    start = time.perf_counter()
    record = record_head(spec, cfg)
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
        record["device_name"] = device_name(cfg.device)
        record["num_params"] = summary["num_params"]
        if cfg.early_stop is not None:  # the step it reached early_stop; None: never did
            record["stopped_early_at"] = summary.get("stopped_early_at")
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
            else {**record_head(s, s.config), **NOT_STARTED}
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


def training_deadline(now: float, time_limit_minutes: float) -> float:
    """When training must stop for a call given ``time_limit_minutes`` from ``now``: a reserve
    of 10% of the limit (at least 10 s, at most 60 s) is left for what follows the deadline:
    running on to the next log step, the checkpoint, a last run's final evaluation, the report."""
    if not time_limit_minutes > 0:
        raise ValueError(f"time limit must be > 0 minutes, got {time_limit_minutes}")
    limit = 60.0 * time_limit_minutes
    return now + limit - min(60.0, max(10.0, 0.1 * limit))


def device_name(device: str) -> str:
    """The device a run trained on, as its record says: 'cuda (NVIDIA H200)', 'cpu (16 cores)'."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name()})"
    return f"cpu ({os.cpu_count()} cores)"
