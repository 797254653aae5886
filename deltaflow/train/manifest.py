"""Checkpoint manifests: the SHA-256 of every file a checkpoint holds, signed with a local key.

Why: an FSDP checkpoint is resumed through ``torch.distributed.checkpoint`` (DCP), whose
``dcp/.metadata`` is a pickle, and unpickling runs whatever code the file names. A checkpoint
folder is therefore only as trustworthy as whoever could write to it. When a checkpoint is
saved, rank 0 (after every rank has written its shards) hashes every file of it into
``manifest.json`` and signs the list with HMAC-SHA256 under a key that never leaves this
user's account (``~/.config/deltaflow/checkpoint.key``, created on first use, mode 0600; or
``$DELTAFLOW_CHECKPOINT_KEY``, e.g. for a cluster whose nodes do not share a home). Resuming
a sharded checkpoint checks the signature and every hash *before* DCP reads any file, and
refuses one that does not verify (edited, planted, truncated, or written under another key)
unless the caller says it trusts the folder (``--trust-checkpoint``).

The rest of a checkpoint holds no code: ``model.safetensors`` is plain tensors and
``trainer_state.pt`` is read with ``torch.load(weights_only=True)``; for those the manifest's
hashes catch corruption (a truncated or half-copied file), and its signature is not needed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
KEY_ENV = "DELTAFLOW_CHECKPOINT_KEY"  # the key itself (any string)
KEY_FILE_ENV = "DELTAFLOW_CHECKPOINT_KEY_FILE"  # or where the key file lives


class CheckpointVerifyError(ValueError):
    """A checkpoint's files do not match its manifest, or the manifest is not ours."""


def key_path() -> Path:
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV])
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "deltaflow" / "checkpoint.key"


def checkpoint_key() -> bytes:
    """This user's signing key; the key file is created (0600, 32 random bytes) on first use."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV].encode()
    path = key_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)  # atomic and never overwrites: two first users agree on one key
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    for _ in range(50):  # another process may be between creating and filling the file
        key = path.read_text().strip()
        if key:
            return key.encode()
        time.sleep(0.01)
    raise CheckpointVerifyError(f"checkpoint key file {path} is empty; delete it to make a new one")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _signature(files: dict[str, str], key: bytes) -> str:
    text = json.dumps(files, sort_keys=True).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def write_manifest(folder: str | Path) -> None:
    """Hash every file under ``folder`` into ``folder/manifest.json`` and sign the list."""
    folder = Path(folder)
    files = {name: sha256_file(folder / name) for name in _files(folder)}
    manifest: dict[str, Any] = {
        "files": files,
        "hmac_sha256": _signature(files, checkpoint_key()),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def verify_manifest(
    folder: str | Path,
    *,
    require_signature: bool,
    strict_under: str | None = None,
    required: tuple[str, ...] = (),
) -> bool:
    """Check ``folder`` against its manifest; raise :class:`CheckpointVerifyError` if it does not
    match. Returns False (nothing checked) when there is no manifest and none is required.

    ``require_signature``: the manifest must be signed with this user's key (it is the only
    thing that tells a manifest we wrote from one written next to a planted file); without
    it, a manifest with no signature or another key's is accepted and its hashes checked.
    ``strict_under``: a subfolder in which every file must be listed (``dcp``: nothing planted
    beside the shards). ``required``: files that must be listed (a manifest edited to leave
    out the file that was changed is caught).
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        if require_signature:
            raise CheckpointVerifyError(
                f"{folder} has no {MANIFEST}, so its files cannot be verified"
            )
        return False
    try:
        manifest = json.loads(path.read_text())
        files = dict(manifest["files"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CheckpointVerifyError(f"{path} is not a valid manifest") from None
    if require_signature:
        expected = _signature(files, checkpoint_key())
        if not hmac.compare_digest(str(manifest.get("hmac_sha256", "")), expected):
            raise CheckpointVerifyError(
                f"{path} is not signed with this user's checkpoint key ({key_path()} or "
                f"${KEY_ENV}): it was written elsewhere or edited"
            )
    unlisted = [name for name in required if (folder / name).exists() and name not in files]
    if unlisted:
        raise CheckpointVerifyError(f"{folder}: {unlisted[0]} is not listed in {MANIFEST}")
    for name, digest in files.items():
        file = folder / name
        if ".." in Path(name).parts or not file.is_file():
            raise CheckpointVerifyError(f"{folder}: {name} (listed in {MANIFEST}) is missing")
        if sha256_file(file) != digest:
            raise CheckpointVerifyError(
                f"{folder}: {name} does not match its SHA-256 in {MANIFEST} (changed or truncated)"
            )
    if strict_under is not None:
        extra = [n for n in _files(folder) if n.startswith(f"{strict_under}/") and n not in files]
        if extra:
            raise CheckpointVerifyError(f"{folder}: {extra[0]} is not listed in {MANIFEST}")
    return True
