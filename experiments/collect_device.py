"""Bring one device call's issue-11 results into the repository (after experiments/device_batch.sh).

    python3 experiments/collect_device.py /work/.device/N/issue11.tgz --call s5c1

1. unpacks the archive into runs/ (runs/issue11: the state the next call starts from);
2. merges each grid's runs.jsonl into results/issue11/<grid>/runs.jsonl by run id (a fresh
   machine's runs.jsonl holds only that machine's runs: never overwrite, always merge), and
   back into every folder of runs/issue11 that trains that grid (side folders included);
   With resume.tgz beside the archive (experiments/pack_resume.py: the newest checkpoints of small
   unfinished runs), unpacks it into runs/ too, so those runs continue on the next fresh
   machine instead of starting over; run directories of runs finished since are deleted;
3. copies the call's logs to results/issue11/logs/<call>_*.log (tokenizer progress dropped),
   and rewrites runs/carry/issue11 as a copy of runs/issue11 without its logs (see below);
4. re-makes each grid's results.md / summary.json / plots with `compare --report-only` over the
   full preset grid (a cell whose sweep is unfinished shows its best so far, marked *).
Then commit results/issue11.

    python3 experiments/collect_device.py --prepare-carry

builds runs/issue11 from the committed results alone (a fresh checkout has no runs/): every
device folder gets its grid's finished runs, so the first call's carry skips them; it writes
runs/carry/issue11 too.

Every device call carries ["runs/carry"], never ["runs/issue11"]: a carried path REPLACES that
path on the machine, and a warm machine's runs/issue11 holds unfinished runs' checkpoints (up to
0.4 GB each, never brought back) that are newer than anything here; carrying runs/issue11 wiped
them in session 31's call 2 and every unfinished run restarted from zero. device_batch.sh merges
runs/carry/issue11 into the machine's runs/issue11 without overwriting (experiments/
merge_carry.py), so the same carry suits a fresh machine and a warm one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

from deltaflow.cli import main as deltaflow_cli
from deltaflow.lab.runner import finished_run_dirs

GRIDS = (
    "state_tracking",
    "mqar_512",
    "mad",
    "lm_corpus_50m",
    "lm_corpus_1pass",
    "state_tracking_15k",
    "mqar_512_8k",
    "mqar_512_padded",
    # issue 24 (results/issue24/README.md): new folders, so the issue-11 tables stay as they are
    "i24_mqar_8k",
    "i24_mqar_transformer",
    "i24_mqar_transformer_zoology",
    "i24_lm_lr",
    "i24_lm_length",
    "i24_mod_arith_15k",
    "i24_parity_rawk",
    # issue 33 (results/issue24/call_mqar_sanity.txt): MQAR under Zoology's protocol
    "i33_mqar_zoology_attention",
    "i33_mqar_zoology_transformer",
    "i33_mqar_zoology_pair",
    # issue 33, session 31's next call (results/issue33/README.md): compiled blocks suspected
    "i33_lm_transformer_eager",
    "i33_mqar_zoology_eager",
    "i33_mqar_zoology_long",
)
# a device folder trained beside its grid's own (two processes never share one runs.jsonl)
MERGE_INTO = {"mqar_512_w128": "mqar_512", "mqar_512_w256": "mqar_512", "mad_b": "mad"}
# what a grid's table is made of: its preset, and the arguments that narrow or change it
REPORT_ARGS = {
    "lm_corpus_50m": "--preset lm_corpus_50m --shared shared".split(),
    # issue 24 adds four variants to the one-pass grid (their rows join the same table)
    "lm_corpus_1pass": (
        "--preset lm_corpus_1pass --shared shared --variants deltanet,efla,gated_deltanet,"
        "longhorn,kaczmarz,relaxed_kaczmarz,efla_decay,gated_efla_paper,relaxed_kaczmarz_noqnorm,"
        "transformer,gated_relaxed_kaczmarz,deltanet_rawk,deltanet_noqnorm"
    ).split(),
    "state_tracking_15k": (
        "--preset state_tracking --cells mod_arith --variants deltanet,deltanet_neg --lrs 1e-3 "
        "--seeds 3 --steps 15000"
    ).split(),
    "mqar_512_8k": (
        "--preset mqar_512 --widths 128 --variants linear,deltanet,gated_deltanet --lrs 1e-3 "
        "--seeds 2 --steps 8000"
    ).split(),
    # as Zoology's figure-2 configs: padding, not random tokens, between the queries
    "mqar_512_padded": (
        "--preset mqar_512 --set task_kwargs.random_non_queries=false --widths 64,128 "
        "--variants linear,deltanet,transformer --lrs 1e-3,3e-3 --seeds 4"
    ).split(),
    # issue 24: Zoology's linear attention vs DeltaNet at 8000 steps, 3 seeds
    "i24_mqar_8k": (
        "--preset mqar_512 --widths 64,128 --variants linear_zoology,deltanet --lrs 1e-3 "
        "--seeds 3 --steps 8000"
    ).split(),
    # issue 24: the Transformer at Zoology's lrs (results/issue24/README.md, item 1)
    "i24_mqar_transformer": (
        "--preset mqar_512 --widths 64,128 --variants transformer --lrs 1e-4,3e-4,1e-3"
    ).split(),
    # ... and with Zoology's optimizer recipe, one head, 8000 steps
    "i24_mqar_transformer_zoology": (
        "--preset mqar_512 --widths 64,128 --variants transformer --lrs 1e-4,3e-4,1e-3 "
        "--steps 8000 --set weight_decay=0.01 --set beta2=0.999 --set grad_clip=0 "
        "--set warmup_steps=0 --set min_lr_ratio=0 --set model.attn_num_heads=1"
    ).split(),
    "i24_lm_lr": (
        "--preset lm_corpus_1pass --shared shared --variants deltanet,efla --lrs 7.5e-4,3e-3 "
        "--seeds 2"
    ).split(),
    "i24_lm_length": (
        "--preset lm_corpus_1pass --shared shared --variants deltanet,gated_deltanet,transformer "
        "--seeds 3"
    ).split(),
    "i24_mod_arith_15k": (
        "--preset state_tracking_uniform --cells mod_arith --variants deltanet,deltanet_neg "
        "--lrs 1e-3 --seeds 6 --steps 15000"
    ).split(),
    "i24_parity_rawk": (
        "--preset state_tracking_uniform --cells parity --variants deltanet,deltanet_rawk --seeds 3"
    ).split(),
    "i33_mqar_zoology_attention": (
        "--preset mqar_512_zoology --variants transformer_zoology --widths 64,128,256 "
        "--lrs 4.6e-4,2.2e-3"
    ).split(),
    "i33_mqar_zoology_transformer": (
        "--preset mqar_512_zoology --variants transformer --widths 64,128 --lrs 4.6e-4,2.2e-3"
    ).split(),
    "i33_mqar_zoology_pair": (
        "--preset mqar_512_zoology --variants linear_zoology,deltanet --widths 64,128 --lrs 1e-3 "
        "--seeds 3"
    ).split(),
    # trained with --set compile='off' (runtime only: the run ids are the compiled runs')
    "i33_lm_transformer_eager": (
        "--preset lm_corpus_1pass --shared shared --variants transformer --seeds 3"
    ).split(),
    "i33_mqar_zoology_eager": (
        "--preset mqar_512_zoology --variants transformer_zoology,transformer_zoology_mlp "
        "--widths 128 --lrs 4.6e-4,2.2e-3"
    ).split(),
    "i33_mqar_zoology_long": (
        "--preset mqar_512_zoology --variants transformer_zoology --widths 128 --lrs 4.6e-4,2.2e-3 "
        "--steps 50048"
    ).split(),
}
NOTE = (
    "Trained on the device machine named in results/PLAN.md (bf16 autocast, Triton backend, "
    "many runs at once); table made in compare's report-only mode from the finished runs of the "
    "full preset grid (* marks a cell whose sweep is not finished)."
)


def merge_runs(src: Path, dst: Path) -> tuple[int, int]:
    """Union of two runs.jsonl files by run id (src wins); returns (runs before, after)."""

    def read(path: Path) -> list[dict]:
        lines = path.read_text().splitlines() if path.is_file() else []
        return [json.loads(line) for line in lines if line.strip()]

    old = read(dst)
    records = {r["id"]: r for r in old + read(src)}  # later (src) wins
    before = len(old)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    tmp.replace(dst)
    return before, len(records)


def folders() -> list[tuple[str, str]]:
    """(device folder, the grid it belongs to) for every folder a call may bring back."""
    return [(folder, MERGE_INTO.get(folder, folder)) for folder in (*GRIDS, *MERGE_INTO)]


def has_runs(path: Path) -> bool:
    return path.is_file() and bool(path.read_text().strip())


def prepare_carry(results: Path, unpacked: Path) -> None:
    """Give every device folder under ``unpacked`` all finished runs of its grid, so that on the
    next call to a fresh machine (its carry merged in) every command's --resume skips
    what any folder has finished (a side folder such as mad_b would otherwise retrain them).
    Run directories (checkpoints from resume.tgz) of runs finished since are deleted."""
    for folder, grid in folders():
        if has_runs(results / grid / "runs.jsonl"):
            merge_runs(results / grid / "runs.jsonl", unpacked / folder / "runs.jsonl")
        done = finished_run_dirs(unpacked / folder / "runs.jsonl")
        for name in done & {p.name for p in (unpacked / folder / "runs").glob("*")}:
            shutil.rmtree(unpacked / folder / "runs" / name)


def write_carry(unpacked: Path, carry: Path) -> None:
    """Rewrite ``carry`` as a copy of ``unpacked`` without its logs (the call's own, kept in
    results/; the carry stays small: runs.jsonl, tables and the small resume checkpoints).
    Rewritten, not updated: a run directory deleted here (finished since) must not travel."""
    shutil.rmtree(carry, ignore_errors=True)
    if not unpacked.is_dir():  # nothing committed or collected yet: an empty carry
        carry.mkdir(parents=True)
        return
    top = unpacked.resolve()
    shutil.copytree(
        unpacked, carry, ignore=lambda d, names: ["logs"] if Path(d).resolve() == top else []
    )


def restore_checkpoints(archive: Path, runs: Path) -> list[str]:
    """Unpack resume.tgz into ``runs``, each packed run directory replacing the one there (its
    older checkpoints would only take carry space); returns the restored run directories."""
    with tarfile.open(archive) as tar:
        # names are issue11/<folder>/runs/<run dir>/...: the first four parts name the run
        run_dirs = sorted({"/".join(Path(m.name).parts[:4]) for m in tar.getmembers()})
        for run_dir in run_dirs:
            shutil.rmtree(runs / run_dir, ignore_errors=True)
        tar.extractall(runs, filter="data")
    return run_dirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "archive", type=Path, nargs="?", help="issue11.tgz from a device call's $OUT"
    )
    parser.add_argument("--call", help="a name for the call's logs, e.g. s5c1")
    parser.add_argument("--results", type=Path, default=Path("results/issue11"))
    parser.add_argument("--no-report", action="store_true", help="skip --report-only tables")
    parser.add_argument(
        "--prepare-carry",
        action="store_true",
        help="only build runs/issue11 and runs/carry/issue11 from --results (no archive)",
    )
    args = parser.parse_args()
    unpacked, carry = Path("runs/issue11"), Path("runs/carry/issue11")
    if args.prepare_carry:
        prepare_carry(args.results, unpacked)
        write_carry(unpacked, carry)
        print(f"{unpacked}: every device folder holds its grid's finished runs")
        print(f'{carry}: its copy for the next call\'s carry ["runs/carry"]')
        return 0
    if args.archive is None or not args.archive.is_file():
        parser.error(f"archive: {args.archive} is not a file")
    if not args.call:
        parser.error("--call is required with an archive")
    # the logs are the call's own: clear the last call's (extracting adds, it never deletes)
    shutil.rmtree(unpacked / "logs", ignore_errors=True)
    with tarfile.open(args.archive) as tar:
        tar.extractall("runs", filter="data")  # the archive holds issue11/...
    resume = args.archive.with_name("resume.tgz")
    if resume.is_file():
        for run_dir in restore_checkpoints(resume, Path("runs")):
            print(f"checkpoint restored for the next fresh machine: runs/{run_dir}")
    for folder, grid in folders():
        src = unpacked / folder / "runs.jsonl"
        if has_runs(src):
            before, after = merge_runs(src, args.results / grid / "runs.jsonl")
            print(f"{folder} -> {grid}: {before} -> {after} finished runs")
    prepare_carry(args.results, unpacked)
    write_carry(unpacked, carry)
    print(f'{carry}: rewritten for the next call\'s carry ["runs/carry"]')
    logs = args.results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for log in sorted((unpacked / "logs").glob("*")):
        text = log.read_text(errors="replace")
        kept = [line for line in text.splitlines() if not line.startswith("tokenizing")]
        (logs / f"{args.call}_{log.name}").write_text("\n".join(kept) + "\n")
    if args.no_report:
        return 0
    for grid in GRIDS:
        if has_runs(args.results / grid / "runs.jsonl"):  # no table for a grid with no runs yet
            argv = ["compare", *REPORT_ARGS.get(grid, ["--preset", grid]), "--device", "cuda"]
            argv += ["--report-only", "--no-progress", "--note", NOTE]
            argv += ["--out", str(args.results / grid)]
            if deltaflow_cli(argv) != 0:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
