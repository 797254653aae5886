"""``deltaflow convert-fla``: an fla checkpoint as a deltaflow model folder."""

from __future__ import annotations

import argparse

from deltaflow.cli import COMMANDS


def add_convert_fla_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-fla",
        help=COMMANDS["convert-fla"][0],
        description="Read a folder written by fla's save_pretrained (config.json + "
        "model.safetensors) of a GatedDeltaNetForCausalLM or DeltaNetForCausalLM and write the "
        "deltaflow model with the same outputs as a save_pretrained folder (tokenizer files "
        "are copied along). A setting deltaflow cannot represent (hybrid attention layers, "
        "other activations) is refused. Check on a GPU: python benchmarks/convert_fla_check.py",
    )
    p.add_argument("src", help="the fla checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (must not exist)")
    p.set_defaults(func=cmd_convert_fla)


def cmd_convert_fla(args: argparse.Namespace) -> int:
    from deltaflow.models.convert_fla import convert_fla

    dest = convert_fla(args.src, args.out)
    print(f"converted {args.src} to {dest}")
    return 0
