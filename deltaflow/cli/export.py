"""``deltaflow export``: a checkpoint as a transformers save_pretrained folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from deltaflow.cli import COMMANDS
from deltaflow.cli.common import (
    _trust_flag,
)


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help=COMMANDS["export"][0],
        description="Write a run's latest checkpoint (or a given checkpoint folder) as a "
        "save_pretrained folder: config.json (with auto_map and the tokenizer's eos_token_id), "
        "generation_config.json, model.safetensors, the model code (modeling_deltaflow.py), "
        "train_config.yaml and, for language-model runs, the tokenizer (tokenizer.json). Open "
        "it with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True), deltaflow "
        "installed or not. Finished runs already have one: RUN/final/.",
    )
    p.add_argument("checkpoint", help="run dir (its latest checkpoint) or checkpoint dir")
    p.add_argument(
        "--out",
        required=True,
        help="a new or empty folder, or an earlier export (replaced atomically); never a run, "
        "a checkpoint, a folder inside one, a file or a folder of other files",
    )
    _trust_flag(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from deltaflow.train.checkpoint import resolve_checkpoint
    from deltaflow.train.export import export_checkpoint

    if not Path(args.checkpoint).exists():
        raise FileNotFoundError(f"{args.checkpoint} does not exist: give a run or a checkpoint")
    ckpt = resolve_checkpoint(args.checkpoint)
    dest = export_checkpoint(ckpt, args.out, trusted=args.trust_checkpoint)
    print(f"exported {ckpt} to {dest}")
    return 0
