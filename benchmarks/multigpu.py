"""Multi-GPU benchmark: one LM training run on 1 GPU, then on 2 GPUs with DDP and with FSDP2.

    python3 benchmarks/multigpu.py --corpus shared/corpus \\
        --tokenizer shared/tokenizers/gpt2.tiktoken --out benchmarks/results/multigpu

Every run is a fresh ``deltaflow train`` process (2-GPU runs through ``torchrun
--standalone``) of the ``lm_corpus`` preset's model: width 384, 6 layers, 6 heads, GPT-2 BPE,
seq 512, global batch 32, bf16. The runs, in order:

    1gpu     one GPU (CUDA_VISIBLE_DEVICES=0)
    ddp      2 GPUs, DistributedDataParallel
    fsdp     2 GPUs, FSDP2 (fully_shard per block; bf16 compute, fp32 gradient reduction)
    resume   FSDP2 on 2 GPUs: an uninterrupted run with a sharded checkpoint halfway, then a
             copy of its run directory cut back to that checkpoint (what a run killed after
             it leaves behind) resumed to the end; losses and final weights are compared

tokens/s is the global training throughput after the first ``--skip-steps`` steps (compile,
autotune and allocator warm-up), from the runs' own logs; peak memory is each rank's
``torch.cuda.max_memory_allocated``. Writes ``multigpu.md`` and ``multigpu.json`` under
``--out`` (rewritten after every run, so a cut-off benchmark keeps what it finished) and the
run directories under ``--out/runs``. Defaults take ~4-5 minutes on 2 H200s.

Context parallelism (issue 26; ``--runs cp``, or ``cp-speed`` and ``cp-search`` as two
commands): the 400M Gated DeltaNet of ``benchmarks/model_training.py`` on one B=1 row of T
tokens, 1 GPU vs the row split over ``--gpus`` GPUs: tokens/s and peak memory at T=32768 and
131072, the first step's loss and gradients against 1 GPU, and the largest T each trains (see
``benchmarks/context_parallel.py``; no corpus needed). On 2 H200s:

    python3 benchmarks/multigpu.py --runs cp --timeout 600 --out benchmarks/results/context_parallel

CPU smoke run (gloo, tiny model, a tiny byte-tokenized corpus it writes, the report in a
temporary folder; checks the plumbing, not the speed): the 1-GPU run and the FSDP2 resume check
(2 processes) by default, any ``--runs`` on request; the context-parallel one is
``benchmarks/context_parallel.py --smoke``.

    python3 benchmarks/multigpu.py --smoke [--runs 1gpu,ddp,fsdp,resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import context_parallel  # run as a script: benchmarks/ is on sys.path
from _common import git_commit, output_dir, smoke_corpus, smoke_requested

REPO = Path(__file__).resolve().parent.parent
TRAINING_RUNS = ("1gpu", "ddp", "fsdp", "resume")
# --smoke's defaults (flags still override): the docstring's CPU plumbing check, in seconds
SMOKE = dict(
    device="cpu",
    runs="1gpu,resume",
    hidden=32,
    layers=2,
    heads=2,
    seq_len=64,
    batch_size=4,
    steps=4,
    skip_steps=2,
    log_every=2,
    resume_steps=4,
)


# --------------------------------------------------------------------------------- commands
def train_command(
    args: argparse.Namespace, gpus: int, parallel: str, out: Path, steps: int
) -> list[str]:
    """``deltaflow train`` for this run, under torchrun when ``gpus`` > 1."""
    if gpus == 1:
        launcher = [sys.executable, "-m", "deltaflow.cli"]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={gpus}",
            "-m",
            "deltaflow.cli",
        ]
    return [
        *launcher,
        "train",
        "--task=lm",
        f"--data-dir={args.corpus}",
        *(["--tokenizer=bpe", f"--tokenizer-path={args.tokenizer}"] if args.tokenizer else []),
        f"--seq-len={args.seq_len}",
        f"--hidden-size={args.hidden}",
        f"--num-layers={args.layers}",
        f"--num-heads={args.heads}",
        f"--rule={args.rule}",
        f"--batch-size={args.batch_size}",
        f"--lr={args.lr}",
        f"--steps={steps}",
        f"--warmup-steps={min(10, steps)}",
        f"--device={args.device}",
        f"--precision={'bf16' if args.device == 'cuda' else 'fp32'}",
        f"--parallel={parallel}",
        "--no-progress",
        "--set=eval_kwargs={num_examples: 16, batch_size: 8}",
        f"--out={out}",
    ]


def run(command: list[str], *, gpus: int, timeout: int, log: Path) -> tuple[float, str | None]:
    """Run a training process; (wall seconds, None) or (seconds, error text)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if gpus == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # the 1-GPU baseline must not see the other GPU
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    try:
        with open(log, "w") as f:
            proc = subprocess.run(
                command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, f"timed out after {timeout} s (see {log})"
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        return seconds, f"exit status {proc.returncode}; end of {log}:\n{tail}"
    return seconds, None


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


# --------------------------------------------------------------------------------- the runs
def throughput_run(args: argparse.Namespace, name: str, gpus: int, parallel: str) -> dict[str, Any]:
    out = args.out / "runs" / name
    shutil.rmtree(out, ignore_errors=True)  # a timing run always starts from scratch
    command = train_command(args, gpus, parallel, out, args.steps) + [
        f"--log-every={args.log_every}",
        "--no-resume",
    ]
    seconds, error = run(command, gpus=gpus, timeout=args.timeout, log=args.out / f"{name}.log")
    result: dict[str, Any] = {
        "name": name,
        "gpus": gpus,
        "parallel": parallel if gpus > 1 else "-",
        "command": " ".join(command),
        "wall_s": round(seconds, 1),
    }
    if error is not None:
        return {**result, "error": error}
    records = train_records(out)
    timed = [r for r in records if r["step"] > args.skip_steps]
    if not timed:
        return {**result, "error": f"no log windows after --skip-steps={args.skip_steps}"}
    # Every window has the same number of tokens: the run's rate is the harmonic mean.
    tokens_per_s = len(timed) / sum(1.0 / r["tokens_per_s"] for r in timed)
    return {
        **result,
        "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_gpu": round(tokens_per_s / gpus),
        "timed_steps": timed[-1]["step"] - args.skip_steps,
        "peak_mem_gb": records[-1].get("peak_mem_gb"),
        "final_train_loss": records[-1]["loss"],
    }


def resume_check(args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    """FSDP2 run of ``--resume-steps`` with a sharded checkpoint halfway vs the same run
    resumed from that checkpoint (run directory cut back to it, as a kill would leave it)."""
    from safetensors.torch import load_file

    steps, half = args.resume_steps, args.resume_steps // 2
    straight, resumed = args.out / "runs" / "resume_straight", args.out / "runs" / "resume_cut"
    for path in (straight, resumed):
        shutil.rmtree(path, ignore_errors=True)
    extra = [f"--ckpt-every={half}", "--log-every=1"]
    command = train_command(args, gpus, "fsdp", straight, steps) + extra + ["--no-resume"]
    seconds, error = run(
        command, gpus=gpus, timeout=args.timeout, log=args.out / "resume_straight.log"
    )
    result: dict[str, Any] = {"steps": steps, "checkpoint_step": half, "wall_s": [seconds]}
    if error is not None:
        return {**result, "error": f"uninterrupted run: {error}"}
    # Cut the copy back to the halfway checkpoint.
    shutil.copytree(straight, resumed)
    ckpts = resumed / "checkpoints"
    kept = f"step_{half:07d}"
    for old in ckpts.iterdir():
        if old.name.startswith("step_") and old.name != kept:
            shutil.rmtree(old)
    (ckpts / "latest").write_text(kept + "\n")
    command = train_command(args, gpus, "fsdp", resumed, steps) + extra
    seconds, error = run(command, gpus=gpus, timeout=args.timeout, log=args.out / "resume_cut.log")
    result["wall_s"].append(seconds)
    result["command"] = " ".join(command)
    if error is not None:
        return {**result, "error": f"resumed run: {error}"}
    resume_event = [
        r
        for r in map(json.loads, (resumed / "log.jsonl").read_text().splitlines())
        if r.get("event") == "resume"
    ]
    a = {r["step"]: r["loss"] for r in train_records(straight)}
    b = {r["step"]: r["loss"] for r in train_records(resumed)}
    after = [s for s in sorted(a) if s > half]
    final = f"checkpoints/step_{steps:07d}/model.safetensors"
    wa, wb = load_file(straight / final), load_file(resumed / final)
    weight_diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    loss_diff = max(abs(a[s] - b.get(s, float("nan"))) for s in after)
    return {
        **result,
        "resumed_at": resume_event[0]["step"] if resume_event else None,
        "losses_straight": [a[s] for s in after],
        "losses_resumed": [b.get(s) for s in after],
        "max_loss_diff": loss_diff,
        "max_weight_diff": weight_diff,
        "identical": loss_diff == 0.0 and weight_diff == 0.0,
    }


# --------------------------------------------------------------------------------- report
def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        return f"{len([x for x in out if x.strip()])}x {out[0].strip()}"
    except (OSError, subprocess.CalledProcessError):
        return "cuda (nvidia-smi unavailable)"


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        "# Multi-GPU training: 1 GPU vs 2 GPUs (DDP, FSDP2)",
        "",
        f"{report['device']}, torch {report['torch']}, commit {report['commit']}. Model: width "
        f"{s['hidden']}, {s['layers']} layers, {s['heads']} heads, rule {s['rule']}; GPT-2 BPE, "
        f"seq {s['seq_len']}, global batch {s['batch_size']} "
        f"({s['seq_len'] * s['batch_size']} tokens/step), {s['steps']} steps, tokens/s over "
        f"steps {s['skip_steps'] + 1}-{s['steps']}.",
        "",
        "| run | GPUs | tokens/s | speedup vs 1 GPU | tokens/s per GPU | peak memory per GPU (GB) "
        "| final train loss | wall (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['gpus']} | failed: see below | | | | | |")
            continue
        mem = ", ".join(f"{m:.2f}" for m in r.get("peak_mem_gb") or []) or "-"
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(
            f"| {r['name']} | {r['gpus']} | {r['tokens_per_s']:,} | {speedup} | "
            f"{r['tokens_per_s_per_gpu']:,} | {mem} | {r['final_train_loss']:.4f} | {r['wall_s']} |"
        )
    check = report.get("resume_check")
    if check:
        lines += ["", "## Sharded checkpoint: save, resume, compare (FSDP2, 2 GPUs)", ""]
        if "error" in check:
            lines.append(f"Failed: {check['error']}")
        else:
            verdict = "identical" if check["identical"] else "not bit-identical"
            lines.append(
                f"{check['steps']} steps with a sharded checkpoint at step "
                f"{check['checkpoint_step']}; the run directory cut back to it resumed at step "
                f"{check['resumed_at']}. Losses after the checkpoint and final weights vs the "
                f"uninterrupted run: {verdict} (max |loss diff| {check['max_loss_diff']:.3g}, "
                f"max |weight diff| {check['max_weight_diff']:.3g})."
            )
    errors = [r for r in report["runs"] if "error" in r]
    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            lines += [f"{r['name']}:", "", "```", r["error"], "```", ""]
    lines += ["", "Commands:", "", "```"]
    lines += [r["command"] for r in report["runs"]]
    return "\n".join(lines + ["```", ""])


def write_report(report: dict[str, Any], out: Path) -> None:
    base = next((r for r in report["runs"] if r["gpus"] == 1 and "error" not in r), None)
    for r in report["runs"]:
        if base is not None and "error" not in r:
            r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    (out / "multigpu.json").write_text(json.dumps(report, indent=2))
    (out / "multigpu.md").write_text(markdown(report))


# --------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", type=Path, help="directory of .txt files (training runs)")
    p.add_argument("--tokenizer", type=Path, help="GPT-2 .tiktoken file (training runs)")
    p.add_argument("--out", type=Path, help="report and run directories (smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and corpus (see above)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of the multi-GPU runs")
    p.add_argument("--steps", type=int, default=150, help="steps of each timing run")
    p.add_argument("--skip-steps", type=int, default=30, help="warm-up steps not timed")
    p.add_argument("--log-every", type=int, default=10, help="timing window, in steps")
    p.add_argument("--resume-steps", type=int, default=40, help="steps of the resume check")
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--rule", default="delta")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument(
        "--runs",
        default="1gpu,ddp,fsdp,resume",
        help="comma-separated subset of 1gpu, ddp, fsdp, resume, cp (= cp-speed,cp-search)",
    )
    p.add_argument("--timeout", type=int, default=240, help="seconds per training process")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    context_parallel.add_benchmark_args(p)
    if smoke_requested(argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    if args.out is None and not args.smoke:
        p.error("--out is required")
    args.out = output_dir(args.out, args.smoke)
    if args.smoke and args.corpus is None:
        args.corpus = smoke_corpus(args.out / "corpus")  # byte tokenizer: no --tokenizer
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if "cp" in args.runs:
        args.runs[args.runs.index("cp") : args.runs.index("cp") + 1] = ["cp-speed", "cp-search"]
    unknown = sorted(set(args.runs) - set(TRAINING_RUNS) - {"cp-speed", "cp-search"})
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {', '.join(TRAINING_RUNS)}, cp")
    if set(args.runs) & set(TRAINING_RUNS):
        if args.corpus is None or not args.corpus.is_dir():
            p.error(f"--corpus {args.corpus} is not a directory (needed by the training runs)")
        if not args.smoke and (args.tokenizer is None or not args.tokenizer.is_file()):
            p.error(f"--tokenizer {args.tokenizer} is not a file (needed by the training runs)")
        args.corpus = args.corpus.resolve()
        args.tokenizer = args.tokenizer and args.tokenizer.resolve()
    for name in ("gpus", "steps", "log_every", "resume_steps", "batch_size", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gpus < 2:
        p.error(f"--gpus must be >= 2 (the 1-GPU run is always made), got {args.gpus}")
    if not 0 <= args.skip_steps < args.steps:
        p.error(f"--skip-steps must be in [0, --steps={args.steps}), got {args.skip_steps}")
    if args.resume_steps < 2:
        p.error(f"--resume-steps must be >= 2 (checkpoint halfway), got {args.resume_steps}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.gpus:
            p.error(f"--gpus={args.gpus} but {torch.cuda.device_count()} CUDA devices visible")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    args.out = args.out.resolve()
    setup = {
        k: getattr(args, k)
        for k in ("hidden", "layers", "heads", "rule", "seq_len", "batch_size", "lr", "steps")
    }
    setup.update(skip_steps=args.skip_steps, gpus=args.gpus)
    report: dict[str, Any] = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "setup": setup,
        "runs": [],
    }
    cp_parts = [r.removeprefix("cp-") for r in args.runs if r.startswith("cp-")]
    if cp_parts:
        cp_report = context_parallel.run_benchmark(args, cp_parts)
        if not set(args.runs) & set(TRAINING_RUNS):
            return cp_report
    start = time.perf_counter()
    plan = {"1gpu": (1, "ddp"), "ddp": (args.gpus, "ddp"), "fsdp": (args.gpus, "fsdp")}
    for name in [r for r in args.runs if r in plan]:
        report["runs"].append(throughput_run(args, name, *plan[name]))
        write_report(report, args.out)
        print(json.dumps({k: v for k, v in report["runs"][-1].items() if k != "command"}))
    if "resume" in args.runs:
        report["resume_check"] = resume_check(args, args.gpus)
        print(json.dumps(report["resume_check"]))
    report["total_s"] = round(time.perf_counter() - start, 1)
    write_report(report, args.out)
    print(f"\n{markdown(report)}\nwrote {args.out / 'multigpu.md'} ({report['total_s']} s)")
    failed = [r["name"] for r in report["runs"] if "error" in r]
    if "error" in (report.get("resume_check") or {}):  # not bit-identical is a result
        failed.append("resume")
    if failed:  # the report is written; the exit status says what failed
        raise SystemExit(f"multigpu: failed: {', '.join(failed)}")
    print("multigpu: done")
    return report


if __name__ == "__main__":
    main()
