"""What the commands share: argparse types and flags, output folders, loading a trained
checkpoint, errors as one line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _kv(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def add_kv_flag(parser: Any, flag: str, dest: str, help: str) -> None:
    """A repeatable ``KEY=VALUE`` flag collected into a list (``--set``, ``--task-arg``)."""
    parser.add_argument(
        flag, dest=dest, action="append", type=_kv, default=[], metavar="KEY=VALUE", help=help
    )


def _int_list(text: str) -> list[int]:
    """``512,1024`` -> [512, 1024] (argparse names the flag in its error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 512,1024, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _int_at_least(minimum: int, expected: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else "expected <expected>, got ..."."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _device(text: str) -> str:
    from deltaflow.train.config import check_device_name

    try:
        return check_device_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _threads_flag(p: argparse.ArgumentParser) -> None:
    from deltaflow.train.cpu import DEFAULT_THREADS_HELP

    p.add_argument("--threads", type=_positive_int, metavar="N", help=DEFAULT_THREADS_HELP)


def _trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a checkpoint that has no manifest.json (or one that does not verify) "
        "unchecked: only a folder whose writer you trust",
    )


def check_out_dir(path: str | os.PathLike, flag: str) -> None:
    """An output folder must be a folder (or not exist yet): not a file, nor under one."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"is under {p}, which is a file"
                raise ValueError(f"{flag} {path} {what}; give a folder")
            if not os.access(p, os.W_OK):
                raise ValueError(f"{flag} {path}: cannot write to {p} (permission denied)")
            return


def _load_trained(path: str, device: str, trusted: bool = False) -> tuple[Any, Any, Path]:
    """(config, model with checkpoint weights, checkpoint dir) for a run or checkpoint dir;
    the checkpoint's files are checked against its manifest before any is read."""
    from deltaflow.train import TrainConfig, build_model, load_checkpoint, resolve_checkpoint
    from deltaflow.train.checkpoint import read_config, verify_checkpoint
    from deltaflow.train.dist import DistInfo, resolve_device

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder or a checkpoint")
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt, trusted=trusted)
    config = TrainConfig.from_dict(read_config(ckpt)).replace(device=device, out_dir=None)
    vocab = _vocab_size(config, ckpt)
    model = build_model(config, vocab).to(resolve_device(device, DistInfo()))
    try:
        load_checkpoint(ckpt, model=model, restore_rng=False, trusted=True)  # verified above
    except Exception as err:  # safetensors' and torch's error types differ between versions
        name = _unreadable_file(err)
        if name is None:
            raise
        reason = _one_line(err).split(". ")[0]
        raise ValueError(
            f"{ckpt / name} cannot be read ({reason}): the file is truncated or corrupt; use "
            "another checkpoint (RUN/checkpoints/step_N) or train again"
        ) from None
    model.eval()
    return config, model, ckpt


def _unreadable_file(err: Exception) -> str | None:
    """The checkpoint file a load error says is corrupt or truncated, or None for any other
    error (a genuine bug keeps its traceback)."""
    text = f"{type(err).__module__}.{type(err).__name__}: {err}".lower()
    if "safetensor" in text or "deserializing header" in text:
        return "model.safetensors"
    if "pytorchstreamreader" in text or "zip archive" in text or "unpickling" in text:
        return "trainer_state.pt"
    return None


def _resolved_device(name: str) -> Any:
    """The torch device ``--device`` names here (a one-line error when it is not available)."""
    from deltaflow.train.dist import DistInfo, resolve_device

    return resolve_device(name, DistInfo())


def _vocab_size(config: Any, ckpt: Path | None = None) -> int:
    """The vocabulary of the model a config builds: from a checkpoint's saved tokenizer, the
    config's tokenizer (language modelling, before training) or the task."""
    if config.task == "lm":
        from deltaflow.tasks.tokenizers import get_tokenizer, run_tokenizer

        kw = config.task_kwargs
        if ckpt is not None:
            return run_tokenizer(ckpt, kw).vocab_size
        return get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path")).vocab_size
    from deltaflow.train import build_task

    return build_task(config).vocab_size


def _one_line(err: BaseException) -> str:
    """An exception as one line: OSErrors without the errno prefix, newlines folded."""
    if isinstance(err, OSError) and err.strerror and not err.args[1:2] == ():
        text = err.strerror + (f": {err.filename}" if err.filename else "")
    else:
        text = str(err) or type(err).__name__
    if isinstance(err, KeyError):
        text = f"missing key {text}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
