"""``deltaflow train``: its flags are derived from TrainConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from deltaflow.cli import COMMANDS
from deltaflow.cli.common import (
    _device,
    _int_list,
    _threads_flag,
    _vocab_size,
    add_kv_flag,
    check_out_dir,
)
from deltaflow.ops.checks import BACKENDS
from deltaflow.rules import RULES
from deltaflow.validation import did_you_mean

# Shortcut flags for the most used keys of the task and model sections. The keys themselves are
# declared by the task classes and DeltaFlowConfig (and checked there); every other key is
# reached with --task-arg / --set. flag -> (section, key, argparse keywords)
_SECTION_FLAGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "--seq-len": ("task_kwargs", "seq_len", dict(type=int, help="training sequence length")),
    "--num-kv-pairs": ("task_kwargs", "num_kv_pairs", dict(type=int, help="MQAR key-value pairs")),
    "--vocab-size": (
        "task_kwargs",
        "vocab_size",
        dict(type=int, help="synthetic task vocabulary (the model's is the task's)"),
    ),
    "--data-dir": (
        "task_kwargs",
        "data_dir",
        dict(
            help="lm: folder (or file) of .txt, .jsonl or .parquet documents, or a "
            "datasets.save_to_disk folder"
        ),
    ),
    "--tokenizer": (
        "task_kwargs",
        "tokenizer",
        dict(help="lm: byte | bpe | hf, or a Hugging Face tokenizer folder or a .tiktoken file"),
    ),
    "--tokenizer-path": (
        "task_kwargs",
        "tokenizer_path",
        dict(help="lm: the .tiktoken file (--tokenizer bpe) or folder (hf)"),
    ),
    "--rule": (
        "model",
        "rule",
        dict(help="step rule: " + ", ".join(RULES)),
    ),
    "--decay": (
        "model",
        "use_decay",
        dict(
            action=argparse.BooleanOptionalAction,
            help="gated variant: data-dependent decay (Gated DeltaNet style)",
        ),
    ),
    "--negative-eigenvalues": (
        "model",
        "negative_eigenvalues",
        dict(
            action=argparse.BooleanOptionalAction,
            help="transition eigenvalues in (-1, 1] instead of [0, 1] (alias --neg-eig)",
        ),
    ),
    "--beta-activation": (
        "model",
        "beta_activation",
        dict(choices=["sigmoid", "softplus"], help="step size β activation"),
    ),
    "--hidden-size": ("model", "hidden_size", dict(type=int, help="model width (default 512)")),
    "--num-layers": ("model", "num_layers", dict(type=int, help="blocks (default 8)")),
    "--num-heads": ("model", "num_heads", dict(type=int, help="heads per layer (default 4)")),
    "--head-dim": (
        "model",
        "head_dim",
        dict(type=int, help="key dim per head (default hidden_size / num_heads)"),
    ),
    "--attn-every": (
        "model",
        "attn_every",
        dict(type=int, help="every k-th layer softmax attention (1: a Transformer)"),
    ),
    "--backend": (
        "model",
        "backend",
        dict(choices=list(BACKENDS), help="delta_rule backend"),
    ),
}
_FLAG_ALIASES = {"--negative-eigenvalues": ["--neg-eig"]}
_GROUP_TITLES = {
    "task": "task",
    "model": "model (any other DeltaFlowConfig key: --set model.KEY=VALUE)",
    "optimization": "optimization",
    "evaluation": "evaluation",
    "runtime": "logging, checkpoints, runtime",
}


def _config_flags() -> list[tuple[str, dataclasses.Field, dict[str, Any]]]:
    """(flag, field, argparse keywords) for every TrainConfig field that has a flag: the
    flags are derived from the dataclass, so a field and its help are declared once."""
    from deltaflow.train.config import TrainConfig, field_types

    hints = field_types()
    out = []
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        if meta.get("cli", True) is False:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        kwargs: dict[str, Any] = {"dest": f"cfg_{f.name}", "default": None}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" not in meta:
            kwargs["metavar"] = meta.get("metavar", f.name.upper())
        if typing.get_origin(base) is list:
            kwargs["type"] = _int_list
        elif base in (int, float):
            kwargs["type"] = base
        if f.name == "device":
            kwargs["type"] = _device
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        help_text = meta.get("help", "")
        default = "" if f.default in (None, dataclasses.MISSING) else f" (default: {f.default})"
        kwargs["help"] = help_text + ("" if "default" in help_text else default)
        out.append((flag, f, kwargs))
    return out


# ---------------------------------------------------------------------------- train
def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help=COMMANDS["train"][0],
        description="Train a model on a task. Precedence: defaults < --config < flags < --set. "
        "On CPU keep models small (e.g. --hidden-size 128 --num-layers 2): the default "
        "model (512 wide, 8 layers) is sized for a GPU.",
    )
    p.add_argument("--config", type=Path, help="YAML file of TrainConfig fields")
    add_kv_flag(
        p,
        "--set",
        "overrides",
        "any config field, e.g. lr=3e-4 or model.qk_norm=l2 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    _threads_flag(p)
    groups = {name: p.add_argument_group(title) for name, title in _GROUP_TITLES.items()}
    for flag, f, kwargs in _config_flags():
        groups.get(f.metadata.get("group"), groups["runtime"]).add_argument(flag, **kwargs)
    add_kv_flag(
        groups["task"],
        "--task-arg",
        "task_args",
        "task constructor argument (repeatable)",
    )
    for flag, (section, key, kwargs) in _SECTION_FLAGS.items():
        group = groups["task" if section == "task_kwargs" else "model"]
        if kwargs.get("action") is None and "choices" not in kwargs:
            kwargs = {"metavar": key.upper(), **kwargs}
        group.add_argument(flag, *_FLAG_ALIASES.get(flag, []), dest=f"{section}.{key}", **kwargs)
    groups["model"].add_argument(
        "--qk-norm",
        metavar="NORM",
        help="'l2' | 'none' | 'Q,K' e.g. 'l2,none' (default: per rule)",
    )
    groups["runtime"].add_argument(
        "--fork",
        metavar="NEWDIR",
        help="train in NEWDIR, starting from --out's latest checkpoint (weights, optimizer, "
        "step) with this command's settings, e.g. another --lr; the same command resumes it",
    )
    groups["runtime"].add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="resume a checkpoint that has no manifest.json or whose (for FSDP: signed) "
        "manifest does not verify, unchecked: only for folders whose writer you trust",
    )
    p.set_defaults(func=cmd_train)


def resolve_train_config(args: argparse.Namespace) -> Any:
    from deltaflow.train import TrainConfig, apply_overrides
    from deltaflow.train.config import parse_value

    if args.config is None:
        data = TrainConfig().to_dict()
    else:
        data = TrainConfig.from_yaml(args.config).to_dict()
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for _, f, _ in _config_flags():
        value = getattr(args, f"cfg_{f.name}", None)
        if value is not None:
            data[f.name] = value
    for section, key, _ in _SECTION_FLAGS.values():
        value = getattr(args, f"{section}.{key}", None)
        if value is not None:
            data[section][key] = value
    if args.qk_norm is not None:
        parts = args.qk_norm.split(",")
        data["model"]["qk_norm"] = parts[0] if len(parts) == 1 else parts
    for item in args.task_args:
        key, raw = item.split("=", 1)
        data["task_kwargs"][key] = parse_value(f"--task-arg {key}", raw)
    data = apply_overrides(data, args.overrides)
    config = TrainConfig.from_dict(data)
    from deltaflow.tasks import TASKS  # a Trainer may be handed its own task; the CLI may not

    if config.task.strip().lower().replace("-", "_") not in TASKS:
        raise ValueError(
            f"--task: unknown task {config.task!r}{did_you_mean(config.task, TASKS)}; "
            f"known: {', '.join(TASKS)}"
        )
    return config


def cmd_train(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer
    from deltaflow.train.cpu import CpuTimeCheck, count_parameters, set_threads, warn_if_gpu_sized
    from deltaflow.train.dist import DistInfo, resolve_device
    from deltaflow.train.trainer import train_and_close

    config = resolve_train_config(args)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if config.out_dir is not None:
        check_out_dir(config.out_dir, "--out")
    device = resolve_device(config.device, DistInfo.from_env())  # one-line error if absent
    set_threads(args.threads, device)
    callbacks = []
    main_rank = int(os.environ.get("RANK", 0)) == 0
    if device.type == "cpu" and main_rank:
        vocab = _vocab_size(config)
        num_params = count_parameters(config, vocab)
        gpu_sized = warn_if_gpu_sized(config, vocab, num_params)
        callbacks.append(CpuTimeCheck(config, vocab, num_params, gpu_sized))
    fork_from = None
    if args.fork is not None:
        if config.out_dir is None or not config.resume:
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
            callbacks=callbacks,
        )
    except KeyboardInterrupt:
        print("interrupted before training started: nothing to save", file=sys.stderr)
        return 130
    try:
        summary = train_and_close(trainer)
    except KeyboardInterrupt:  # a second Ctrl-C: quit without saving
        print(
            f"interrupted at step {trainer.step}; the last checkpoint is kept, resume with: "
            f"{_resume_command(args.argv)}",
            file=sys.stderr,
        )
        return 130
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
