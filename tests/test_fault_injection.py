"""Fault injection (issue 34's goal): `deltaflow train` and `deltaflow export` killed with
SIGKILL at random moments, again and again, among other runs, an earlier export and a user's
file. After every kill, nothing outside the command's own output has changed by a byte, an
export destination is never missing or half-written, and the next command of each kind
finishes and leaves no temporary file behind.

The processes are forked from tests/_fork_server.py; DELTAFLOW_TEST_SAVE_PAUSE widens the
windows inside saves and exports (between writing, swapping and deleting) so that kills land
in them. Knobs: DELTAFLOW_FAULT_KILLS (default 16), DELTAFLOW_FAULT_SEED (default 0).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from _fork_server import ForkServer

pytestmark = pytest.mark.multiprocess

TINY = [
    *("--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"),
    *("--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"),
    *("--device", "cpu", "--no-progress", "--batch-size", "8", "--log-every", "2"),
    *("--set", "eval_kwargs={num_examples: 16, batch_size: 16}", "--eval-every", "20"),
]
EXPORT_FILES = {"config.json", "model.safetensors", "train_config.yaml"}


def snapshot(world: Path, own: list[str]) -> dict[str, bytes | None]:
    """Every path under ``world`` except the command's own output (names starting with one of
    ``own``, relative to ``world``), with its bytes (None for a folder)."""
    out: dict[str, bytes | None] = {}
    for path in sorted(world.rglob("*")):
        rel = str(path.relative_to(world))
        if any(rel == o or rel.startswith(f"{o}/") for o in own):
            continue
        if any(f"/.{o.rsplit('/', 1)[-1]}." in f"/{rel}" for o in own):  # .hf.tmp-PID beside
            continue
        out[rel] = path.read_bytes() if path.is_file() else None
    return out


def leftover_places(world: Path, own: str) -> list[Path]:
    """Where a killed command leaves temporary files: beside an export, in a run folder and
    its checkpoints folder."""
    places = [world / own, world / own / "checkpoints"]
    found = list(world.glob(f".{own}.*"))
    for place in places:
        if place.is_dir():
            found += [p for p in place.iterdir() if p.name != ".deltaflow-run.lock"]
    return found


def test_random_kills_of_train_and_export_change_nothing_but_their_own_output(tmp_path):
    kills = int(os.environ.get("DELTAFLOW_FAULT_KILLS", "16"))
    rng = random.Random(int(os.environ.get("DELTAFLOW_FAULT_SEED", "0")))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DELTAFLOW_TEST_SAVE_PAUSE": "0.02",
        "DELTAFLOW_CHECKPOINT_KEY": "fault-injection-test",
    }
    world, logs = tmp_path / "world", tmp_path / "logs"
    world.mkdir()
    logs.mkdir()
    server = ForkServer(env)
    try:

        def run(argv: list[str]) -> None:
            pid = server.start(argv, cwd=logs, log=logs / "ok.txt")
            assert server.wait(pid) == {"exit": 0}, (logs / "ok.txt").read_text()[-3000:]

        source = world / "runs" / "a"
        run(["train", *TINY, "--steps", "6", "--ckpt-every", "3", "--out", str(source)])
        run(["train", *TINY, "--steps", "2", "--out", str(world / "runs" / "b")])
        run(["export", str(source), "--out", str(world / "hf")])
        (world / "notes.txt").write_text("a user's file\n")
        export_bytes = {n: (world / "hf" / n).read_bytes() for n in EXPORT_FILES}

        commands = {
            # (argv, own output relative to world): a long run (checkpoints every 3 steps),
            # --no-resume now and then (archives), an export over an earlier one, a new one
            "train": (
                ["train", *TINY, "--steps", "400", "--ckpt-every", "3", "--out"],
                "runs/t",
            ),
            "train --no-resume": (
                ["train", *TINY, "--steps", "400", "--ckpt-every", "3", "--no-resume", "--out"],
                "runs/t",
            ),
            "export over": (["export", str(source), "--out"], "hf"),
            "export new": (["export", str(source), "--out"], "hf2"),
        }
        landed, t0 = {name: 0 for name in commands}, time.perf_counter()
        inside = 0  # kills that left a temporary file: they landed inside a write
        for i in range(20 * kills):
            if sum(landed.values()) == kills:
                break
            name = rng.choice(list(commands))
            argv, own = commands[name]
            before = snapshot(world, [own])
            pid = server.start([*argv, str(world / own)], cwd=logs, log=logs / f"{i}.txt")
            time.sleep(rng.uniform(0.0, 1.5))
            os.kill(pid, signal.SIGKILL)
            status = server.wait(pid)
            assert status.get("signal") == signal.SIGKILL or status == {"exit": 0}, (
                name,
                (logs / f"{i}.txt").read_text()[-3000:],
            )
            landed[name] += status.get("signal") == signal.SIGKILL
            inside += any(p.name.startswith(".") for p in leftover_places(world, own))
            assert snapshot(world, [own]) == before, (name, i)  # nothing else changed
            hf = world / "hf"  # an earlier export is never missing nor partial
            assert {n: (hf / n).read_bytes() for n in EXPORT_FILES} == export_bytes, (name, i)
        assert sum(landed.values()) == kills, landed
        assert inside > 0 or kills < 10  # the windows inside writes were hit
        seconds = time.perf_counter() - t0

        # every command finishes afterwards and leaves nothing temporary behind
        before = snapshot(world, ["runs/t", "hf", "hf2"])
        short_run = ["train", *TINY, "--steps", "8", "--ckpt-every", "3", "--no-resume", "--out"]
        for argv, own in (commands["export over"], commands["export new"], (short_run, "runs/t")):
            run([*argv, str(world / own)])
        assert snapshot(world, ["runs/t", "hf", "hf2"]) == before
        leftovers = [
            str(p.relative_to(world))
            for p in world.rglob(".*")
            if p.name not in (".deltaflow-run.lock", ".cli") and "archive" not in p.parts
        ]
        assert leftovers == []
        assert {p.name for p in (world / "hf2").iterdir()} >= EXPORT_FILES
    finally:
        server.close()
    print(f"{kills} kills {landed}, {inside} inside a write, in {seconds:.1f}s")
