"""``deltaflow compare``: a preset grid of runs, its tables and plots."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from deltaflow.cli import COMMANDS
from deltaflow.cli.common import (
    _device,
    _positive_int,
    add_kv_flag,
    check_out_dir,
)
from deltaflow.validation import did_you_mean


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    from deltaflow.lab.presets import PRESETS

    p = sub.add_parser(
        "compare",
        help=COMMANDS["compare"][0],
        description="Run a preset grid, keep the best learning rate per cell, write "
        "results.md, summary.json, runs.jsonl and PNG plots. Every invocation trains from "
        "scratch (an old runs.jsonl is kept as runs.prev.jsonl, old run directories as "
        "runs.prev/) unless --resume is given. Runs checkpoint as they train, so --resume "
        "also continues runs cut off by a kill or by --time-limit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset", default="quick", choices=sorted(PRESETS), help="grid to run (see --list)"
    )
    p.add_argument(
        "--out",
        help="output directory (default: runs/compare/<preset>; runs/ is git-ignored, the "
        "committed example results in results/ are never written or resumed by default)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs already in <out>/runs.jsonl and train only the rest, "
        "continuing unfinished runs from their checkpoints in <out>/runs/ (continue an "
        "interrupted grid); without it every run is trained again from scratch",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="wall-time budget of this command: when it is nearly used (10%% kept in reserve, "
        "10-60 s) training stops with a checkpoint, the table holds the finished runs and the "
        "command exits 0; re-run it with --resume to continue (e.g. 9 for a 10-minute limit)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=float,
        default=2.0,
        metavar="MINUTES",
        help="wall time between a run's checkpoints, so a killed command loses at most that "
        "much of each run in flight (0: checkpoint only when a run stops or ends)",
    )
    p.add_argument(
        "--keep-run-dirs",
        action="store_true",
        help="keep finished runs' directories in <out>/runs/ (final checkpoint, logs); by "
        "default they are deleted once the run's record is in runs.jsonl",
    )
    p.add_argument(
        "--device", type=_device, default="auto", help="auto, cpu, cuda (every GPU) or cuda:N"
    )
    p.add_argument("--steps", type=int, help="training steps per run (overrides the preset)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the preset's steps")
    p.add_argument("--variants", help="comma-separated subset of the preset's variants")
    p.add_argument("--cells", help="comma-separated subset of the preset's task cells")
    p.add_argument("--widths", help="comma-separated model widths (replaces the preset's)")
    p.add_argument("--lrs", help="comma-separated learning rates (replaces the preset's)")
    p.add_argument(
        "--wds",
        help="comma-separated AdamW weight decays to sweep (replaces the preset's); the best "
        "(lr, weight decay) pair per cell is kept",
    )
    p.add_argument(
        "--seeds",
        type=int,
        help="number of seeds (0..N-1) for every variant (replaces per-variant seed counts)",
    )
    p.add_argument("--batch-size", type=int, help="override the preset's batch size")
    add_kv_flag(
        p,
        "--set",
        "overrides",
        "override a base config field of every run, e.g. "
        "model.num_layers=4 or 'eval_kwargs={num_examples: 64}' (repeatable)",
    )
    p.add_argument(
        "--shared",
        help="folder with corpus/ and tokenizers/ (lm_corpus preset); "
        "default: $DELTAFLOW_SHARED, ./shared or ../shared",
    )
    p.add_argument(
        "--jobs", type=_positive_int, help="parallel runs (default: CPU cores on CPU, 1 on GPU)"
    )
    p.add_argument(
        "--threads", type=_positive_int, help="torch threads per run (default 1 when --jobs > 1)"
    )
    p.add_argument("--note", help="a line put at the top of results.md (e.g. 'CPU-scale run')")
    p.add_argument("--list", action="store_true", help="list presets and variants, exit")
    p.add_argument("--dry-run", action="store_true", help="print the runs, train nothing")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write results.md, summary.json and plots from the runs already "
        "finished in --out (a cell whose sweep is unfinished: its best so far, marked *)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compare)


def _shared_dir(arg: str | None) -> str | None:
    candidates = [arg, os.environ.get("DELTAFLOW_SHARED"), "shared", "../shared"]
    for c in candidates:
        if c and (Path(c) / "corpus").is_dir():
            return str(Path(c).resolve())
    return arg


def _csv(text: str, cast: type = str, *, flag: str = "", low: float | None = None) -> list:
    """Comma-separated values; bad ones are an error naming the flag (``--lrs``, ...)."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = cast(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a valid {cast.__name__}") from None
        if low is not None and value < low:
            raise ValueError(f"{flag}: every value must be >= {low}, got {item}")
        values.append(value)
    if not values:
        raise ValueError(f"{flag}: expected a comma-separated list, got {text!r}")
    return values


def cmd_compare(args: argparse.Namespace) -> int:
    from deltaflow.lab import compare, expand_grid, get_preset
    from deltaflow.lab.presets import PRESETS, VARIANTS, check_variants

    if args.list:
        for name, p in PRESETS.items():
            print(
                f"{name}: {p.description}\n  variants: {', '.join(p.variants)}\n"
                f"  cells: {', '.join(p.cells)}; widths: {p.widths}; lrs: {p.lrs}; "
                f"weight decays: {p.weight_decays or p.base.get('weight_decay', 'default')}; "
                f"seeds: {len(p.seeds)}"
                + (
                    f" ({ {v: len(s) for v, s in p.seeds_per_variant.items()} })"
                    if p.seeds_per_variant
                    else ""
                )
                + f"; steps: {p.base.get('steps')}"
            )
        print("known variants: " + ", ".join(f"{k} {v}" for k, v in VARIANTS.items()))
        return 0
    preset = get_preset(args.preset)
    if args.variants:
        wanted = _csv(args.variants, flag="--variants")
        check_variants(wanted, "--variants")
        preset.variants = wanted
    if args.cells:
        wanted = _csv(args.cells, flag="--cells")
        bad = [c for c in wanted if c not in preset.cells]
        if bad:
            raise ValueError(
                f"--cells: unknown cell {bad[0]!r}{did_you_mean(bad[0], preset.cells)} for "
                f"preset {preset.name}; it has {', '.join(preset.cells)}"
            )
        preset.cells = {c: preset.cells[c] for c in wanted}
    if args.widths:
        preset.widths = _csv(args.widths, int, flag="--widths", low=1)
    if args.lrs:
        preset.lrs = _csv(args.lrs, float, flag="--lrs")
        if any(lr <= 0 for lr in preset.lrs):
            raise ValueError(f"--lrs: learning rates must be > 0, got {args.lrs}")
    if args.wds:
        preset.weight_decays = _csv(args.wds, float, flag="--wds", low=0.0)
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0 minutes, got {args.time_limit:g}")
    if not args.checkpoint_every >= 0:
        raise ValueError(f"--checkpoint-every must be >= 0 minutes, got {args.checkpoint_every:g}")
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        preset.seeds = list(range(args.seeds))
        preset.seeds_per_variant = {}
    from deltaflow.train import apply_overrides

    overrides = apply_overrides({}, args.overrides)
    if args.batch_size:
        overrides["batch_size"] = args.batch_size
    shared = _shared_dir(args.shared)
    out = Path(args.out or f"runs/compare/{preset.name}")
    check_out_dir(out, "--out")
    if args.report_only:  # a fresh clone has no runs/compare/<preset> yet: the report says so
        out.mkdir(parents=True, exist_ok=True)
    specs = expand_grid(
        preset,
        device=args.device,
        steps=args.steps,
        scale=args.scale,
        shared=shared,
        overrides=overrides,
    )
    if args.dry_run:
        for s in specs:
            print(s.run_id)
        mode = "resuming" if args.resume else "from scratch"
        print(f"{len(specs)} runs of {specs[0].config.steps} steps -> {out} ({mode})")
        return 0
    if not args.report_only:  # a missing GPU is one line here, not a grid of failed runs
        from deltaflow.train.dist import DistInfo, resolve_device

        resolve_device(args.device, DistInfo())
    command = "deltaflow " + " ".join(shlex.quote(a) for a in args.argv)
    _, table = compare(
        preset,
        out,
        device=args.device,
        steps=args.steps,
        scale=args.scale,
        shared=shared,
        overrides=overrides,
        command=command.strip(),
        progress=not args.no_progress,
        jobs=args.jobs,
        threads=args.threads,
        note=args.note,
        resume=args.resume,
        time_limit_minutes=args.time_limit,
        checkpoint_minutes=args.checkpoint_every or None,  # 0: no periodic checkpoints
        keep_run_dirs=args.keep_run_dirs,
        train=not args.report_only,
    )
    seeds = max(len(preset.variant_seeds(v)) for v in preset.variants)
    agg = "" if seeds == 1 else f", {preset.seed_aggregate} over up to {seeds} seeds"
    wd = " x weight decay" if preset.weight_decays else ""
    print(f"\n{preset.name}: {preset.metric} at the best lr{wd} per cell{agg} ({out}/results.md)\n")
    print(table)
    if preset.expect:
        print(f"\nExpected: {preset.expect}")
    return 0


# ---------------------------------------------------------------------------- main
