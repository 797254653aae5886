"""Merge the carried runs/carry/issue11 into a device machine's runs/issue11, never overwriting.

    python3 experiments/merge_carry.py [CARRY] [RUNS]   (defaults runs/carry/issue11 runs/issue11)

Called by device_batch.sh before any run starts. A call's `carry` REPLACES the named path on
the machine, and whether a call lands on a warm machine (which keeps runs/issue11 from the last
call: unfinished runs' checkpoints, up to 0.4 GB each, that never come back) or on a fresh one
is not known in advance. Session 31's call 2 carried runs/issue11 itself onto a warm machine and
wiped those checkpoints: every unfinished run restarted from zero. So the local state travels as
runs/carry/issue11 (collect_device.py writes it) and is merged here:
- a file the machine lacks is copied (a fresh machine gets everything);
- a file the machine has is kept (a warm machine's copy is the newer one);
- a run directory (<grid>/runs/<run id>/) the machine has is kept whole: one run's checkpoints
  from two points in time are never mixed;
- runs.jsonl present on both sides: the union by run id, the machine's record winning (on a warm
  machine it is a superset of the carried one; a fresh machine's would be absent).
Standard library only: it runs on the device before anything else and must not wait on torch.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def merge_runs_jsonl(carried: Path, machine: Path) -> int:
    """Append to ``machine`` the carried records whose id it lacks (its own lines stay as they
    are, byte for byte); returns how many were added."""
    lines = machine.read_text().splitlines()
    have = {json.loads(line)["id"] for line in lines if line.strip()}
    added = []
    for line in carried.read_text().splitlines():
        if line.strip() and json.loads(line)["id"] not in have:
            have.add(json.loads(line)["id"])
            added.append(line)
    if added:
        tmp = machine.with_name(f".{machine.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in [*lines, *added]))
        tmp.replace(machine)
    return len(added)


def run_dir(rel: Path) -> Path | None:
    """The run directory (<grid>/runs/<run id>) a path relative to issue11 lies in, or None."""
    parts = rel.parts
    return Path(*parts[:3]) if len(parts) > 3 and parts[1] == "runs" else None


def merge_carry(carry: Path, runs: Path) -> dict[str, int]:
    """Counts: files added, files kept (the machine's), runs.jsonl merged, runs added to them."""
    counts = {"added": 0, "kept": 0, "merged": 0, "runs": 0}
    # run directories the machine had before this merge (the ones it adds must fill in whole)
    machine_runs = {p.relative_to(runs) for p in runs.glob("*/runs/*") if p.is_dir()}
    for src in sorted(p for p in carry.rglob("*") if p.is_file()):
        rel = src.relative_to(carry)
        dst = runs / rel
        if run_dir(rel) in machine_runs:
            counts["kept"] += 1
        elif src.name == "runs.jsonl" and dst.is_file():
            counts["merged"] += 1
            counts["runs"] += merge_runs_jsonl(src, dst)
        elif dst.exists():
            counts["kept"] += 1
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            counts["added"] += 1
    return counts


def main(argv: list[str]) -> int:
    if any(a.startswith("-") for a in argv) or len(argv) > 2:
        print(__doc__)
        return 0 if argv in (["-h"], ["--help"]) else 2
    defaults = ["runs/carry/issue11", "runs/issue11"]
    carry, runs = (Path(a) for a in [*argv, *defaults[len(argv) :]])
    if not carry.is_dir():
        print(f"carry: no {carry} (nothing carried; runs/issue11 as the machine has it)")
        return 0
    c = merge_carry(carry, runs)
    print(
        f"carry: merged {carry} into {runs} ({c['added']} files added, {c['kept']} kept, "
        f"{c['merged']} runs.jsonl merged by run id: +{c['runs']} runs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
