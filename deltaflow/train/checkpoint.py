"""Atomic, resumable checkpoints.

Layout under ``<out_dir>/checkpoints/``::

    step_0000500/
        model.safetensors    weights (safetensors; tied tensors handled)
        trainer_state.pt     optimizer state, step, RNG states, the open log window, the log's
                             length (loaded with weights_only=True)
        config.yaml          the full TrainConfig, enough to rebuild model and task
        state.json           step, tokens seen, last metrics (human-readable)
        tokenizer/           language models: the run's tokenizer (Hugging Face files + a
                             deltaflow_tokenizer.json; see deltaflow.tasks.tokenizers)
        manifest.json        SHA-256 of every file above, signed (deltaflow.train.manifest)
    latest                   text file naming the newest complete checkpoint directory

A checkpoint is written into a temporary directory ``.tmp-step_N-PID`` and renamed into place
with ``os.replace``; ``latest`` is then replaced the same way, and that is the commit: a
checkpoint newer than the one ``latest`` names is a leftover of a kill and is removed when the
run starts again. Re-saving a step that exists (the final save right after a periodic one)
moves the old directory aside as ``.old-step_N-PID`` for the moment between two renames; a
kill there leaves that directory, which the next start puts back. So a run killed at any
moment, with any ``keep``, restarts from the previous or the new checkpoint, never from a
half-written one and never from nothing. :func:`recover_checkpoints` does that clean-up (and
deletes stale ``.tmp-*`` / ``.latest.tmp-*``); the trainer calls it at start.

Pruning keeps the newest ``keep`` checkpoints of the run's own history: every checkpoint up to
the one just written, newest first; anything past it belongs to a timeline the run abandoned.
(A folder holds one run: the trainer archives an old run before starting a new one in it.)

A failed save (a full disk) removes its temporary directory, keeps the last good checkpoint
and raises :class:`CheckpointSaveError`, a one-line message.

FSDP runs (``parallel="fsdp"``) write a *sharded* checkpoint instead: every rank saves its
own shards of the weights and optimizer state with ``torch.distributed.checkpoint`` (DCP)
into ``dcp/``, which can be loaded back on any number of ranks; ``trainer_state.pt`` then
holds step and per-rank RNG states only. Rank 0 also gathers the full weights into
``model.safetensors``, so ``deltaflow eval`` / ``generate`` read every checkpoint the same way.
DCP's ``dcp/.metadata`` is a pickle: resuming verifies the signed manifest first (see
:mod:`deltaflow.train.manifest` for the trust boundary).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_model, save_file, save_model

from deltaflow.train.dist import (
    agree,
    barrier,
    first_error,
    global_rank,
    is_distributed,
    single_process_ok,
)
from deltaflow.train.manifest import (
    MANIFEST,
    CheckpointVerifyError,
    verify_manifest,
    write_manifest,
)
from deltaflow.train.rng import (
    gather_rng_states,
    restore_rng_states,
    rng_state,
    set_rng_state,  # noqa: F401 -- in rng.py since issue 36, still importable from here
)

LATEST = "latest"
PREFIX = "step_"
SHARDED = "dcp"  # subdirectory of a sharded (FSDP) checkpoint
PAUSE_ENV = "DELTAFLOW_TEST_SAVE_PAUSE"  # tests: seconds to sleep at each stage of a save


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the partial files are gone, the last good one kept."""

    def __str__(self) -> str:
        return str(self.strerror)


def pause_point() -> None:
    """Test hook: widen the windows between the steps of a save, so that random kills of a
    test land inside saves (``DELTAFLOW_TEST_SAVE_PAUSE=0.05``). Nothing happens without it."""
    seconds = float(os.environ.get(PAUSE_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a ``.NAME.tmp-PID`` sibling, fsync, rename into place: never half a
    file (the start of a run removes such temporaries left by a kill)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_of(path: Path) -> int:
    """The step of a checkpoint directory named ``step_NNNNNNN``."""
    return int(path.name[len(PREFIX) :])


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
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, keep the newest ``keep``.

    ``rng_per_rank``: every data-parallel rank's RNG states (else this process's are saved).
    ``tokenizer``: saved into ``tokenizer/`` (language models).
    ``extra``: more entries for ``trainer_state.pt`` (tensors, numbers, lists, dicts).
    """
    root = checkpoint_dir(out_dir)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    with _clean_failure(tmp, step):
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        pause_point()
        trainer_state = {"step": step, "rng": rng_per_rank or [rng_state()], **(extra or {})}
        if optimizer is not None:
            trainer_state["optimizer"] = optimizer.state_dict()
        _torch_save(trainer_state, tmp / "trainer_state.pt")
        _write_metadata(tmp, step, config, info, tokenizer)
        write_manifest(tmp)
        pause_point()
        _commit(tmp, final, keep)
    return final


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` into a file we opened: its writes then fail as Python's own, so a full
    disk is ``OSError(ENOSPC)``; given a path, torch reports it as ``RuntimeError: [enforce
    fail at inline_container.cc] unexpected pos``."""
    with open(path, "wb") as f:
        torch.save(obj, f)


@contextlib.contextmanager
def _clean_failure(tmp: Path, step: int) -> Iterator[None]:
    """A save that fails (disk full, quota, I/O error) leaves no partial files behind, so the
    disk is as full as before and a retry can succeed; the last good checkpoint stays."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- torch.save reports a full disk as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        pointer = tmp.parent / f".{LATEST}.tmp-{os.getpid()}"
        pointer.unlink(missing_ok=True)
        code = getattr(err, "errno", None)
        disk_full = code == errno.ENOSPC or "No space left" in str(err)
        kept = _pointer_name(tmp.parent) or "none yet"
        reason = "disk full" if disk_full else f"{type(err).__name__}: {err}".splitlines()[0]
        message = (
            f"could not save checkpoint step {step} in {tmp.parent} ({reason}); its partial "
            f"files were removed and the last good checkpoint ({kept}) is kept: free space "
            "and run the same command to resume"
        )
        raise CheckpointSaveError(code or errno.EIO, message) from err


def _pointer_name(root: Path) -> str | None:
    pointer = root / LATEST
    return (pointer.read_text().strip() or None) if pointer.is_file() else None


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
        pause_point()  # a kill here leaves only .old-step_N: recover_checkpoints() puts it back
        os.replace(tmp, final)
        pause_point()
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
        pause_point()  # a kill here leaves step_N uncommitted: the next start removes it
    atomic_write_text(root / LATEST, final.name + "\n")
    pause_point()
    prune_checkpoints(root.parent, final, keep)


def prune_checkpoints(out_dir: str | Path, current: Path, keep: int) -> None:
    """Keep ``current`` and the ``keep - 1`` checkpoints before it; delete the rest, including
    any with a higher step (not part of this run's history: left by an abandoned timeline)."""
    found = list_checkpoints(out_dir)
    older = [p for p in found if step_of(p) < step_of(current)]
    doomed = [p for p in found if step_of(p) > step_of(current)]
    doomed += older[: max(0, len(older) - (keep - 1))]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)


def recover_checkpoints(out_dir: str | Path, keep: int | None = None) -> list[str]:
    """Bring ``out_dir/checkpoints`` back to a committed state after a kill (call before
    resuming, on one process); returns what it did, one line each.

    - ``.old-step_N-*`` with no ``step_N``: a kill between the two renames of a re-save; the
      directory is the good old checkpoint and is renamed back. With ``step_N`` present the
      re-save finished and the old copy is deleted.
    - ``.tmp-*`` (checkpoints being written) and ``.latest.tmp-*`` (pointer being written)
      are deleted; so are checkpoints newer than the one ``latest`` names (renamed into place
      by a save killed before it committed).
    - ``latest`` missing (a kill before the first pointer was written): the newest checkpoint.
    - ``keep`` (resuming): a kill during a save's pruning left too many; the oldest go.
    """
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    notes = []
    for old in sorted(root.glob(f".old-{PREFIX}*")):
        name = old.name[len(".old-") :].rsplit("-", 1)[0]
        if (root / name).exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, root / name)
            notes.append(f"recovered checkpoint {name} (a save was killed between two renames)")
    stale = sorted(root.glob(".tmp-*")) + sorted(root.glob(f".{LATEST}.tmp-*"))
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        notes.append(f"removed {len(stale)} temporary file(s) left by a killed save")
    found = list_checkpoints(out_dir)
    committed = _pointer_name(root)
    if committed is None and found:
        committed = found[-1].name
        atomic_write_text(root / LATEST, committed + "\n")
    if committed is not None and (root / committed).is_dir():
        for path in found:
            if step_of(path) > step_of(root / committed):
                shutil.rmtree(path, ignore_errors=True)
                notes.append(f"removed {path.name}: written by a save killed before it committed")
        if keep is not None:
            prune_checkpoints(out_dir, root / committed, keep)
    return notes


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
    extra: dict[str, Any] | None = None,
) -> Path:
    """Sharded (FSDP) checkpoint; every rank must call it. Same atomic layout as
    :func:`save_checkpoint`, with ``dcp/`` holding each rank's shards of weights + optimizer.
    Assumes all ranks share the filesystem (one node, or a shared disk)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from deltaflow.parallel.fsdp import full_state_dict

    root = checkpoint_dir(out_dir)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"  # the same name on every rank: they all write into it
    if global_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a run killed mid-save
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    error = None
    try:
        with single_process_ok():
            dcp.save(
                {"model": model_state, "optimizer": optim_state},
                checkpoint_id=tmp / SHARDED,
                no_dist=not is_distributed(),  # a parallel="fsdp" run on one process
            )
    except Exception as err:  # noqa: BLE001 -- reported below, on every rank alike
        error = f"{type(err).__name__}: {err}"
    weights = full_state_dict(model)  # collective; only rank 0 gets the tensors
    rng = gather_rng_states()
    error = first_error(error)
    if global_rank() == 0:
        try:
            with _clean_failure(tmp, step):
                if error is not None:
                    raise OSError(error)
                save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
                _torch_save({"step": step, "rng": rng, **(extra or {})}, tmp / "trainer_state.pt")
                _write_metadata(tmp, step, config, info, tokenizer)
                write_manifest(tmp)  # every rank's shards are in: dcp.save returned everywhere
                pause_point()
                _commit(tmp, final, keep)
        except CheckpointSaveError as err:
            error = str(err)
    # nobody moves on (or exits) before the checkpoint is in place, or all stop with the error
    agree(error if global_rank() == 0 else None, CheckpointSaveError)
    return final


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / SHARDED).is_dir()


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=step_of)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest committed checkpoint of a run directory (the one ``latest`` names), or None.

    Read-only: a checkpoint moved aside by a killed re-save (``.old-step_N-*``) is returned
    as it lies; :func:`recover_checkpoints` renames it back.
    """
    root = checkpoint_dir(out_dir)
    name = _pointer_name(root)
    if name is not None:
        if (root / name / "model.safetensors").is_file():
            return root / name
        aside = sorted(root.glob(f".old-{name}-*"))
        if aside:
            return aside[0]
        raise FileNotFoundError(
            f"{root / LATEST} names {name}, which is missing (the folder was changed by hand): "
            "restore it, or start over with --no-resume (the old run is archived)"
        )
    found = list_checkpoints(out_dir)  # a kill before the first pointer was written
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


# The files of a checkpoint its loaders read: its manifest must list each of them.
LOADED_FILES = ("model.safetensors", "trainer_state.pt", "config.yaml", "state.json")
TRUST_HINT = "pass --trust-checkpoint to load it unchecked (only a folder you trust)"


def verify_checkpoint(path: Path, *, trusted: bool = False) -> None:
    """Check a checkpoint's files against its manifest (corruption: a flipped byte, a
    truncated copy). Every checkpoint this version writes has one, so a missing manifest is
    an error too (deleting it must not turn the check off), unless ``trusted``."""
    if trusted:
        return
    if not (path / MANIFEST).is_file():
        raise CheckpointVerifyError(
            f"{path} has no {MANIFEST}, so its files cannot be checked (deltaflow writes one "
            f"into every checkpoint: it was deleted, or the folder is from an old version); "
            f"{TRUST_HINT}"
        )
    try:
        verify_manifest(path, require_signature=False, required=LOADED_FILES)
    except CheckpointVerifyError as err:
        raise CheckpointVerifyError(f"{err}; {TRUST_HINT}") from None


def _read_state_file(file: Path) -> dict[str, Any]:
    """``trainer_state.pt`` (``weights_only``: tensors, numbers, containers; never code)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- pickle, zip and torch errors differ by version
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise CheckpointVerifyError(
            f"{file} cannot be read as a checkpoint's trainer state ({reason}); it holds more "
            "than tensors and numbers, or is corrupt: not a file deltaflow wrote"
        ) from None


def read_state_json(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (one error line naming the file when it is not JSON)."""
    file = Path(path) / "state.json"
    try:
        state = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}): the checkpoint is damaged") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{file} has no 'step': the checkpoint is damaged")
    return state


def read_config(path: Path) -> dict[str, Any]:
    """A checkpoint's ``config.yaml`` (the TrainConfig dict), with a named error."""
    file = Path(path) / "config.yaml"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.yaml: not a deltaflow checkpoint")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{file} is not valid YAML ({reason})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a config (a YAML mapping of TrainConfig fields)")
    return data


def read_trainer_state(path: Path, *, trusted: bool = False) -> dict[str, Any]:
    """``trainer_state.pt`` of a checkpoint, after checking the manifest's hashes."""
    verify_checkpoint(path, trusted=trusted)
    return _read_state_file(path / "trainer_state.pt")


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Load weights (strict) and, if given, optimizer state; returns the trainer state dict.

    Weights come from ``model.safetensors``, so this reads any checkpoint into an unsharded
    model, including a sharded one's consolidated weights. Resuming a sharded checkpoint's
    optimizer state needs :func:`load_sharded_checkpoint`. The files are checked against the
    checkpoint's manifest first, which must exist unless ``trusted`` (:func:`verify_checkpoint`).
    """
    path = resolve_checkpoint(path)
    state = read_trainer_state(path, trusted=trusted)
    if optimizer is not None and "optimizer" not in state:
        hint = " (sharded: resume it with parallel='fsdp')" if is_sharded_checkpoint(path) else ""
        raise ValueError(f"{path} has no optimizer state; cannot resume training from it{hint}")
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        restore_rng_states(state["rng"])
    return state


def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    restore_rng: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Resume weights + optimizer from a sharded checkpoint (every rank must call it).

    DCP reshards on load, so the run may continue on a different number of GPUs. DCP reads a
    pickle (``dcp/.metadata``), so rank 0 first checks the checkpoint against its manifest,
    which must be signed with this user's key (:mod:`deltaflow.train.manifest`); a checkpoint
    that does not verify is refused on every rank. ``trusted=True`` skips the check (for a
    folder you trust that was written under another key or before manifests existed).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = resolve_checkpoint(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded (FSDP) checkpoint; resume it with parallel='ddp'"
        )
    error = None
    if global_rank() == 0 and not trusted:
        try:
            verify_manifest(path, require_signature=True, strict_under=SHARDED)
        except CheckpointVerifyError as err:
            error = (
                f"refusing to resume {path}: {err}. Its dcp/.metadata is a pickle, which can run "
                "code, so only checkpoints whose signed manifest verifies are loaded; if you "
                "trust whoever wrote this folder, pass --trust-checkpoint (manifest check)"
            )
    agree(error, CheckpointVerifyError)
    model_state, optim_state = get_state_dict(model, optimizer)
    with single_process_ok():
        dcp.load(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=path / SHARDED,
            no_dist=not is_distributed(),
        )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    state = _read_state_file(path / "trainer_state.pt")
    if restore_rng:
        restore_rng_states(state["rng"])
    return state


def load_config(path: str | Path) -> dict[str, Any]:
    """The TrainConfig dict stored with a checkpoint."""
    return read_config(resolve_checkpoint(path))
