"""A run folder belongs to one config: its stored config, what may change on resume, archiving.

``<out>/run_config.yaml`` is written when a run starts (a plain TrainConfig dump, valid as a
``--config`` file; never ``config.yaml``, which may be the user's own file in that folder).
Resuming compares the new config with it, key by key (``model.rule``, ``lr``, ...): keys that
decide *what is trained* must be equal, or the resume is refused with a message naming each
difference. The other keys (:data:`RUNTIME_FIELDS`, :data:`RUNTIME_KEYS`) say how a run is
watched, where it runs or how a batch is split, and may change between resumes.

``steps`` is special: a *finished* run may be extended (a larger ``steps``; the cosine
schedule is then recomputed for the new length, so the steps after the old end follow the
new schedule: the result is not what an uninterrupted run of the new length would give, and
the log says so with an ``extend`` event). Any other change of ``steps`` is refused, as it
would bend the schedule of a run in the middle.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from deltaflow.train.checkpoint import atomic_write_text, pause_point
from deltaflow.train.config import runtime_fields

RUN_CONFIG = "run_config.yaml"
ARCHIVE = "archive"

# Fields that may change when a run is resumed: the TrainConfig fields marked runtime=True on
# the field itself (train/config.py: evaluation, logging, checkpointing, runtime placement, how
# the same global batch is split). grad_accum, parallel and context_parallel split the same
# global batch differently, compile runs the same model through torch.compile (equal up to
# float rounding; the checkpoint format itself decides between ddp and fsdp).
RUNTIME_FIELDS = runtime_fields()
# Keys inside sections that may change: the kernel backend (same maths; a GPU run may be
# finished on a CPU) and where tokenized data is cached.
RUNTIME_KEYS = frozenset({"model.backend", "task_kwargs.cache_dir"})
UNSET = "<unset>"

# Everything of a run that an archive takes away (a top-level config.yaml may be the user's),
# its TensorBoard and W&B logs included.
RUN_FILES = (
    "log.jsonl",
    "train.csv",
    "eval.csv",
    RUN_CONFIG,
    "final.json",
    "final",
    "tensorboard",
    "wandb",
    "wandb_run_id",
)
# Names an archive in progress writes first (the folder it moves the run into) and removes
# last: a kill in between is undone by the next start (undo_interrupted_archive).
ARCHIVING = ".archiving"
# Temporary files of a run folder (atomic_write_text, RunLogger); under the run lock, any
# that exist were left by a killed run.
RUN_TEMPORARIES = (f".{RUN_CONFIG}.tmp-*", ".final.json.tmp-*", ".log.jsonl.tmp", ".*.csv.tmp")


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {"rule": "efla"}, "lr": 1e-3}`` -> ``{"model.rule": "efla", "lr": 1e-3}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def training_differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every training-relevant key that differs (``steps``
    included; the caller decides about an extension)."""
    from deltaflow.train.config import TrainConfig

    defaults = TrainConfig().to_dict()  # a run stored before a field existed had its default
    a, b = _flat({**defaults, **old}), _flat({**defaults, **new})
    out = []
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] in RUNTIME_FIELDS or key in RUNTIME_KEYS:
            continue
        if a.get(key, UNSET) != b.get(key, UNSET):
            out.append((key, a.get(key, UNSET), b.get(key, UNSET)))
    return out


def describe(differences: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in differences)


def read_run_config(out_dir: str | Path, checkpoint: Path | None) -> dict[str, Any] | None:
    """The config a run was started with: ``run_config.yaml``, or for runs from before it
    existed, the config stored in its latest checkpoint."""
    from deltaflow.train.checkpoint import read_config

    path = Path(out_dir) / RUN_CONFIG
    if path.is_file():
        try:
            return yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"{path} is not valid YAML ({' '.join(str(err).split())})") from None
    if checkpoint is not None and (checkpoint / "config.yaml").is_file():
        return read_config(checkpoint)
    return None


def write_run_config(out_dir: str | Path, config: dict[str, Any]) -> None:
    path = Path(out_dir) / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))


def has_run(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a run worth keeping (a checkpoint, or a finished run)."""
    out = Path(out_dir)
    ckpts = out / "checkpoints"
    has_ckpt = ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir())
    return has_ckpt or (out / "final.json").is_file()


def archive_run(out_dir: str | Path) -> Path | None:
    """Move the run in ``out_dir`` (checkpoints, logs, run config, final model) into
    ``out_dir/archive/<time>/``; returns that folder (None when there was no run)."""
    out = Path(out_dir)
    if not has_run(out):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = out / ARCHIVE / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / ARCHIVE / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    atomic_write_text(out / ARCHIVING, str(dest.relative_to(out)) + "\n")
    for name in (*RUN_FILES, "checkpoints"):
        if (out / name).exists():
            os.replace(out / name, dest / name)
            pause_point()
    (out / ARCHIVING).unlink()
    return dest


def undo_interrupted_archive(out_dir: str | Path) -> list[str]:
    """An archive killed half-way (``.archiving`` still there) is moved back: the run is as
    it was before that command, whole in ``out_dir`` (never split over two archives)."""
    out = Path(out_dir)
    journal = out / ARCHIVING
    if not journal.is_file():
        return []
    dest = out / journal.read_text().strip()
    if dest.is_dir() and out in dest.parents:
        for name in (*RUN_FILES, "checkpoints"):
            if (dest / name).exists() and not (out / name).exists():
                os.replace(dest / name, out / name)
        if not any(dest.iterdir()):
            dest.rmdir()
        if not any(dest.parent.iterdir()):  # archive/, made for this archive
            dest.parent.rmdir()
    journal.unlink()
    return [f"moved back the run that a killed --no-resume had begun to archive into {dest}"]


def clean_run_temporaries(out_dir: str | Path) -> list[str]:
    """Delete the run folder's temporary files left by a killed run (call with the lock)."""
    out = Path(out_dir)
    stale = [p for pattern in RUN_TEMPORARIES for p in out.glob(pattern) if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return [f"removed {len(stale)} temporary file(s) left by a killed run"] if stale else []
