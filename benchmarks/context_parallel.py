"""Context parallelism benchmark (issue 26): one long sequence on 1 GPU vs split over 2 GPUs.

The model is the 400M Gated DeltaNet of ``benchmarks/model_training.py`` (24 layers, hidden
1024, 8 heads x 128, vocab 32000, bf16 parameters, fused AdamW, the lean loss), trained on B=1
rows of random tokens. Run through ``benchmarks/multigpu.py --runs cp`` (which launches this
file as worker processes, ``torchrun`` for the 2-GPU ones), it measures:

- **speed** at each ``--cp-lengths`` T (default 32768 and 131072): tokens/s (median step after
  warm-up) and peak memory per GPU, 1 GPU vs CP=2 (DDP over the 2 ranks for the weight
  gradients), each in a fresh process; an out-of-memory is reported as such;
- **agreement** on the first step's batch: the CP=2 loss and weight gradients against the 1-GPU
  ones (the 1-GPU run saves its gradients; relative L2 error overall and the worst tensor);
- **search**: the largest T each setting trains (one full step) without running out of memory:
  T doubles from ``--cp-search-start`` until a step fails, then rises in eighths of the last
  T that fitted until one fails again. Each phase is one process, lengths in increasing order
  (a fresh process per length would fit a little more: the allocator's cache is emptied
  between lengths, not its fragmentation).

Results go to ``context_parallel.json`` / ``.md`` under ``--out``, merged with what earlier
invocations wrote (``--runs cp-speed`` and ``--runs cp-search`` can run as separate commands).

CPU smoke run of the orchestration (gloo, tiny model; what CI runs):

    python3 benchmarks/context_parallel.py --smoke [--out DIR]

Worker usage (what the orchestrator runs; ``--device cpu`` runs the same on gloo):

    python benchmarks/context_parallel.py measure --seq 32768 --out DIR [--save-grads F]
    torchrun --standalone --nproc_per_node=2 benchmarks/context_parallel.py measure \\
        --seq 32768 --out DIR --reference-grads F
    python benchmarks/context_parallel.py search --lengths 32768,65536 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import git_commit, output_dir, smoke_requested

REPO = Path(__file__).resolve().parent.parent
# NVLink multicast (NVLS) and symmetric-memory multicast stay off on the lent machines.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# --------------------------------------------------------------------------------- worker
def _out_of_memory(err: BaseException) -> bool:
    import torch

    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


class Worker:
    """One process of a run: the model, its optimizer, and training steps on this rank's
    segment of a B=1 row (all of it on 1 GPU)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from _models import build_deltaflow, shared_architecture

        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        if args.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        torch.manual_seed(0)
        model, _ = build_deltaflow(shared_architecture(args))
        self.n_params = sum(p.numel() for p in model.parameters())
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = model.to(device=self.device, dtype=dtype).train()
        if args.checkpointing:
            model.model.gradient_checkpointing = True
        self.raw = model
        if self.world > 1:
            from deltaflow.parallel import enable_context_parallel

            # every rank holds one segment; a group of its own (not DDP's communicator)
            enable_context_parallel(model)
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model = model
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.raw.parameters(), lr=1e-4, fused=fused)

    def bounds(self, T: int) -> list[int]:
        """The ranks' segments of a row of T tokens: equal, or rank 0 taking ``--rank0-share``
        of them (rank 0 runs the plain op, the others the op with Dk more value columns, so
        a larger rank-0 segment can balance the ranks' step times), in multiples of 64."""
        if self.world == 1:
            return [0, T]
        if self.args.rank0_share is None:
            if T % self.world:
                raise ValueError(f"T={T} must be a multiple of the {self.world} ranks")
            return [r * T // self.world for r in range(self.world + 1)]
        first = round(T * self.args.rank0_share / 64) * 64
        rest = T - first
        if not 0 < first < T or rest % (self.world - 1):
            raise ValueError(
                f"T={T} with --rank0-share {self.args.rank0_share}: rank 0 takes {first} "
                f"tokens, the other {self.world - 1} ranks cannot split {rest} equally"
            )
        step = rest // (self.world - 1)
        return [0] + [first + r * step for r in range(self.world)]

    def batch(self, T: int, seed: int = 0):
        """This rank's segment of one random row and its next-token targets (shifted over the
        whole row, so a segment's last position predicts the next segment's first token)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        row = torch.randint(0, self.args.vocab, (1, T + 1), generator=g)
        bounds = self.bounds(T)
        sl = slice(bounds[self.rank], bounds[self.rank + 1])
        self.share = (sl.stop - sl.start) / T  # this rank's fraction of the row's targets
        ids, targets = row[:, :T][:, sl], row[:, 1:][:, sl]
        return ids.to(self.device), targets.to(self.device)

    def _loss(self, ids, targets):
        """This rank's part of the row's mean loss, scaled for DDP: every target is scored,
        rank r holds ``share_r`` of them, and DDP averages gradients over the ranks, so
        ``world x share_r x (rank r's mean loss)`` has the row's mean loss as its average."""
        loss = self.model(input_ids=ids, labels=targets, labels_are_shifted=True).loss
        return loss * (self.world * self.share), loss.detach().float() * self.share

    def _row_loss(self, part) -> float:
        import torch.distributed as dist

        total = part.clone()
        if self.world > 1:
            dist.all_reduce(total)
        return float(total)

    def step(self, ids, targets) -> float:
        """Forward, backward, optimizer step; returns the whole row's mean loss."""
        scaled, part = self._loss(ids, targets)
        scaled.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._row_loss(part)

    def first_step_gradients(self, ids, targets) -> tuple[float, dict[str, Any]]:
        """The loss and the weight gradients (DDP-reduced: the whole row's) of one step,
        without updating the weights."""
        scaled, part = self._loss(ids, targets)
        scaled.backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in self.raw.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        return self._row_loss(part), grads

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory_gb(self) -> list[float]:
        """Each rank's peak allocated memory (GB), gathered to every rank."""
        import torch
        import torch.distributed as dist

        if self.device.type != "cuda":
            return []
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 1e9])
        peak = peak.to(self.device)
        if self.world > 1:
            every = [torch.empty_like(peak) for _ in range(self.world)]
            dist.all_gather(every, peak)
            peak = torch.cat(every)
        return [round(float(x), 2) for x in peak]

    def reset_memory(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def compare_gradients(grads: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Relative L2 error of every gradient tensor, overall and the worst one; cosine."""
    num = den = dot = norm_a = 0.0
    worst, worst_name = 0.0, None
    for name, ref in reference.items():
        g, ref = grads[name].double(), ref.double()
        diff = float((g - ref).norm() ** 2)
        size = float(ref.norm() ** 2)
        num, den = num + diff, den + size
        dot += float((g * ref).sum())
        norm_a += float(g.norm() ** 2)
        rel = (diff / max(size, 1e-30)) ** 0.5
        if rel > worst and size > 0:
            worst, worst_name = rel, name
    cosine = dot / max((norm_a * den) ** 0.5, 1e-30)
    return {
        "relative_l2_error": (num / max(den, 1e-30)) ** 0.5,
        "cosine": cosine,
        "worst_tensor": worst_name,
        "worst_tensor_relative_error": worst,
        "tensors": len(reference),
    }


def run_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Speed and memory at one T; the first step's loss and gradients (saved or compared)."""
    import torch

    result: dict[str, Any] = {"seq": args.seq, "gpus": int(os.environ.get("WORLD_SIZE", 1))}
    worker = None
    try:
        worker = Worker(args)
        result["parameters"] = worker.n_params
        ids, targets = worker.batch(args.seq)
        loss0, grads = worker.first_step_gradients(ids, targets)
        result["first_step_loss"] = loss0
        if args.reference_grads and worker.rank == 0 and Path(args.reference_grads).is_file():
            reference = torch.load(args.reference_grads, weights_only=True)
            result["gradients_vs_reference"] = compare_gradients(grads, reference["grads"])
            result["loss_vs_reference"] = {
                "reference": reference["loss"],
                "this": loss0,
                "abs_diff": abs(loss0 - reference["loss"]),
            }
        if args.save_grads and worker.rank == 0:
            torch.save({"loss": loss0, "grads": grads}, args.save_grads)
        del grads
        worker.reset_memory()
        for _ in range(args.warmup):
            worker.step(ids, targets)
        worker.synchronize()
        worker.reset_memory()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            loss = worker.step(ids, targets)  # the all-reduced loss syncs every rank
            worker.synchronize()
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        result.update(
            tokens_per_s=args.seq / median,
            step_s_median=median,
            step_s_all=times,
            peak_memory_gb=worker.peak_memory_gb(),
            last_loss=loss,
        )
    except Exception as err:  # noqa: BLE001 - an OOM is a result; anything else is re-raised
        if not _out_of_memory(err):
            raise
        result["error"] = "out of memory"
    finally:
        if worker is not None:
            worker.close()
    return result


def run_search(args: argparse.Namespace) -> None:
    """One training step per length, increasing; each success is appended to ``--out``'s
    ``search.jsonl`` at once (an OOM on one rank ends every rank: torchrun stops the group)."""
    worker = Worker(args)
    log = Path(args.out) / "search.jsonl"
    for T in args.lengths:
        worker.reset_memory()
        try:
            if (
                args.simulate_oom_above
                and T > args.simulate_oom_above
                and worker.rank == 1 % worker.world
            ):
                raise RuntimeError("CUDA out of memory (simulated by --simulate-oom-above)")
            ids, targets = worker.batch(T)
            start = time.perf_counter()
            worker.step(ids, targets)
            worker.synchronize()
            seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001
            if not _out_of_memory(err):
                raise
            record = {"seq": T, "fits": False}
            if worker.rank == 0:
                with open(log, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if worker.world > 1:
                os._exit(1)  # the other rank waits in a collective: torchrun ends the group
            break
        record = {
            "seq": T,
            "fits": True,
            "step_s": seconds,
            "peak_memory_gb": worker.peak_memory_gb(),
        }
        if worker.rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
        del ids, targets
    worker.close()


def worker_main(argv: list[str] | None = None) -> None:
    from _models import add_architecture_args

    p = argparse.ArgumentParser(description="context-parallel benchmark worker")
    p.add_argument("mode", choices=["measure", "search"])
    p.add_argument("--out", required=True, help="directory for result.json / search.jsonl")
    p.add_argument("--seq", type=int, default=32768, help="measure: tokens of the row")
    p.add_argument("--lengths", default="", help="search: comma-separated, increasing")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--save-grads", help="measure: save the first step's loss and gradients")
    p.add_argument("--reference-grads", help="measure: compare with these saved gradients")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--rank0-share", type=float, help="rank 0's part of each row (default: equal)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    # CPU checks of the search's failure path: the last rank fails lengths above this
    p.add_argument("--simulate-oom-above", type=int, default=0, help=argparse.SUPPRESS)
    add_architecture_args(p)
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    if args.mode == "measure":
        result = run_measure(args)
        if int(os.environ.get("RANK", 0)) == 0:
            (Path(args.out) / "result.json").write_text(json.dumps(result, indent=2))
            print(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}), flush=True)
    else:
        run_search(args)


# --------------------------------------------------------------------------------- orchestration
def launcher(gpus: int) -> list[str]:
    script = str(Path(__file__).resolve())
    if gpus == 1:
        return [sys.executable, script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        script,
    ]


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The model-shape and device flags every worker of this benchmark gets."""
    flags = [
        f"--layers={args.cp_layers}",
        f"--hidden={args.cp_hidden}",
        f"--heads={args.cp_heads}",
        f"--head-dim={args.cp_head_dim}",
        f"--vocab={args.cp_vocab}",
        f"--device={args.device}",
    ]
    if args.cp_rank0_share is not None:
        flags.append(f"--rank0-share={args.cp_rank0_share}")
    return flags + (["--checkpointing"] if args.cp_checkpointing else [])


def run_worker(command: list[str], gpus: int, log: Path, timeout: int) -> str | None:
    """Run one worker process (group); None, or the reason it failed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)
    if gpus == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # the 1-GPU baseline must not see the other GPU
    print("$ " + " ".join(command), flush=True)
    try:
        with open(log, "a") as f:
            proc = subprocess.run(
                command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s (see {log})"
    if proc.returncode != 0:
        return f"exit status {proc.returncode} (see {log})"
    return None


def speed(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """1 GPU then CP=2 at every T; the 1-GPU first-step gradients are the reference."""
    rows = []
    for T in args.cp_lengths:
        grads = out / "runs" / f"grads_{T}.pt"
        grads.unlink(missing_ok=True)
        for gpus in (1, args.gpus):
            run_dir = out / "runs" / f"{'1gpu' if gpus == 1 else f'cp{gpus}'}_{T}"
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "result.json").unlink(missing_ok=True)
            ref = ["--save-grads", str(grads)] if gpus == 1 else ["--reference-grads", str(grads)]
            steps = [f"--steps={args.cp_steps}", f"--warmup={args.cp_warmup}"]
            command = launcher(gpus) + ["measure", f"--seq={T}", f"--out={run_dir}"]
            command += steps + worker_flags(args) + ref
            error = run_worker(command, gpus, out / f"speed_{gpus}_{T}.log", args.timeout)
            result_file = run_dir / "result.json"
            row: dict[str, Any] = {"seq": T, "gpus": gpus, "command": " ".join(command)}
            if result_file.is_file():
                row.update(json.loads(result_file.read_text()))
            elif error is not None:
                row["error"] = error
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("command", "step_s_all")}))
        if not args.cp_keep_grads:
            grads.unlink(missing_ok=True)  # 1.6 GB per T
    return rows


def _search_phase(args, out: Path, gpus: int, lengths: list[int], tag: str) -> list[dict]:
    run_dir = out / "runs" / f"search_{'1gpu' if gpus == 1 else f'cp{gpus}'}_{tag}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "search.jsonl"
    log.unlink(missing_ok=True)
    command = launcher(gpus) + ["search", "--lengths=" + ",".join(map(str, lengths))]
    command += [f"--out={run_dir}"] + worker_flags(args)
    error = run_worker(command, gpus, out / f"search_{gpus}.log", args.timeout)
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    tried = {r["seq"] for r in records}
    if error is not None and len(tried) < len(lengths):
        # The process died at the first length it did not record: an OOM on some rank ends
        # the group (fits: False); a timeout says nothing about memory (fits: None).
        first_missing = next(T for T in lengths if T not in tried)
        fits = None if error.startswith("timed out") else False
        records.append({"seq": first_missing, "fits": fits, "note": error})
    return records


def search(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The largest T that trains, for 1 GPU and for CP=``--gpus``."""
    rows = []
    for gpus in (1, args.gpus):
        step = args.gpus  # lengths stay multiples of the ranks x 1024
        start = args.cp_search_start
        doubling = [start * 2**i for i in range(64) if start * 2**i <= args.cp_search_max]
        records = _search_phase(args, out, gpus, doubling, "doubling")
        fitted = [r["seq"] for r in records if r["fits"]]
        failed = [r["seq"] for r in records if r["fits"] is False]
        row: dict[str, Any] = {"gpus": gpus, "trials": list(records)}
        if not fitted:
            row["largest_seq"] = None
        elif not failed:
            unknown = [r for r in records if r["fits"] is None]
            note = unknown[0]["note"] if unknown else "every length up to --cp-search-max fits"
            row.update(largest_seq=max(fitted), note=note)
        else:
            good = max(fitted)
            unit = 1024 * step
            finer = sorted({((good + good * i // 8) // unit) * unit for i in range(1, 8)} - {good})
            finer = [T for T in finer if good < T < min(failed)]
            if finer:
                records = _search_phase(args, out, gpus, finer, "refine")
                row["trials"] += records
                fitted += [r["seq"] for r in records if r["fits"]]
            row.update(
                largest_seq=max(fitted),
                smallest_failed=min(r["seq"] for r in row["trials"] if r["fits"] is False),
            )
            if any(r["fits"] is None for r in records):
                row["note"] = "refinement cut short: " + records[-1].get("note", "")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        f"# Context parallelism: one sequence on 1 GPU vs split over {s['gpus']} GPUs",
        "",
        f"{report['device']}, torch {report['torch']}, commit {report['commit']}. Model: Gated "
        f"DeltaNet, {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads x "
        f"{s['head_dim']}, vocab {s['vocab']}, {s.get('dtype', 'bf16')} parameters, AdamW, B=1"
        + (", gradient checkpointing" if s["checkpointing"] else "")
        + (f", rank 0 holds {s['rank0_share']:.0%} of each row" if s.get("rank0_share") else "")
        + f"; median of {s['steps']} steps after {s['warmup']} warm-up steps.",
    ]
    if report.get("speed"):
        lines += [
            "",
            "| T | GPUs | tokens/s | speedup vs 1 GPU | peak memory per GPU (GB) | step (s) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        base = {r["seq"]: r for r in report["speed"] if r["gpus"] == 1 and "tokens_per_s" in r}
        for r in report["speed"]:
            if "tokens_per_s" not in r:
                lines.append(f"| {r['seq']:,} | {r['gpus']} | {r.get('error', 'failed')} | | | |")
                continue
            b = base.get(r["seq"])
            speedup = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
            mem = ", ".join(f"{m:.1f}" for m in r.get("peak_memory_gb") or []) or "-"
            lines.append(
                f"| {r['seq']:,} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {speedup} | {mem} "
                f"| {r['step_s_median']:.3f} |"
            )
        agree = [r for r in report["speed"] if "gradients_vs_reference" in r]
        if agree:
            lines += [
                "",
                f"Same batch, first step, CP vs 1 GPU ({s.get('dtype', 'bf16')}):",
                "",
                "| T | loss 1 GPU | loss CP | gradient rel. L2 error | cosine | worst tensor |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for r in agree:
                g, loss = r["gradients_vs_reference"], r["loss_vs_reference"]
                lines.append(
                    f"| {r['seq']:,} | {loss['reference']:.5f} | {loss['this']:.5f} | "
                    f"{g['relative_l2_error']:.2e} | {g['cosine']:.6f} | "
                    f"{g['worst_tensor']} ({g['worst_tensor_relative_error']:.2e}) |"
                )
    if report.get("search"):
        lines += [
            "",
            "Largest T that trains one step without running out of memory:",
            "",
            "| GPUs | largest T | first T that failed | peak memory at the largest (GB) | note |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in report["search"]:
            best = next(
                (t for t in r["trials"] if t["fits"] and t["seq"] == r.get("largest_seq")), {}
            )
            mem = ", ".join(f"{m:.1f}" for m in best.get("peak_memory_gb") or []) or "-"
            largest = f"{r['largest_seq']:,}" if r.get("largest_seq") else "none"
            failed = f"{r['smallest_failed']:,}" if r.get("smallest_failed") else "-"
            lines.append(f"| {r['gpus']} | {largest} | {failed} | {mem} | {r.get('note', '')} |")
        one = next((r for r in report["search"] if r["gpus"] == 1), {})
        cp = next((r for r in report["search"] if r["gpus"] > 1), {})
        if one.get("largest_seq") and cp.get("largest_seq"):
            bound = "" if cp.get("smallest_failed") else "at least "
            ratio = cp["largest_seq"] / one["largest_seq"]
            lines += ["", f"CP trains sequences {bound}{ratio:.2f}x longer than 1 GPU."]
    commands = [r["command"] for r in report.get("speed", []) if "command" in r]
    if commands:
        lines += ["", "Commands:", "", "```", *commands, "```"]
    return "\n".join(lines) + "\n"


def run_benchmark(args: argparse.Namespace, parts: list[str]) -> dict[str, Any]:
    """``parts`` from ('speed', 'search'); results merged into ``--out/context_parallel.json``."""
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "context_parallel.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    report.update(
        device=_device_name(args.device),
        torch=torch.__version__,
        commit=git_commit(),
        setup=dict(
            gpus=args.gpus,
            layers=args.cp_layers,
            hidden=args.cp_hidden,
            heads=args.cp_heads,
            head_dim=args.cp_head_dim,
            vocab=args.cp_vocab,
            steps=args.cp_steps,
            warmup=args.cp_warmup,
            checkpointing=args.cp_checkpointing,
            lengths=args.cp_lengths,
            rank0_share=args.cp_rank0_share,
            dtype="bf16" if args.device == "cuda" else "fp32",
        ),
    )

    def save() -> None:
        path.write_text(json.dumps(report, indent=2))
        (out / "context_parallel.md").write_text(markdown(report))

    start = time.perf_counter()
    if "speed" in parts:
        report["speed"] = speed(args, out)
        save()
    if "search" in parts:
        report["search"] = search(args, out)
        save()
    report["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(f"\n{markdown(report)}\nwrote {out / 'context_parallel.md'} ({report['seconds']} s)")
    return report


def _device_name(device: str) -> str:
    if device != "cuda":
        return "cpu (gloo)"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        names = [x.strip() for x in names if x.strip()]
        return f"{len(names)}x {names[0]}"
    return "cuda"


def add_benchmark_args(p: argparse.ArgumentParser) -> None:
    """The ``--cp-*`` flags of ``benchmarks/multigpu.py --runs cp``."""
    g = p.add_argument_group("context parallelism (--runs cp, cp-speed, cp-search)")
    g.add_argument(
        "--cp-lengths",
        default="32768,131072",
        type=lambda s: [int(x) for x in s.split(",")],
        help="sequence lengths of the speed runs",
    )
    g.add_argument("--cp-steps", type=int, default=5, help="timed steps per speed run")
    g.add_argument("--cp-warmup", type=int, default=2, help="untimed steps first")
    g.add_argument("--cp-search-start", type=int, default=32768)
    g.add_argument("--cp-search-max", type=int, default=2**21, help="longest T tried")
    g.add_argument("--cp-checkpointing", action="store_true", help="gradient checkpointing")
    g.add_argument("--cp-keep-grads", action="store_true", help="keep the reference gradients")
    g.add_argument(
        "--cp-rank0-share",
        type=float,
        help="rank 0's part of each row (default: 1 / --gpus); rank 0 runs the plain op, "
        "the others the op with Dk extra value columns, so more than 1/gpus can balance them",
    )
    # the model of benchmarks/model_training.py: Gated DeltaNet, ~400M with untied embeddings
    g.add_argument("--cp-layers", type=int, default=24)
    g.add_argument("--cp-hidden", type=int, default=1024)
    g.add_argument("--cp-heads", type=int, default=8)
    g.add_argument("--cp-head-dim", type=int, default=128)
    g.add_argument("--cp-vocab", type=int, default=32000)


# --smoke: the orchestration end to end on the CPU (gloo): 1 process vs 2, one tiny length,
# then the search from it (what `multigpu.py --runs cp` runs on the GPUs, in seconds)
SMOKE = dict(
    cp_layers=2,
    cp_hidden=32,
    cp_heads=2,
    cp_head_dim=16,
    cp_vocab=256,
    cp_lengths=[64],
    cp_steps=1,
    cp_warmup=1,
    cp_search_start=64,
    cp_search_max=128,
)


def smoke_main() -> None:
    p = argparse.ArgumentParser(description="context-parallel benchmark, CPU smoke run")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None, help="report folder (default: a temp dir)")
    add_benchmark_args(p)
    p.set_defaults(**SMOKE)
    args = p.parse_args()
    args.out = output_dir(args.out, smoke=True)
    args.gpus, args.device, args.timeout = 2, "cpu", 300
    report = run_benchmark(args, ["speed", "search"])
    failed = [f"speed T={r['seq']} on {r['gpus']}" for r in report["speed"] if "error" in r]
    failed += [f"search on {r['gpus']}" for r in report["search"] if not r.get("largest_seq")]
    if failed:
        raise SystemExit(f"context_parallel: failed: {', '.join(failed)}")
    print("context_parallel: done")


if __name__ == "__main__":
    smoke_main() if smoke_requested() else worker_main()
