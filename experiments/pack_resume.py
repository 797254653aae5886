"""Pack the newest checkpoints of small unfinished runs, so that they outlive the device machine.

    python3 experiments/pack_resume.py runs/issue11 $OUT/resume.tgz [--max-mib 15]

A device machine goes back 30 s after a call and takes the unfinished runs' checkpoints with
it: in session 6 two 15,000-step state-tracking runs stopped at steps 14,125 and 14,350 and
were lost that way. A small run's checkpoint (state tracking: ~6 MB with AdamW's state) fits
through $OUT (16 MiB a file) and through the next fresh machine's `carry` (64 MiB the tree).
This packs each unfinished run's directory with its newest checkpoint only (top-level files
such as log.jsonl, `checkpoints/latest`, `checkpoints/step_N/`), most advanced runs first, up
to --max-mib; a run that does not fit is named and skipped (an LM checkpoint is ~0.4 GB).
`collect_device.py` unpacks the archive into runs/ and drops the directories of runs that
have finished since.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

from deltaflow.lab.runner import finished_run_dirs
from deltaflow.train.checkpoint import LATEST, checkpoint_dir, latest_checkpoint

MIB = 2**20


def resume_files(run_dir: Path) -> tuple[int, list[Path]] | None:
    """(step, files) that let ``run_dir`` resume from its newest checkpoint; None without one."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    files = [f for f in run_dir.iterdir() if f.is_file()]
    pointer = checkpoint_dir(run_dir) / LATEST
    files += [pointer] if pointer.is_file() else []
    files += sorted(f for f in newest.rglob("*") if f.is_file())
    return int(json.loads((newest / "state.json").read_text())["step"]), files


def unfinished_runs(root: Path) -> list[tuple[int, Path, list[Path]]]:
    """(step, run dir, files) of every unfinished run with a checkpoint, most advanced first."""
    found = []
    for grid_folder in sorted(p for p in root.iterdir() if (p / "runs").is_dir()):
        done = finished_run_dirs(grid_folder / "runs.jsonl")
        for run_dir in sorted(p for p in (grid_folder / "runs").iterdir() if p.is_dir()):
            packed = resume_files(run_dir) if run_dir.name not in done else None
            if packed is not None:
                found.append((packed[0], run_dir, packed[1]))
    return sorted(found, key=lambda item: -item[0])


def pack(root: Path, archive: Path, max_bytes: float) -> list[Path]:
    """Write ``archive`` with the resume files of the most advanced runs that fit ``max_bytes``
    (no archive when none fits); returns the packed run directories."""
    used, packed = 0, []
    for step, run_dir, files in unfinished_runs(root):
        size = sum(f.stat().st_size for f in files)
        fits = used + size <= max_bytes
        print(f"resume: {'packed' if fits else 'skipped (over budget)'} {run_dir.name}", end="")
        print(f" at step {step}, {size / MIB:.1f} MiB")
        if fits:
            used += size
            packed.append((run_dir, files))
    if packed:
        with tarfile.open(archive, "w:gz") as tar:
            for _, files in packed:
                for f in files:  # names relative to root's parent: issue11/<grid>/runs/<run>/...
                    tar.add(f, arcname=str(f.relative_to(root.parent)))
    return [run_dir for run_dir, _ in packed]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="the device's runs/issue11")
    parser.add_argument("archive", type=Path, help="where to write the .tgz (under $OUT)")
    parser.add_argument("--max-mib", type=float, default=15.0, help="size budget, uncompressed")
    args = parser.parse_args()
    if not args.root.is_dir():
        parser.error(f"root: {args.root} is not a folder")
    packed = pack(args.root, args.archive, args.max_mib * MIB)
    print(f"resume: {len(packed)} runs packed" + (f" into {args.archive}" if packed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
