"""Atomic, resumable checkpoints.

Layout under ``<out_dir>/checkpoints/``::

    step_0000500/
        model.safetensors    weights (safetensors; tied tensors handled)
        trainer_state.pt     optimizer state, step, RNG states (loaded with weights_only=True)
        config.yaml          the full TrainConfig, enough to rebuild model and task
        state.json           step, tokens seen, last metrics (human-readable)
        tokenizer/           language models: the run's tokenizer (Hugging Face files + a
                             deltaflow_tokenizer.json; see deltaflow.tasks.tokenizers)
    latest                   text file naming the newest complete checkpoint directory

A checkpoint is written into a temporary directory and renamed into place with
``os.replace``; ``latest`` is updated the same way afterwards. A run killed at any moment
leaves either the previous or the new checkpoint, never a half-written one.

FSDP runs (``parallel="fsdp"``) write a *sharded* checkpoint instead: every rank saves its
own shards of the weights and optimizer state with ``torch.distributed.checkpoint`` (DCP)
into ``dcp/``, which can be loaded back on any number of ranks; ``trainer_state.pt`` then
holds step and per-rank RNG states only. Rank 0 also gathers the full weights into
``model.safetensors``, so ``deltaflow eval`` / ``generate`` read every checkpoint the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_model, save_file, save_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"
PREFIX = "step_"
SHARDED = "dcp"  # subdirectory of a sharded (FSDP) checkpoint


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may touch, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def save_checkpoint(
    out_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    config: dict[str, Any],
    info: dict[str, Any] | None = None,
    keep: int = 2,
    rng_per_rank: list[dict[str, Any]] | None = None,
    tokenizer: Any | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, keep the newest ``keep``.

    ``rng_per_rank``: every data-parallel rank's RNG states (else this process's are saved).
    ``tokenizer``: saved into ``tokenizer/`` (language models).
    """
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    trainer_state = {"step": step, "rng": rng_per_rank or [rng_state()]}
    if optimizer is not None:
        trainer_state["optimizer"] = optimizer.state_dict()
    torch.save(trainer_state, tmp / "trainer_state.pt")
    _write_metadata(tmp, step, config, info, tokenizer)
    _commit(tmp, final, keep)
    return final


def _write_metadata(
    tmp: Path, step: int, config: dict[str, Any], info: dict | None, tokenizer: Any | None
) -> None:
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (tmp / "state.json").write_text(json.dumps({"step": step, **(info or {})}, indent=2))
    if tokenizer is not None:
        from deltaflow.tasks.tokenizers import save_tokenizer

        save_tokenizer(tokenizer, tmp / "tokenizer")


def _commit(tmp: Path, final: Path, keep: int) -> None:
    """Rename the finished ``tmp`` to ``final``, point ``latest`` at it, prune old ones."""
    root = final.parent
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        trash = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
    _atomic_write_text(root / LATEST, final.name + "\n")
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns whenever it runs without a process group; for us that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective: all ranks must call)."""
    if not _distributed():
        return [rng_state()]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def save_sharded_checkpoint(
    out_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config: dict[str, Any],
    info: dict[str, Any] | None = None,
    keep: int = 2,
    tokenizer: Any | None = None,
) -> Path:
    """Sharded (FSDP) checkpoint; every rank must call it. Same atomic layout as
    :func:`save_checkpoint`, with ``dcp/`` holding each rank's shards of weights + optimizer.
    Assumes all ranks share the filesystem (one node, or a shared disk)."""
    from deltaflow.train.parallel import full_state_dict

    root = checkpoint_dir(out_dir)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"  # the same name on every rank: they all write into it
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a run killed mid-save
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_ok():
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=tmp / SHARDED,
            no_dist=not _distributed(),  # a parallel="fsdp" run on one process
        )
    weights = full_state_dict(model)  # collective; only rank 0 gets the tensors
    rng = gather_rng_states()
    if _rank() == 0:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save({"step": step, "rng": rng}, tmp / "trainer_state.pt")
        _write_metadata(tmp, step, config, info, tokenizer)
        _commit(tmp, final, keep)
    _barrier()  # nobody moves on (or exits) before the checkpoint is in place
    return final


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / SHARDED).is_dir()


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    pointer = checkpoint_dir(out_dir) / LATEST
    if pointer.is_file():
        path = checkpoint_dir(out_dir) / pointer.read_text().strip()
        if (path / "model.safetensors").is_file():
            return path
    found = list_checkpoints(out_dir)  # pointer missing: fall back to the highest step
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory (then take its latest checkpoint)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint directory (with model.safetensors) "
            "nor a run directory with checkpoints/"
        )
    return latest


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load weights (strict) and, if given, optimizer state; returns the trainer state dict.

    Weights come from ``model.safetensors``, so this reads any checkpoint into an unsharded
    model, including a sharded one's consolidated weights. Resuming a sharded checkpoint's
    optimizer state needs :func:`load_sharded_checkpoint`.
    """
    path = resolve_checkpoint(path)
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None and "optimizer" not in state:
        hint = " (sharded: resume it with parallel='fsdp')" if is_sharded_checkpoint(path) else ""
        raise ValueError(f"{path} has no optimizer state; cannot resume training from it{hint}")
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        _restore_rng(state["rng"])
    return state


def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Resume weights + optimizer from a sharded checkpoint (every rank must call it).

    DCP reshards on load, so the run may continue on a different number of GPUs.
    """
    path = resolve_checkpoint(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded (FSDP) checkpoint; resume it with parallel='ddp'"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_ok():
        dcp.load(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=path / SHARDED,
            no_dist=not _distributed(),
        )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if restore_rng:
        _restore_rng(state["rng"])
    return state


def _restore_rng(states: dict[str, Any] | list[dict[str, Any]]) -> None:
    """This rank's saved RNG states (rank 0's if the run had fewer ranks)."""
    if isinstance(states, dict):  # checkpoints from before per-rank RNG states
        states = [states]
    rank = _rank()
    set_rng_state(states[rank] if rank < len(states) else states[0])


def load_config(path: str | Path) -> dict[str, Any]:
    """The TrainConfig dict stored with a checkpoint."""
    return yaml.safe_load((resolve_checkpoint(path) / "config.yaml").read_text())
