"""Atomic, resumable checkpoints.

Layout under ``<out_dir>/checkpoints/``::

    step_0000500/
        model.safetensors    weights (safetensors; tied tensors handled)
        trainer_state.pt     optimizer state, step, RNG states (loaded with weights_only=True)
        config.yaml          the full TrainConfig, enough to rebuild model and task
        state.json           step, tokens seen, last metrics (human-readable)
    latest                   text file naming the newest complete checkpoint directory

A checkpoint is written into a temporary directory and renamed into place with
``os.replace``; ``latest`` is updated the same way afterwards. A run killed at any moment
leaves either the previous or the new checkpoint, never a half-written one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_model, save_model

LATEST = "latest"
PREFIX = "step_"


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
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, keep the newest ``keep``."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    trainer_state = {"step": step, "rng": rng_state()}
    if optimizer is not None:
        trainer_state["optimizer"] = optimizer.state_dict()
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (tmp / "state.json").write_text(json.dumps({"step": step, **(info or {})}, indent=2))
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        trash = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
    _atomic_write_text(root / LATEST, final.name + "\n")
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
    """Load weights (strict) and, if given, optimizer state; returns the trainer state dict."""
    path = resolve_checkpoint(path)
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError(f"{path} has no optimizer state; cannot resume training from it")
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        set_rng_state(state["rng"])
    return state


def load_config(path: str | Path) -> dict[str, Any]:
    """The TrainConfig dict stored with a checkpoint."""
    return yaml.safe_load((resolve_checkpoint(path) / "config.yaml").read_text())
