"""``deltaflow eval``: a checkpoint on its task, or lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deltaflow.cli import COMMANDS
from deltaflow.cli.common import (
    _device,
    _int_list,
    _load_trained,
    _positive_int,
    _resolved_device,
    _threads_flag,
    _trust_flag,
    add_kv_flag,
    check_out_dir,
)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help=COMMANDS["eval"][0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint dir or run dir (uses its latest checkpoint)")
    p.add_argument(
        "--split", default="valid", choices=["train", "valid", "test"], help="split to evaluate"
    )
    add_kv_flag(
        p,
        "--task-arg",
        "task_args",
        "change a task argument, e.g. seq_len=1024",
    )
    p.add_argument(
        "--eval-lengths", type=_int_list, help="comma-separated lengths, e.g. 512,1024,2048"
    )
    p.add_argument(
        "--num-examples", type=_positive_int, help="evaluation examples (default: the run's)"
    )
    p.add_argument("--batch-size", type=_positive_int, help="evaluation batch (default: the run's)")
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    _threads_flag(p)
    p.add_argument("--json", action="store_true", help="print metrics as JSON")
    _trust_flag(p)
    p.add_argument(
        "--output",
        metavar="FILE",
        help="also write the metrics (with --lm-eval: lm-eval's results per task) to FILE as JSON",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (lm-eval draws its own)"
    )
    g = p.add_argument_group("lm-evaluation-harness (pip install 'deltaflow[eval]')")
    g.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="comma-separated lm-eval tasks (e.g. lambada_openai,hellaswag) instead of the "
        "run's own task; --batch-size is requests per forward",
    )
    g.add_argument(
        "--lm-eval-include",
        action="append",
        metavar="DIR",
        help="folder of task YAMLs (e.g. from deltaflow lm-eval-task); repeatable",
    )
    g.add_argument("--limit", type=float, help="lm-eval: examples per task (< 1: a fraction)")
    g.add_argument("--num-fewshot", type=int, help="lm-eval: few-shot examples")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer, build_task
    from deltaflow.train.config import parse_value
    from deltaflow.train.cpu import set_threads

    set_threads(args.threads, _resolved_device(args.device))
    if args.lm_eval:
        return _cmd_lm_eval(args)

    config, model, ckpt = _load_trained(args.checkpoint, args.device, args.trust_checkpoint)
    changes: dict[str, Any] = {"resume": False, "progress": False}
    task_kwargs = dict(config.task_kwargs)
    for item in args.task_args:
        key, raw = item.split("=", 1)
        task_kwargs[key] = parse_value(f"--task-arg {key}", raw)
    changes["task_kwargs"] = task_kwargs
    eval_kwargs = dict(config.eval_kwargs)
    if args.num_examples is not None:
        eval_kwargs["num_examples"] = args.num_examples
    if args.batch_size is not None:
        eval_kwargs["batch_size"] = args.batch_size
    changes["eval_kwargs"] = eval_kwargs
    if args.eval_lengths is not None:
        changes["eval_lengths"] = args.eval_lengths
    config = config.replace(**changes)
    trainer = Trainer(config, model=model, task=build_task(config))
    metrics = trainer.evaluate(args.split, progress=not args.no_progress)
    _write_output(args.output, metrics)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        print(f"{ckpt}  ({config.task}, {args.split})")
        width = max(len(k) for k in metrics)
        for key, value in metrics.items():
            print(f"  {key:<{width}}  {value:.6g}")
    return 0


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    from deltaflow.evals.harness import evaluate

    results = evaluate(
        args.checkpoint,
        [t.strip() for t in args.lm_eval.split(",") if t.strip()],
        include_path=args.lm_eval_include,
        limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size or 8,
        device=args.device,
    )
    _write_output(args.output, results["results"])
    if args.json:
        print(json.dumps(results["results"], indent=2, default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


def _write_output(path: str | None, results: dict[str, Any]) -> None:
    """``--output FILE``: the results as JSON (the folder is created)."""
    if path is None:
        return
    check_out_dir(Path(path).parent, "--output")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
