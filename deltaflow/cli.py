"""The ``deltaflow`` command line: train, eval, generate, export, compare, stability.

    deltaflow train --task mqar --rule efla --decay --steps 2000 --out runs/efla
    deltaflow train --config configs/mqar_efla.yaml --lr 3e-4 --set model.qk_norm=l2
    deltaflow eval runs/efla                       # latest checkpoint of a run directory
    deltaflow export runs/efla --out exported/efla # a transformers save_pretrained folder
    deltaflow generate runs/lm --prompt "It is a truth" --max-new-tokens 100
    deltaflow compare                              # the main job: quick CPU preset (<= 2 min)
    deltaflow compare --preset mqar_512 --device cuda --out results/mqar_512

Every ``train`` flag maps onto a field of :class:`deltaflow.train.TrainConfig`; precedence is
defaults < ``--config`` file < flags < ``--set key=value``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

# train flag -> (config section or None, field name)
_TRAIN_FIELDS: dict[str, tuple[str | None, str]] = {
    "task": (None, "task"),
    "steps": (None, "steps"),
    "batch_size": (None, "batch_size"),
    "grad_accum": (None, "grad_accum"),
    "lr": (None, "lr"),
    "min_lr_ratio": (None, "min_lr_ratio"),
    "warmup_steps": (None, "warmup_steps"),
    "weight_decay": (None, "weight_decay"),
    "grad_clip": (None, "grad_clip"),
    "eval_every": (None, "eval_every"),
    "eval_lengths": (None, "eval_lengths"),
    "log_every": (None, "log_every"),
    "ckpt_every": (None, "ckpt_every"),
    "ckpt_minutes": (None, "ckpt_minutes"),
    "out": (None, "out_dir"),
    "seed": (None, "seed"),
    "device": (None, "device"),
    "precision": (None, "precision"),
    "parallel": (None, "parallel"),
    "compile": (None, "compile"),
    "seq_len": ("task_kwargs", "seq_len"),
    "num_kv_pairs": ("task_kwargs", "num_kv_pairs"),
    "vocab_size": ("task_kwargs", "vocab_size"),
    "data_dir": ("task_kwargs", "data_dir"),
    "tokenizer": ("task_kwargs", "tokenizer"),
    "tokenizer_path": ("task_kwargs", "tokenizer_path"),
    "rule": ("model", "rule"),
    "decay": ("model", "use_decay"),
    "negative_eigenvalues": ("model", "negative_eigenvalues"),
    "beta_activation": ("model", "beta_activation"),
    "hidden_size": ("model", "hidden_size"),
    "num_layers": ("model", "num_layers"),
    "num_heads": ("model", "num_heads"),
    "head_dim": ("model", "head_dim"),
    "attn_every": ("model", "attn_every"),
    "backend": ("model", "backend"),
}


def _kv(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return text


# ---------------------------------------------------------------------------- train
def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train one model on one task",
        description="Train a model on a task. Flags override --config; --set overrides both.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="YAML file with TrainConfig fields")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. model.qk_norm=l2 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    g = p.add_argument_group("task")
    g.add_argument("--task", help="mqar, parity, mod_arith, s5, lm, in_context_recall, ...")
    g.add_argument(
        "--task-arg",
        dest="task_args",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="task constructor argument (repeatable)",
    )
    g.add_argument("--seq-len", type=int)
    g.add_argument("--num-kv-pairs", type=int, help="MQAR key-value pairs")
    g.add_argument("--vocab-size", type=int, help="synthetic task vocabulary")
    g.add_argument("--data-dir", help="lm: directory of .txt files")
    g.add_argument("--tokenizer", choices=["byte", "bpe"], help="lm tokenizer")
    g.add_argument("--tokenizer-path", help="lm: GPT-2 .tiktoken file for --tokenizer bpe")
    g = p.add_argument_group("model")
    g.add_argument(
        "--rule", help="step rule: linear, delta, efla, longhorn, trapezoid, kaczmarz, ..."
    )
    g.add_argument(
        "--decay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gated variant: data-dependent decay (Gated DeltaNet style)",
    )
    g.add_argument(
        "--negative-eigenvalues",
        "--neg-eig",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="transition eigenvalues in (-1, 1] instead of [0, 1]",
    )
    g.add_argument("--beta-activation", choices=["sigmoid", "softplus"])
    g.add_argument("--qk-norm", help="'l2' | 'none' | 'Q,K' e.g. 'l2,none' (default: per rule)")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-layers", type=int)
    g.add_argument("--num-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument(
        "--attn-every", type=int, help="every k-th layer softmax attention (1: a Transformer)"
    )
    g.add_argument("--backend", choices=["auto", "reference", "torch", "triton"])
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int, help="GLOBAL batch (all GPUs, all micro-steps)")
    g.add_argument("--grad-accum", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr-ratio", type=float)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float)
    g = p.add_argument_group("evaluation, logging, runtime")
    g.add_argument("--eval-every", type=int)
    g.add_argument(
        "--eval-lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma-separated, e.g. 512,1024,2048",
    )
    g.add_argument("--log-every", type=int)
    g.add_argument("--ckpt-every", type=int)
    g.add_argument(
        "--ckpt-minutes",
        type=float,
        help="also checkpoint every so many minutes of wall time (0: off) [config default: 10]",
    )
    g.add_argument(
        "--out",
        help="run directory: logs, checkpoints, run_config.yaml; a run there is resumed (with "
        "the same training settings only)",
    )
    g.add_argument(
        "--no-resume",
        action="store_true",
        help="start over: a run already in --out is moved to --out/archive/<time>/",
    )
    g.add_argument(
        "--fork",
        metavar="NEWDIR",
        help="train in NEWDIR, starting from --out's latest checkpoint (weights, optimizer, "
        "step) with this command's settings, e.g. another --lr; the same command resumes it",
    )
    g.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="resume an FSDP checkpoint whose signed manifest does not verify (its "
        "dcp/.metadata is a pickle: only for folders whose writer you trust)",
    )
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto | cpu | cuda | cuda:1")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"])
    g.add_argument(
        "--parallel",
        choices=["ddp", "fsdp"],
        help="under torchrun: ddp (replicated model) or fsdp (FSDP2, sharded model and "
        "checkpoints) [config default: ddp]",
    )
    g.add_argument(
        "--compile",
        choices=["auto", "blocks", "off"],
        help="torch.compile every model block (fused glue, selective activation "
        "checkpointing): auto = on CUDA only [config default: auto]",
    )
    g.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train)


def resolve_train_config(args: argparse.Namespace) -> Any:
    from deltaflow.train import TrainConfig, apply_overrides

    data: dict[str, Any] = TrainConfig().to_dict() if args.config is None else {}
    if args.config is not None:
        data = TrainConfig.from_yaml(args.config).to_dict()
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for flag, (section, name) in _TRAIN_FIELDS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if section is None:
            data[name] = value
        else:
            data.setdefault(section, {})[name] = value
    if args.qk_norm is not None:
        parts = args.qk_norm.split(",")
        data["model"]["qk_norm"] = parts[0] if len(parts) == 1 else parts
    for item in args.task_args:
        key, raw = item.split("=", 1)
        data["task_kwargs"][key] = yaml.safe_load(raw)
    if args.no_resume:
        data["resume"] = False
    if args.no_progress:
        data["progress"] = False
    data = apply_overrides(data, args.overrides)
    return TrainConfig.from_dict(data)


def cmd_train(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer

    config = resolve_train_config(args)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    fork_from = None
    if args.fork is not None:
        if config.out_dir is None or args.no_resume:
            raise ValueError("--fork NEWDIR needs --out (the run to fork) and no --no-resume")
        fork_from, config = config.out_dir, config.replace(out_dir=args.fork)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        trainer = Trainer(
            config,
            fork_from=fork_from,
            handle_signals=True,
            verbose=True,
            trust_checkpoint=args.trust_checkpoint,
        )
    except KeyboardInterrupt:
        print("interrupted before training started: nothing to save", file=sys.stderr)
        return 130
    try:
        summary = trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C: quit without saving
        print(
            f"interrupted at step {trainer.step}; the last checkpoint is kept, resume with: "
            f"{_resume_command(args.argv)}",
            file=sys.stderr,
        )
        return 130
    finally:
        trainer.close()
    if summary.get("stopped") and rank0:
        if config.out_dir is None:
            print(f"stopped at step {summary['step']} (no --out: nothing saved)", file=sys.stderr)
        else:
            resume = _resume_command(args.argv)
            print(f"saved step {summary['step']}, resume with: {resume}", file=sys.stderr)
        return 0
    if rank0:
        print(json.dumps(summary, indent=2))
    return 0


def _resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same one, without --no-resume (which would
    archive the run just saved). A fork's command resumes the fork (NEWDIR has a checkpoint)."""
    kept = [a for a in argv if a != "--no-resume"]
    return "deltaflow " + " ".join(shlex.quote(a) for a in kept)


# ---------------------------------------------------------------------------- eval / generate
def _load_trained(path: str, device: str) -> tuple[Any, Any, Path]:
    """(config, model with checkpoint weights, checkpoint dir) for a run or checkpoint dir."""
    from deltaflow.train import TrainConfig, build_model, load_checkpoint, resolve_checkpoint
    from deltaflow.train.trainer import DistInfo, resolve_device

    ckpt = resolve_checkpoint(path)
    config = TrainConfig.from_yaml(ckpt / "config.yaml").replace(device=device, out_dir=None)
    vocab = _vocab_size(config)
    model = build_model(config, vocab).to(resolve_device(device, DistInfo()))
    load_checkpoint(ckpt, model=model, restore_rng=False)
    model.eval()
    return config, model, ckpt


def _vocab_size(config: Any) -> int:
    if config.task == "lm":
        from deltaflow.tasks.language import get_tokenizer

        kw = config.task_kwargs
        return get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path")).vocab_size
    from deltaflow.train import build_task

    return build_task(config).vocab_size


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on its task (or a variant of it)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint dir or run dir (uses its latest checkpoint)")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    p.add_argument(
        "--task-arg",
        dest="task_args",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="change a task argument, e.g. seq_len=1024",
    )
    p.add_argument("--eval-lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--num-examples", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print metrics as JSON")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer, build_task

    config, model, ckpt = _load_trained(args.checkpoint, args.device)
    changes: dict[str, Any] = {"resume": False, "progress": False}
    task_kwargs = dict(config.task_kwargs)
    for item in args.task_args:
        key, raw = item.split("=", 1)
        task_kwargs[key] = yaml.safe_load(raw)
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
    metrics = trainer.evaluate(args.split)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        print(f"{ckpt}  ({config.task}, {args.split})")
        width = max(len(k) for k in metrics)
        for key, value in metrics.items():
            print(f"  {key:<{width}}  {value:.6g}")
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a language-model checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint dir or run dir of an `lm` task run")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter; 1: off")
    p.add_argument(
        "--decode-mode",
        choices=["compile", "graph", "eager", "transformers"],
        help="default: compile (CUDA graph of the compiled step) on CUDA, transformers on CPU",
    )
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from deltaflow.lab.generate import sample
    from deltaflow.tasks.language import get_tokenizer

    config, model, _ = _load_trained(args.checkpoint, args.device)
    if config.task != "lm":
        raise SystemExit(
            f"generate needs a language-model checkpoint (task 'lm'), got {config.task!r}"
        )
    kw = config.task_kwargs
    tokenizer = get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path"))
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise SystemExit("--prompt encodes to no tokens; give some text")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt] * args.num_samples, device=device)
    torch.manual_seed(args.seed)  # deltaflow models sample from the global RNG
    out = sample(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        decode_mode=args.decode_mode,
    )
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tokenizer.decode(row))
    return 0


# ---------------------------------------------------------------------------- export
def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a transformers save_pretrained folder",
        description="Write a run's latest checkpoint (or a given checkpoint folder) as a "
        "save_pretrained folder: config.json, model.safetensors, train_config.yaml and, for "
        "language-model runs, the tokenizer (tokenizer.json). Open it with "
        "AutoModelForCausalLM.from_pretrained(DIR) after `import deltaflow.models`. Finished "
        "runs already have one: RUN/final/.",
    )
    p.add_argument("checkpoint", help="run dir (its latest checkpoint) or checkpoint dir")
    p.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from deltaflow.train.checkpoint import resolve_checkpoint
    from deltaflow.train.export import export_checkpoint

    ckpt = resolve_checkpoint(args.checkpoint)
    if Path(args.out).resolve() in (Path(args.checkpoint).resolve(), ckpt.resolve()):
        raise ValueError("--out must be a new folder, not the run or checkpoint itself")
    dest = export_checkpoint(ckpt, args.out)
    print(f"exported {ckpt} to {dest}")
    return 0


# ---------------------------------------------------------------------------- compare
def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    from deltaflow.lab.presets import PRESETS

    p = sub.add_parser(
        "compare",
        help="run a grid of rules x tasks x widths x lrs x seeds; tables and plots",
        description="Run a preset grid, keep the best learning rate per cell, write "
        "results.md, summary.json, runs.jsonl and PNG plots. Every invocation trains from "
        "scratch (an old runs.jsonl is kept as runs.prev.jsonl, old run directories as "
        "runs.prev/) unless --resume is given. Runs checkpoint as they train, so --resume "
        "also continues runs cut off by a kill or by --time-limit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default="quick", choices=sorted(PRESETS))
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
    p.add_argument("--device", default="auto")
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
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="override a base config field of every run, e.g. "
        "model.num_layers=4 or 'eval_kwargs={num_examples: 64}' (repeatable)",
    )
    p.add_argument(
        "--shared",
        help="folder with corpus/ and tokenizers/ (lm_corpus preset); "
        "default: $DELTAFLOW_SHARED, ./shared or ../shared",
    )
    p.add_argument("--jobs", type=int, help="parallel runs (default: CPU cores on CPU, 1 on GPU)")
    p.add_argument("--threads", type=int, help="torch threads per run (default 1 when --jobs > 1)")
    p.add_argument("--note", help="a line put at the top of results.md (e.g. 'CPU-scale run')")
    p.add_argument("--list", action="store_true", help="list presets and variants, exit")
    p.add_argument("--dry-run", action="store_true", help="print the runs, train nothing")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write results.md, summary.json and plots from the runs already "
        "finished in --out (a cell whose sweep is unfinished: its best so far, marked *)",
    )
    p.add_argument("--no-progress", action="store_true")
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
    from deltaflow.lab.presets import PRESETS, VARIANTS

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
        bad = [v for v in wanted if v not in VARIANTS]
        if bad:
            raise SystemExit(f"unknown variants {bad}; known: {', '.join(VARIANTS)}")
        preset.variants = wanted
    if args.cells:
        wanted = _csv(args.cells, flag="--cells")
        bad = [c for c in wanted if c not in preset.cells]
        if bad:
            raise SystemExit(
                f"unknown cells {bad} for preset {preset.name}; has {list(preset.cells)}"
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
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltaflow",
        description="Delta-rule linear attention lab: train, evaluate, compare step rules.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(sub)
    add_eval_parser(sub)
    add_generate_parser(sub)
    add_export_parser(sub)
    add_compare_parser(sub)
    try:  # written by another module; the CLI works without it
        from deltaflow.analysis.cli import add_stability_parser
    except ImportError:
        pass
    else:
        add_stability_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # recorded with results (results/*/command.txt)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as err:  # OSError: files, a full disk
        if os.environ.get("DELTAFLOW_DEBUG"):
            raise
        print(f"deltaflow {args.command}: error: {err}", file=sys.stderr)
        print("(set DELTAFLOW_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
