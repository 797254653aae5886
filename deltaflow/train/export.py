"""Export a trained model as a transformers ``save_pretrained`` folder.

    deltaflow export runs/lm --out exported/lm

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/lm", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained("exported/lm")  # language-model runs only

(or ``import deltaflow.models`` first, which registers model_type "deltaflow" with the Auto
classes, and no ``trust_remote_code``). The folder holds ``config.json`` (with ``auto_map``
and the tokenizer's ``eos_token_id``), ``generation_config.json``, ``model.safetensors``,
``modeling_deltaflow.py`` + ``deltaflow_source.py`` (the model code: loads where deltaflow is
not installed), every file mode 0644,
``train_config.yaml`` (the TrainConfig that trained it), and for language-model runs the
tokenizer as a transformers fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``):
the GPT-2 BPE of a ``.tiktoken`` file, or the byte tokenizer (ids 0-255 are the UTF-8 bytes,
256 is ``<|endoftext|>``). Synthetic tasks have no text and no tokenizer. The trainer writes
this folder for every finished run as ``<out>/final/``.

It is written beside the destination (``.DEST.tmp-PID``) and swapped into place atomically;
``deltaflow export`` writes only to a new or empty folder or over an earlier export
(:func:`deltaflow.train.safety.check_export_dest`): never over a run, a checkpoint or a
folder of other files.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from torch import nn

EOT_TEXT = "<|endoftext|>"


def hf_tokenizer(task: str, task_kwargs: dict[str, Any]) -> Any | None:
    """The task's tokenizer as a ``PreTrainedTokenizerFast`` (None for tasks without text)."""
    if task != "lm":
        return None
    from deltaflow.tasks.tokenizers import get_tokenizer

    # byte, GPT-2 .tiktoken or a Hugging Face folder, each in transformers' form (the same
    # conversion the trainer's checkpoints use for their tokenizer/ folder)
    ours = get_tokenizer(task_kwargs.get("tokenizer", "byte"), task_kwargs.get("tokenizer_path"))
    return ours.to_hf()


def _bytes_to_unicode() -> list[str]:
    """Byte b -> the printable character byte-level BPE writes for it (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_pretrained(
    model: nn.Module, dest: str | Path, train_config: dict[str, Any], *, guard: bool = False
) -> Path:
    """``model.save_pretrained`` + tokenizer + ``train_config.yaml`` into ``dest``, written
    beside it and swapped in atomically (:func:`deltaflow.train.safety.swap_in`): a kill at
    any moment leaves the old folder or the new one, and the next export cleans up.

    ``guard``: ``dest`` is a user's ``--out``: refuse it unless it is new, empty or an
    earlier export whose files the new one all replaces (nothing else is ever deleted).
    """
    from deltaflow.train.checkpoint import pause_point
    from deltaflow.train.safety import (
        aside_name,
        check_export_dest,
        recover_aside,
        swap_in,
        unexpected_files,
    )

    dest = check_export_dest(dest) if guard else Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover_aside(dest)  # what a killed export of this folder left beside it
    if guard:
        check_export_dest(dest)  # recover_aside may have put an old export back
    tmp = aside_name(dest, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _quiet_transformers():
            model.save_pretrained(str(tmp), safe_serialization=True)
        pause_point()  # tests: a kill here leaves a half-written .DEST.tmp-PID
        tokenizer = hf_tokenizer(train_config["task"], train_config.get("task_kwargs", {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(train_config, sort_keys=False))
        _hub_ready(tmp, tokenizer)
        extra = unexpected_files(dest, tmp) if guard else []
        if extra:
            raise ValueError(
                f"--out {dest} holds files an export does not write ({', '.join(extra[:3])}); "
                "it is left as it was: give a new folder"
            )
        swap_in(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _hub_ready(folder: Path, tokenizer: Any | None) -> None:
    """What the Hub and ``generate`` expect beyond ``save_pretrained``: ``auto_map`` with the
    model code (loads without deltaflow, :mod:`deltaflow.train.remote_code`), the tokenizer's
    end-of-text id in ``config.json`` and ``generation_config.json`` (generation stops at
    the end of a text), and files readable by all (0644: checkpoints are written through
    0600 temporary files)."""
    from deltaflow.train.remote_code import write_remote_code

    write_remote_code(folder)
    eos = None if tokenizer is None else tokenizer.eos_token_id
    if eos is not None:
        from transformers import GenerationConfig

        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config["eos_token_id"] = eos
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        GenerationConfig(eos_token_id=eos, pad_token_id=eos).save_pretrained(str(folder))
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No "Writing model shards" bar for a one-file model (it would break the trainer's)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_checkpoint(
    path: str | Path, dest: str | Path, *, trusted: bool = False, guard: bool = True
) -> Path:
    """Export a run's latest checkpoint (or a given checkpoint folder) to ``dest``, a new
    folder or an earlier export (``guard``, see :func:`write_pretrained`; the trainer's own
    ``final/`` is written with ``guard=False``). The checkpoint is verified against its
    manifest before any of its files is read (``trusted``: see ``load_checkpoint``)."""
    from deltaflow.train.build import build_model, task_vocab_size
    from deltaflow.train.checkpoint import (
        load_checkpoint,
        read_config,
        resolve_checkpoint,
        verify_checkpoint,
    )
    from deltaflow.train.config import TrainConfig
    from deltaflow.train.safety import check_export_dest

    ckpt = resolve_checkpoint(path)
    if guard:
        check_export_dest(dest)  # before the slow part: a refusal costs nothing
    verify_checkpoint(ckpt, trusted=trusted)  # before config.yaml is parsed
    data = read_config(ckpt)
    config = TrainConfig.from_dict(data)
    model = build_model(config, task_vocab_size(config))
    load_checkpoint(ckpt, model=model, restore_rng=False, trusted=True)  # verified just now
    return write_pretrained(model, dest, data, guard=guard)


def clean_stale_exports(out_dir: str | Path) -> list[str]:
    """What a killed export of ``<out_dir>/final`` left beside it (see
    :func:`deltaflow.train.safety.recover_aside`)."""
    from deltaflow.train.safety import recover_aside

    return recover_aside(Path(out_dir) / "final")
