"""The ``deltaflow`` command line: train, eval, generate, export, compare, stability.

    deltaflow train --task mqar --rule efla --decay --steps 2000 --out runs/efla
    deltaflow train --config configs/mqar_efla.yaml --lr 3e-4 --set model.qk_norm=l2
    deltaflow eval runs/efla                       # latest checkpoint of a run directory
    deltaflow export runs/efla --out exported/efla # a transformers save_pretrained folder
    deltaflow generate runs/lm --prompt "It is a truth" --max-new-tokens 100
    deltaflow eval runs/lm --lm-eval lambada_openai   # lm-evaluation-harness tasks
    deltaflow compare                              # the main job: quick CPU preset (<= 2 min)
    deltaflow compare --preset mqar_512 --device cuda --out results/mqar_512

``train``'s flags are derived from the fields of :class:`deltaflow.train.TrainConfig` (name, type
and help are declared once, there), plus shortcuts for common task and model keys; precedence
is defaults < ``--config`` file < flags < ``--set key=value``. Errors in what the user gave
(bad flags, configs, files, devices) are one line ``deltaflow CMD: error: ...`` with exit code 2;
``--traceback`` (or ``DELTAFLOW_DEBUG=1``) shows the full trace instead.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import typing
from collections.abc import Collection
from typing import Any

from deltaflow import lazy_attribute
from deltaflow.cli.common import _one_line
from deltaflow.validation import did_you_mean

# What a user's mistake raises (bad flags, configs, paths, files, devices): one line, exit 2.
# Anything else is a bug or a failure of the machine and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)
TRACEBACK_HELP = "show the full Python traceback of an error (or set DELTAFLOW_DEBUG=1)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (``deltaflow CMD: error: ...``): the usage of
    ``train`` alone is 34 lines, which buried the error (and its did-you-mean) above it."""

    def error(self, message: str) -> typing.NoReturn:
        close = ""
        if self.prog == "deltaflow" and "invalid choice: '" in message:  # a mistyped command
            close = did_you_mean(message.split("invalid choice: '", 1)[1].split("'")[0], COMMANDS)
        hint = close or f" (see {self.prog} -h)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


# command -> (one-line help, "module:function" that adds its full parser). `deltaflow --help`
# and every command build only the parser they use, so none waits for another's imports
# (torch, transformers, the trainer, lm-eval).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train one model on one task", "deltaflow.cli.train:add_train_parser"),
    "eval": (
        "evaluate a checkpoint on its task (or a variant of it)",
        "deltaflow.cli.eval:add_eval_parser",
    ),
    "generate": (
        "sample text from a language-model checkpoint",
        "deltaflow.cli.generate:add_generate_parser",
    ),
    "export": (
        "write a checkpoint as a transformers save_pretrained folder",
        "deltaflow.cli.export:add_export_parser",
    ),
    "convert-fla": (
        "convert an fla GatedDeltaNet/DeltaNet checkpoint into a deltaflow model folder",
        "deltaflow.cli.convert_fla:add_convert_fla_parser",
    ),
    "compare": (
        "run a grid of rules x tasks x widths x lrs x seeds; tables and plots",
        "deltaflow.cli.compare:add_compare_parser",
    ),
    "lm-eval-task": (
        "build local lm-eval tasks (last word, perplexity) from held-out documents",
        "deltaflow.evals.local_tasks:add_lm_eval_task_parser",
    ),
    "stability": (
        "numerical stability study of the step rules",
        "deltaflow.analysis.cli:add_stability_parser",
    ),
}


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line: the commands in ``full`` (default: all) with their whole parser,
    the others as a name and a help line."""
    import importlib

    parser = _Parser(
        prog="deltaflow",
        description="Delta-rule linear attention lab: train, evaluate, compare step rules.",
    )
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, where) in COMMANDS.items():
        if full is not None and name not in full:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module, function = where.split(":")
        try:
            add = getattr(importlib.import_module(module), function)
        except ImportError:  # stability: written by another module; the CLI works without it
            continue
        add(sub)
    for command in sub.choices.values():
        if "--traceback" not in command._option_string_actions:
            command.add_argument(
                "--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP
            )
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand an argv names (the first word that is not an option), if known."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _unknown_flags_error(
    parser: argparse.ArgumentParser, command: str | None, extras: list[str]
) -> None:
    """Unknown arguments: the subcommand's usage and one error line with a did-you-mean."""
    target = _subparser(parser, command)
    flag = next((e for e in extras if e.startswith("-")), extras[0])
    known = [o for o in target._option_string_actions if o.startswith("--")]
    names = {o[2:]: o for o in known}  # compare without the '--' every flag shares
    close = difflib.get_close_matches(flag.split("=")[0].lstrip("-"), names, n=1, cutoff=0.6)
    hint = f" (did you mean {names[close[0]]}?)" if close else f" (see deltaflow {command} -h)"
    s = "s" if len(extras) > 1 else ""
    target.exit(2, f"{target.prog}: error: unrecognized argument{s}: {' '.join(extras)}{hint}\n")


def _close_progress_bars() -> None:
    if "tqdm" not in sys.modules:  # no bar can be open
        return
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _diverged(err: BaseException) -> bool:
    """A DivergenceError (one line, exit 1); without the trainer imported it cannot be one."""
    trainer = sys.modules.get("deltaflow.train.trainer")
    return trainer is not None and isinstance(err, trainer.DivergenceError)


def _interrupted(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in the error's chain: a Ctrl-C landing inside a lazy
    import (transformers') comes back as ModuleNotFoundError raised from it."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


# What every command imports first: torch, transformers' model classes and the trainer.
_COMMAND_IMPORTS = ("torch", "deltaflow.models", "deltaflow.train.trainer")


def _import_holding_ctrl_c(modules: Collection[str]) -> None:
    """Import ``modules`` with Ctrl-C held until they are done, then honour it. A SIGINT that
    lands inside a library's import (transformers' lazy modules) leaves it half-initialised,
    and the next use fails with an unrelated import error and a traceback."""
    import importlib
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        for name in modules:
            importlib.import_module(name)
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # Everything inside the try, the parser too: building it imports torch and transformers
    # (seconds), and a Ctrl-C then is one line and exit 130 like at any later moment.
    command, debug = None, False
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--traceback" in argv or os.environ.get("DELTAFLOW_DEBUG", "") not in ("", "0")
        command = next((a for a in argv if not a.startswith("-")), None)  # until argparse says
        if _command_of(argv) is not None:
            _import_holding_ctrl_c(_COMMAND_IMPORTS)
        # only the named command's parser is built whole: the others' imports cost seconds
        parser = build_parser(full=[c for c in [_command_of(argv)] if c])
        args, extras = parser.parse_known_args(argv)
        command = args.command
        if extras:
            _unknown_flags_error(parser, args.command, extras)
        args.argv = argv  # recorded with results (results/*/command.txt)
        if not hasattr(args, "func"):
            parser.print_help()
            return 0
        debug = debug or getattr(args, "traceback", False)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        _close_progress_bars()
        print(f"deltaflow{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return 130  # the shell's code for a SIGINT
    except Exception as err:
        if _interrupted(err) and not debug:  # Ctrl-C that a library import turned into an error
            _close_progress_bars()
            print(f"deltaflow{f' {command}' if command else ''}: interrupted", file=sys.stderr)
            return 130
        if debug or not (isinstance(err, USER_ERRORS) or _diverged(err)):
            raise
        _close_progress_bars()  # else the error line starts after a half-drawn bar
        print(f"deltaflow {command}: error: {_one_line(err)}", file=sys.stderr)
        return 1 if _diverged(err) else 2


# The commands live one per module (deltaflow/cli/<command>.py, shared helpers in common.py);
# their functions are still importable from here, imported on first use (PEP 562).
_LAZY = {
    "check_out_dir": "deltaflow.cli.common",
    "add_train_parser": "deltaflow.cli.train",
    "resolve_train_config": "deltaflow.cli.train",
    "cmd_train": "deltaflow.cli.train",
    "add_eval_parser": "deltaflow.cli.eval",
    "cmd_eval": "deltaflow.cli.eval",
    "add_generate_parser": "deltaflow.cli.generate",
    "cmd_generate": "deltaflow.cli.generate",
    "add_export_parser": "deltaflow.cli.export",
    "cmd_export": "deltaflow.cli.export",
    "add_convert_fla_parser": "deltaflow.cli.convert_fla",
    "cmd_convert_fla": "deltaflow.cli.convert_fla",
    "add_compare_parser": "deltaflow.cli.compare",
    "cmd_compare": "deltaflow.cli.compare",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
