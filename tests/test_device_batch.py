"""experiments/device_batch.sh runs a command file's lines at once, and a `then ` line after the
line above it on the call's remaining time (checked with a stand-in for `deltaflow compare`
and for the GPU tools, so it runs on a CPU-only machine)."""

from __future__ import annotations

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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_then_lines_wait_for_the_line_above_and_get_the_time_left(tmp_path):
    (tmp_path / "experiments").mkdir()
    for name in ("device_batch.sh", "pack_resume.py"):
        shutil.copy(REPO / "experiments" / name, tmp_path / "experiments" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho fake GPU\n")
    (bin_dir / "fake-compare").write_text(FAKE_CLI)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    commands = tmp_path / "commands.txt"
    commands.write_text(
        "# a comment\n"
        "--preset slow --time-limit 3.0 --out runs/issue11/a\n"
        "then --preset after_slow --time-limit 9.0 --out runs/issue11/b\n"
        "--preset fast --time-limit 1.0 --out runs/issue11/c\n"
        "then --preset too_late --time-limit 9.0 --out runs/issue11/d\n"
    )
    calls = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DEVICE_BATCH_CLI": str(bin_dir / "fake-compare"),
        "CALLS": str(calls),
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(
        ["bash", "experiments/device_batch.sh", str(commands), "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
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
