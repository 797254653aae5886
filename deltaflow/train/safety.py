"""What a command may write: the run-folder lock, atomic folder swaps, output-folder checks.

The rule every writing command follows: it never deletes or replaces what it did not create;
it writes beside its destination and swaps the result in atomically; a kill at any moment
leaves the old state or the new one, and the next command cleans up what a killed one left.

- :class:`RunLock`: a run folder (``--out`` of ``deltaflow train``) is used by one run at a
  time. The lock is ``<out>/.deltaflow-run.lock``, held with ``flock`` for the life of the
  run and holding the owner's PID (for the refusal message). The kernel drops a ``flock``
  when its process dies, so a lock left by ``kill -9`` is stale by construction and the next
  run takes it over.
- :func:`swap_in`: put a finished folder in place of an existing one with one
  ``renameat2(RENAME_EXCHANGE)``, so the destination never disappears (two renames leave a
  window where it is gone); where the call is missing, two renames plus :func:`recover_aside`.
- :func:`check_export_dest`: an export may replace an earlier export, nothing else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import IO

LOCK = ".deltaflow-run.lock"
RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100

# Names whose presence makes a folder a run folder (the trainer's outputs) or a checkpoint.
RUN_MARKERS = (LOCK, "run_config.yaml", "log.jsonl", "final.json", "checkpoints/latest")
CHECKPOINT_MARKERS = ("trainer_state.pt", "manifest.json")


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (ours or another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_pid(name: str) -> int | None:
    """The PID at the end of a temporary name (``.final.tmp-1234`` -> 1234), else None."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


class RunLockedError(ValueError):
    """Another live process holds the run folder."""


class RunLock:
    """An exclusive ``flock`` on ``<folder>/.deltaflow-run.lock`` (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 -- kept open: the lock lives with the file
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise RunLockedError(
                f"{self.path.parent} is in use by another deltaflow run (PID {owner}); wait for "
                "it to end (or stop it) or give another --out"
            ) from None
        # the lock is ours; a PID written by a killed run (whose lock the kernel dropped) is
        # replaced by ours
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def _renameat2() -> object | None:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    return getattr(libc, "renameat2", None)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is not supported."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)  # type: ignore[operator]
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def aside_name(dest: Path, kind: str) -> Path:
    """``.DEST.tmp-PID`` / ``.DEST.old-PID``: where a folder is written or moved aside."""
    return dest.with_name(f".{dest.name}.{kind}-{os.getpid()}")


def swap_in(tmp: Path, dest: Path) -> None:
    """Put the finished ``tmp`` at ``dest``; an existing ``dest`` is deleted after the swap.
    At no moment is ``dest`` missing (where ``renameat2`` exists)."""
    from deltaflow.train.checkpoint import pause_point  # tests: widen the windows below

    if not dest.exists():
        os.replace(tmp, dest)
        return
    if exchange(tmp, dest):
        pause_point()  # a kill here leaves the old folder as .DEST.tmp-PID: cleaned next time
        shutil.rmtree(tmp)  # the old folder, now under the temporary name
        return
    old = aside_name(dest, "old")  # a kill between these renames: recover_aside puts it back
    os.replace(dest, old)
    pause_point()
    os.replace(tmp, dest)
    shutil.rmtree(old)


def recover_aside(dest: Path) -> list[str]:
    """Clean what killed writers of ``dest`` left beside it (``.DEST.tmp-PID``,
    ``.DEST.old-PID`` of processes that are gone); an ``.old`` with no ``dest`` is the
    previous folder moved aside between two renames, and is put back."""
    notes = []
    for path in sorted(dest.parent.glob(f".{dest.name}.*-*")):
        kind = path.name[len(dest.name) + 2 :].rsplit("-", 1)[0]
        pid = leftover_pid(path.name)
        if kind not in ("tmp", "old") or pid is None or (pid != os.getpid() and pid_alive(pid)):
            continue
        if kind == "old" and not dest.exists():
            os.replace(path, dest)
            notes.append(f"put back {dest} (moved aside by a process killed while replacing it)")
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return notes


def run_or_checkpoint(folder: Path) -> str | None:
    """'a run folder' / 'a checkpoint' when ``folder`` is one, else None."""
    if any((folder / name).exists() for name in RUN_MARKERS):
        return "a run folder"
    if (folder / "model.safetensors").is_file() and any(
        (folder / name).is_file() for name in CHECKPOINT_MARKERS
    ):
        return "a checkpoint"
    return None


def is_export(folder: Path) -> bool:
    """A folder ``deltaflow export`` wrote: flat, a deltaflow ``config.json`` and
    ``train_config.yaml``."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    flat = all(p.is_file() for p in folder.iterdir())
    return (
        flat
        and isinstance(config, dict)
        and config.get("model_type") == "deltaflow"
        and (folder / "train_config.yaml").is_file()
    )


def check_export_dest(dest: str | Path, flag: str = "--out") -> Path:
    """Refuse an export destination that is not new, empty or an earlier export: a file, a
    folder holding anything else (a run, a checkpoint, other files), or a folder inside a run
    or checkpoint. Returns the resolved path."""
    given = Path(dest)
    path = given.resolve()
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{flag} {given} is under {parent}, which is a file; give a folder")
        what = run_or_checkpoint(parent) if parent.is_dir() else None
        if what is not None:
            raise ValueError(
                f"{flag} {given} is inside {what} ({parent}); give a folder outside it"
            )
    if not path.exists():
        return path
    if not path.is_dir():
        raise ValueError(f"{flag} {given} is a file; give a new folder (it is created)")
    what = run_or_checkpoint(path)
    if what is not None:
        raise ValueError(f"{flag} {given} is {what}; give a new folder (it is created)")
    if any(path.iterdir()) and not is_export(path):
        raise ValueError(
            f"{flag} {given} is a folder with other files (not an earlier export, which would "
            "be replaced); give a new or empty folder"
        )
    return path


def unexpected_files(old: Path, new: Path) -> list[str]:
    """Files of the folder ``old`` that the folder ``new`` has no counterpart for: replacing
    ``old`` by ``new`` would delete them."""
    if not old.is_dir():
        return []
    return sorted(p.name for p in old.iterdir() if not (new / p.name).exists())
