"""experiments/device_batch.sh runs a command file's lines at once, and a `then ` line after the
line above it on the call's remaining time, after merging the carried runs/carry/issue11 into
the machine's runs/issue11 without overwriting (checked with a stand-in for `deltaflow compare`
and for the GPU tools, so it runs on a CPU-only machine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_CLI = """#!/usr/bin/env bash
# a stand-in for `deltaflow compare`: log when each line starts and ends
echo "start $(date +%s.%N) $*" >> "$CALLS"
case "$*" in *--preset\\ slow*) sleep 2 ;; esac
echo "end $(date +%s.%N) $*" >> "$CALLS"
"""


def machine_with_fake_tools(tmp_path: Path) -> dict[str, str]:
    """tmp_path as the device's repo root: the scripts device_batch.sh runs, a fake GPU and
    `compare`; returns the environment to run it in."""
    (tmp_path / "experiments").mkdir()
    for name in ("device_batch.sh", "pack_resume.py", "merge_carry.py"):
        shutil.copy(REPO / "experiments" / name, tmp_path / "experiments" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho fake GPU\n")
    (bin_dir / "fake-compare").write_text(FAKE_CLI)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DEVICE_BATCH_CLI": str(bin_dir / "fake-compare"),
        "CALLS": str(tmp_path / "calls.log"),
        "OUT": str(tmp_path / "out"),
    }


def run_device_batch(tmp_path: Path, env: dict[str, str], lines: str):
    """device_batch.sh on a command file holding ``lines``, from the fake machine's root."""
    commands = tmp_path / "commands.txt"
    commands.write_text(lines)
    return subprocess.run(
        ["bash", "experiments/device_batch.sh", str(commands), "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_then_lines_wait_for_the_line_above_and_get_the_time_left(tmp_path):
    env = machine_with_fake_tools(tmp_path)
    calls = tmp_path / "calls.log"
    done = run_device_batch(
        tmp_path,
        env,
        "# a comment\n"
        "--preset slow --time-limit 3.0 --out runs/issue11/a\n"
        "then --preset after_slow --time-limit 9.0 --out runs/issue11/b\n"
        "--preset fast --time-limit 1.0 --out runs/issue11/c\n"
        "then --preset too_late --time-limit 9.0 --out runs/issue11/d\n",
    )
    assert done.returncode == 0, done.stderr
    events = {}
    for line in calls.read_text().splitlines():
        kind, stamp, *argv = line.split()
        events[(kind, argv[1])] = (float(stamp), argv)
    # the chained line starts after the slow one ends, with the chain's first limit minus
    # the seconds spent (3.0 - ~0.03 minutes, printed to 0.1), not its own 9.0
    assert events[("start", "after_slow")][0] >= events[("end", "slow")][0]
    argv = events[("start", "after_slow")][1]
    assert argv[argv.index("--time-limit") + 1] == "3.0"
    # the fast line's chain had 1.0 minute: less than 1.5 left, so its next line is skipped
    assert ("start", "too_late") not in events
    assert "[4] skipped" in done.stdout
    assert (tmp_path / "out" / "issue11.tgz").is_file()


def test_a_file_cannot_start_with_then(tmp_path):
    commands = tmp_path / "commands.txt"
    commands.write_text("then --preset x --time-limit 3 --out runs/issue11/a\n")
    done = subprocess.run(
        ["bash", str(REPO / "experiments" / "device_batch.sh"), str(commands), "0"],
        cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path / "out"), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cannot start with 'then'" in done.stderr


def write_runs(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_carry_fills_in_what_a_warm_machine_lacks_and_keeps_what_it_has(tmp_path):
    """A carried path replaces the machine's: session 31's call 2 carried runs/issue11 onto a
    warm machine and wiped its unfinished runs' checkpoints. The carry now lands beside it, in
    runs/carry/issue11, and is merged in without overwriting anything the machine has."""
    env = machine_with_fake_tools(tmp_path)
    machine, carry = tmp_path / "runs" / "issue11", tmp_path / "runs" / "carry" / "issue11"
    # the warm machine: grid g with runs a (newer record than the carry's) and b, and run r1's
    # checkpoint at step 20
    write_runs(machine / "g" / "runs.jsonl", [{"id": "a", "v": "machine"}, {"id": "b"}])
    ckpt = machine / "g" / "runs" / "r1" / "checkpoints" / "step_20" / "model.bin"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text("step 20, the machine's")
    # the carry: an older runs.jsonl of g (a as it was, and x, finished elsewhere), r1 at an
    # older step, and another grid h the machine has never seen
    write_runs(carry / "g" / "runs.jsonl", [{"id": "a", "v": "carry"}, {"id": "x"}])
    (carry / "g" / "results.md").write_text("g's table")
    old_ckpt = carry / "g" / "runs" / "r1" / "checkpoints" / "step_20" / "model.bin"
    old_ckpt.parent.mkdir(parents=True)
    old_ckpt.write_text("an older write")
    (carry / "g" / "runs" / "r1" / "checkpoints" / "step_10").mkdir()
    (carry / "g" / "runs" / "r1" / "checkpoints" / "step_10" / "model.bin").write_text("step 10")
    write_runs(carry / "h" / "runs.jsonl", [{"id": "h1"}])
    (carry / "h" / "runs" / "r9").mkdir(parents=True)
    (carry / "h" / "runs" / "r9" / "state.json").write_text("r9's checkpoint")
    done = run_device_batch(tmp_path, env, "--preset fast --time-limit 1.0 --out runs/issue11/c\n")
    assert done.returncode == 0, done.stderr
    assert ckpt.read_text() == "step 20, the machine's"  # the warm machine's checkpoint stays
    # r1 is the machine's run: none of the carry's older checkpoints is mixed into it
    assert not (ckpt.parents[1] / "step_10").exists()
    # what the machine lacked is added: g's table, grid h with its run directory
    assert (machine / "g" / "results.md").read_text() == "g's table"
    assert (machine / "h" / "runs" / "r9" / "state.json").read_text() == "r9's checkpoint"
    h_lines = (machine / "h" / "runs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in h_lines] == [{"id": "h1"}]
    # g's runs.jsonl: the union by run id, the machine's record winning for a
    lines = (machine / "g" / "runs.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == [{"id": "a", "v": "machine"}, {"id": "b"}, {"id": "x"}]
    assert "carry: merged runs/carry/issue11 into runs/issue11 (" in done.stdout
    assert (
        "3 files added" in done.stdout and "1 runs.jsonl merged by run id: +1 runs" in done.stdout
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_fresh_machine_gets_the_whole_carry(tmp_path):
    """No runs/ on a fresh machine: the carry arrives whole, so finished runs skip."""
    env = machine_with_fake_tools(tmp_path)
    carry = tmp_path / "runs" / "carry" / "issue11"
    write_runs(carry / "g" / "runs.jsonl", [{"id": "a"}])
    (carry / "g" / "runs" / "r1").mkdir(parents=True)
    (carry / "g" / "runs" / "r1" / "state.json").write_text("r1")
    done = run_device_batch(tmp_path, env, "--preset fast --time-limit 1.0 --out runs/issue11/c\n")
    assert done.returncode == 0, done.stderr
    machine = tmp_path / "runs" / "issue11"
    assert (machine / "g" / "runs.jsonl").read_text() == '{"id": "a"}\n'
    assert (machine / "g" / "runs" / "r1" / "state.json").read_text() == "r1"
    assert "(2 files added, 0 kept" in done.stdout
