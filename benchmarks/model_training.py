"""Model training benchmark: DeltaFlowForCausalLM vs fla's GatedDeltaNetForCausalLM.

Same run, same GPU, same shapes: bf16 parameters, fused AdamW, random token ids. Measures
training tokens/s (median over timed steps, after warm-up), peak memory, parameter counts, and
a profile of one training step (forward time per module kind, top-N ops/kernels by self device
time). Default size: Gated DeltaNet with 24 layers, hidden 1024, 8 heads x 128, vocab 32000,
B=8, T=2048 (~390M parameters with untied embeddings). A run fits in ~5 minutes on an H100.

    # fla is optional; install the carried wheels first to compare against it:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/model_training.py --out benchmarks/results

    # CPU smoke run (no GPU, no fla; tiny model, report in a temporary folder or --out):
    python3 benchmarks/model_training.py --smoke [--llama]

    # deltaflow's switches and launch settings under trial, set before the runs (_settings.py):
    python3 benchmarks/model_training.py --compile blocks --trainer --skip-fla \\
        --set conv_norm_triton.BWD_TILES=8,triton_backend.SAVE_FOR_BACKWARD=states

Writes ``model_training_<device>.md`` and ``.json`` (device, shapes, dtype, commit, both
models' numbers and their ratio) and ``model_training_<device>_profile.txt`` under ``--out``.
fla's gated backward is refused on Hopper with Triton < 3.7.1 (fla issue #640); as in
benchmarks/kernels.py its guard is forced for timing only.

Read top to bottom: the flags, the timing of one run, the runs, the report. The models are
built in _models.py, the profile of a step taken in _step_profile.py.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _settings
from _common import git_commit, output_dir, smoke_env, smoke_requested
from _step_profile import profile_step

# Before torch/triton are imported; run as a script only: an importer (the tests) decides for
# itself.
if smoke_requested() and __name__ == "__main__":
    smoke_env()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from _models import (  # noqa: E402
    DTYPES,
    add_architecture_args,
    build_deltaflow,
    build_fla,
    build_llama,
    count_parameters,
    shared_architecture,
)

from deltaflow.models import compile as compile_mod  # noqa: E402

# --smoke's defaults: the CPU plumbing check CI runs (tests/test_gpu_scripts.py), in seconds
SMOKE = dict(
    device="cpu",
    layers=2,
    hidden=64,
    heads=2,
    head_dim=32,
    vocab=256,
    seq=64,
    batch=2,
    steps=2,
    warmup=1,
    top=5,
    skip_fla=True,
)


# ---------------------------------------------------------------------------------- flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``--set`` items parsed and applied (a bad one exits with one line)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    add_architecture_args(p)
    p.add_argument("--top", type=int, default=25, help="rows of the profile table (0 = none)")
    p.add_argument("--skip-fla", action="store_true")
    p.add_argument(
        "--llama", action="store_true", help="also a Llama-style SDPA Transformer of the same size"
    )
    p.add_argument(
        "--compile",
        choices=["off", "blocks", "both"],
        default="off",
        help="torch.compile each block of deltaflow (and the Llama): off, blocks, or both "
        "(time each model eager and compiled)",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="torch._functorch.config.activation_memory_budget for compiled runs (1.0 = default)",
    )
    p.add_argument("--no-fused", action="store_true", help="deltaflow without fused projections")
    p.add_argument(
        "--checkpoint",
        default="mixer,mlp",
        help="parts of each compiled deltaflow block under selective checkpointing "
        "(comma-separated, from deltaflow.models.block.SELECTIVE_PARTS: mixer, mlp, "
        "mixer_inputs = also keep the delta-rule op's q, k, v, beta, log decay; '' = none)",
    )
    p.add_argument(
        "--triton-conv",
        choices=["off", "on", "both"],
        default=None,
        help="deltaflow's short conv on the Triton kernels (conv.TRITON_SHORT_CONV), or both; "
        "default: the switch as it is (off unless --set conv.TRITON_SHORT_CONV=1)",
    )
    p.add_argument(
        "--triton-conv-norm",
        choices=["off", "on", "both"],
        default=None,
        help="deltaflow's conv + SiLU + q/k L2 norms as one Triton op (conv.TRITON_CONV_NORM), "
        "or both; default: the switch as it is (off unless --set conv.TRITON_CONV_NORM=1)",
    )
    _settings.add_settings_arg(p)
    p.add_argument("--skip-deltaflow", action="store_true")
    p.add_argument(
        "--trainer",
        action="store_true",
        help="also time the trainer's own step (Trainer.train_step: fp32 master weights, bf16 "
        "autocast on CUDA, its loss, clipping, fused AdamW), compiled as --compile says",
    )
    p.add_argument(
        "--fla-linear-ce", action="store_true", help="fla with fuse_linear_cross_entropy=True"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="parameter dtype: bf16 (default on GPU), fp32 (default on CPU: bf16 matmuls are slow)",
    )
    p.add_argument("--out", default=None, help="default benchmarks/results (smoke: a temp dir)")
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model, no fla (flags above still apply)"
    )
    if smoke_requested(argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    try:
        args.settings = _settings.parse(args.set)
    except _settings.SettingError as e:  # one line, not argparse's usage block above it
        p.exit(2, f"{p.prog}: error: --set {e}\n")
    _settings.apply(args.settings)
    # the conv switches' runs start from the modules' values: a --set of either is then not
    # undone by build_deltaflow's default
    from deltaflow.layers import conv

    for flag, on in (
        ("triton_conv", conv.TRITON_SHORT_CONV),
        ("triton_conv_norm", conv.TRITON_CONV_NORM),
    ):
        if getattr(args, flag) is None:
            setattr(args, flag, "on" if on else "off")
    return args


# --------------------------------------------------------------------------------- timing


class Timer:
    """Wall time of a step: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def make_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor
) -> Callable[[], None]:
    def step() -> None:
        # a new step for cudagraph trees (compile.CUDA_GRAPHS); a no-op without CUDA graphs
        torch.compiler.cudagraph_mark_step_begin()
        with torch.profiler.record_function("step/forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.record_function("step/backward"):
            loss.backward()
        with torch.profiler.record_function("step/optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------ one model


def benchmark(
    name: str,
    build: Callable[[], tuple[nn.Module, dict[str, Any]]],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """The benchmark's own step: ``args.dtype`` weights, fused AdamW, the model's loss."""
    torch.manual_seed(0)
    model, config = build()
    n_params = count_parameters(model)
    model = model.to(device=device, dtype=DTYPES[args.dtype]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    print(f"[{name}] {n_params / 1e6:.1f}M parameters; config:\n{json.dumps(config, default=str)}")
    return measure(name, model, make_step(model, optimizer, ids), n_params, config, args, device)


class RandomTokens:
    """The trainer's task for timing: random token ids, every position scored (a function of
    the step, as the trainer expects of a task)."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0) -> dict:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=g)
        return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def benchmark_trainer(
    name: str,
    build: Callable[[], tuple[nn.Module, dict[str, Any]]],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """What ``deltaflow train`` runs: ``Trainer.train_step`` with its defaults (fp32 master
    weights under bf16 autocast on CUDA, the model's chunked loss without the [B, T, V] logits
    since issue 31, gradient clipping, fused AdamW). ``build`` compiles the blocks or not; the
    trainer is told ``compile='off'`` so that it times the model it is given (compiled: what
    ``compile='auto'`` gives on CUDA)."""
    from deltaflow.train import TrainConfig, Trainer

    torch.manual_seed(0)
    model, config = build()
    n_params = count_parameters(model)
    cfg = TrainConfig(
        task="random tokens",
        steps=1_000_000,  # the learning-rate schedule of a long run: no step is its last
        batch_size=args.batch,
        lr=1e-4,
        device=str(device),
        compile="off",
        progress=False,
    )
    trainer = Trainer(cfg, model=model, task=RandomTokens(args.vocab, args.seq))
    config = {
        **config,
        "trainer": {
            "precision": str(trainer.autocast_dtype or "fp32"),
            "grad_accum": trainer.config.grad_accum,
        },
    }
    print(
        f"[{name}] {n_params / 1e6:.1f}M parameters, fp32 weights, autocast "
        f"{trainer.autocast_dtype}, grad_accum {trainer.config.grad_accum}"
    )
    steps = iter(range(1_000_000))
    result = measure(
        name,
        trainer.raw_model,
        lambda: trainer.train_step(next(steps)),
        n_params,
        config,
        args,
        device,
    )
    trainer.close()
    return result


def measure(
    name: str,
    model: nn.Module,
    step: Callable[[], Any],
    n_params: int,
    config: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Warm-up steps (compiles, autotunes), then timed steps: median, peak memory, a profile."""
    timer = Timer(device)
    t0 = time.perf_counter()
    for i in range(args.warmup):  # compiles / autotunes the kernels on the first step
        seconds = timer(step)
        print(f"[{name}] warm-up step {i}: {seconds * 1e3:.1f} ms")
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timer(step) for _ in range(args.steps)]
    peak = reserved = None
    metric = "allocated"
    if device.type == "cuda":
        # Replaying a CUDA graph allocates nothing: the activations of compiled blocks under
        # compile.CUDA_GRAPHS live in the graphs' private pools, which the allocated peak of the
        # timed steps never sees (session 17 read 4.3 GB for a 15 GB step). The pools are
        # reserved memory, so such a run's peak is the reserved one: an upper bound (it also
        # holds the caching allocator's free blocks), the memory the process keeps from others.
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        graphs = name.startswith("deltaflow") and "compiled" in name and compile_mod.CUDA_GRAPHS
        peak, metric = (reserved, "reserved") if graphs else (allocated, "allocated")
    median = statistics.median(times)
    tokens = args.batch * args.seq
    result = {
        "name": name,
        "parameters": n_params,
        "tokens_per_s": tokens / median,
        "step_ms_median": median * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "peak_memory_gb": None if peak is None else peak / 1e9,
        "peak_metric": metric,
        "peak_reserved_gb": None if reserved is None else reserved / 1e9,
        # 6·N·tokens per step over H100 dense bf16 peak (989 TFLOP/s); attention FLOPs ignored
        "mfu": 6 * n_params * tokens / median / 989e12,
        "warmup_s": warmup_s,
        "config": config,
    }
    print(
        f"[{name}] {result['tokens_per_s'] / 1e3:.1f}k tokens/s, step {median * 1e3:.1f} ms"
        + ("" if peak is None else f", peak {peak / 1e9:.2f} GB")
    )
    if args.top > 0:
        result["profile"] = profile_step(step, model, device, args.top)
        print(f"[{name}] profile of one step (top {args.top} by self time):")
        print(result["profile"]["table"])
    return result


# ----------------------------------------------------------------------------------- runs


# a run: its name, benchmark or benchmark_trainer, and the build of its model
Run = tuple[str, Callable[..., dict[str, Any]], Callable[[], tuple[nn.Module, dict[str, Any]]]]


def plan_runs(args: argparse.Namespace, arch: dict[str, Any]) -> list[Run]:
    """The runs the flags ask for, in order: per compile setting, deltaflow's conv variants (the
    trainer's step first), then the Llama; fla last."""
    compiled = {"off": [False], "blocks": [True], "both": [False, True]}[args.compile]
    # smoke runs trace the compiled blocks with aot_eager (inductor's C++ codegen takes minutes)
    backend = "aot_eager" if args.smoke else "inductor"
    runs: list[Run] = []
    switch = {"off": [False], "on": [True], "both": [False, True]}
    convs = [
        (t, n) for t in switch[args.triton_conv] for n in switch[args.triton_conv_norm]
    ]  # fmt: skip
    for c in compiled:
        suffix = " (compiled)" if c else ""
        for t, n in convs:
            on = (("compiled", c), ("triton conv", t), ("triton conv norm", n))
            tags = [tag for tag, flag in on if flag]
            tag = f" ({', '.join(tags)})" if tags else ""
            build = functools.partial(
                build_deltaflow,
                arch,
                c,
                args.no_fused,
                args.checkpoint,
                backend,
                triton_conv=t,
                triton_conv_norm=n,
            )
            if args.trainer:
                runs.append((f"deltaflow trainer{tag}", benchmark_trainer, build))
            if not args.skip_deltaflow:
                runs.append((f"deltaflow{tag}", benchmark, build))
        if args.llama:
            runs.append((f"llama-sdpa{suffix}", benchmark, lambda c=c: build_llama(arch, c)))
    if args.skip_fla:
        print("fla skipped (--skip-fla)")
    else:
        runs.append(("fla", benchmark, lambda: build_fla(arch, args.fla_linear_ce)))
    return runs


# --------------------------------------------------------------------------------- report


TRAINER_NOTE = (
    " The trainer rows: Trainer.train_step, fp32 weights under bf16 autocast on CUDA, the "
    "model's chunked loss (no [B, T, V] logits), gradient clipping."
)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Model training: {report['device']}",
        "",
        f"commit {report['commit']}, torch {report['torch']}, {report['dtype']} params, "
        f"fused AdamW, B={report['batch']}, T={report['seq']}, "
        f"{report['architecture']['num_layers']} layers, hidden "
        f"{report['architecture']['hidden_size']}, {report['architecture']['num_heads']} heads "
        f"x {report['architecture']['head_dim']} (expand_v {report['architecture']['expand_v']}),"
        f" vocab {report['architecture']['vocab_size']}; median of {report['steps']} steps; "
        f"our LM loss: {report.get('lm_loss', 'torch (chunked)')}."
        + "".join(f" {k} = {v!r}." for k, v in report.get("settings", {}).items())
        + TRAINER_NOTE * any(name.startswith("deltaflow trainer") for name in report["results"]),
        "",
        "| model | params | tokens/s | MFU | step ms | peak GB | warm-up s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"].values():
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:80]} | | | | | |")
            continue
        peak = "n/a" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}"
        if r.get("peak_metric") == "reserved":
            peak += " (reserved: CUDA graphs)"
        lines.append(
            f"| {r['name']} | {r['parameters'] / 1e6:.1f}M | {r['tokens_per_s'] / 1e3:.1f}k | "
            f"{r.get('mfu', 0) * 100:.1f}% | {r['step_ms_median']:.1f} | {peak} | "
            f"{r['warmup_s']:.0f} |"
        )
    if report.get("ratio"):
        ratio = report["ratio"]
        mem = "n/a" if ratio["peak_memory"] is None else f"{ratio['peak_memory']:.2f}x"
        lines += ["", f"deltaflow / fla: tokens/s {ratio['tokens_per_s']:.2f}x, memory {mem}."]
    if report.get("ratio_trainer"):
        ratio = report["ratio_trainer"]
        mem = "n/a" if ratio["peak_memory"] is None else f"{ratio['peak_memory']:.2f}x"
        lines += [
            "",
            f"deltaflow trainer / fla: tokens/s {ratio['tokens_per_s']:.2f}x, memory {mem}.",
        ]
    for r in report["results"].values():
        prof = r.get("profile")
        if not prof:
            continue
        lines += [
            "",
            f"## {r['name']}: one step",
            "",
            "| range | ms | calls |",
            "| --- | --- | --- |",
        ]
        for key, v in sorted(prof["ranges"].items()):
            lines.append(f"| {key} | {v['ms']:.2f} | {v['calls']} |")
        lines += ["", "| op / kernel (self time) | ms | calls |", "| --- | --- | --- |"]
        for k in prof["top"]:
            lines.append(f"| `{k['name'][:90]}` | {k['self_ms']:.2f} | {k['calls']} |")
    return "\n".join(lines) + "\n"


def versus(ours: dict[str, Any], fla: dict[str, Any]) -> dict[str, Any] | None:
    """tokens/s and peak memory of one of our runs over fla's (None where either is missing)."""
    if "tokens_per_s" not in ours or "tokens_per_s" not in fla:
        return None
    memory = None
    if ours["peak_memory_gb"] is not None:
        memory = ours["peak_memory_gb"] / fla["peak_memory_gb"]
    return {"tokens_per_s": ours["tokens_per_s"] / fla["tokens_per_s"], "peak_memory": memory}


def lm_loss_backend(device: torch.device) -> str:
    """Which linear + cross-entropy our models' loss ran on (deltaflow.models.loss)."""
    from deltaflow.models import loss

    uses_liger = loss.FUSED_CE_BACKEND != "torch" and device.type in loss._LIGER_DEVICES
    return "liger" if uses_liger and loss._liger_loss() is not None else "torch (chunked)"


def write_report(report: dict[str, Any], args: argparse.Namespace, device_name: str) -> None:
    """``model_training_<device>_B<b>_T<t>``: .md, .json, and _profile.txt (the full tables)."""
    results = report["results"]
    out = output_dir(args.out, args.smoke)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name) + f"_B{args.batch}_T{args.seq}"
    stem = out / f"model_training_{tag}"
    tables = "\n\n".join(
        f"== {r['name']} ==\n{r['profile']['table']}" for r in results.values() if r.get("profile")
    )
    Path(f"{stem}_profile.txt").write_text(tables + "\n")
    for r in results.values():  # the full tables live in the .txt file, not the JSON
        if r.get("profile"):
            r["profile"].pop("table")
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    md = markdown(report)
    Path(f"{stem}.md").write_text(md)
    print("\n" + md)
    print(f"wrote {stem}.md, {stem}.json, {stem}_profile.txt")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The flags, the runs, the report (written under --out and returned)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)  # CUDA events time the current device's stream
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    arch = shared_architecture(args)
    print(
        f"{device_name}: B={args.batch} T={args.seq} {args.dtype}, architecture {json.dumps(arch)}"
    )
    if args.settings:
        print(f"settings: {json.dumps(args.settings)}")
    if args.memory_budget is not None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = args.memory_budget

    results: dict[str, Any] = {}
    for name, bench, build in plan_runs(args, arch):
        try:
            results[name] = bench(name, build, args, device)
        except Exception as e:  # noqa: BLE001 - report and go on with the other model
            if name.startswith("deltaflow") and not isinstance(e, torch.cuda.OutOfMemoryError):
                raise  # our own model must work; fla may be missing or refuse this GPU
            print(f"[{name}] failed: {e!r}")
            results[name] = {"name": name, "error": repr(e)}
        gc.collect()  # the model, its optimizer and its step are gone: their memory too
        # cudagraph trees keep the last model's graphs and pools alive: dropped here, so that
        # the next run's reserved memory is its own
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    fla = results.get("fla", {})

    def fastest(prefix: str) -> dict[str, Any]:  # the variant with the most tokens/s
        runs = [
            r
            for n, r in results.items()
            if (n == prefix or n.startswith(f"{prefix} (")) and "tokens_per_s" in r
        ]
        return max(runs, key=lambda r: r["tokens_per_s"], default={})

    report = {
        "device": device_name,
        "commit": git_commit(),
        "torch": torch.__version__,
        "dtype": str(DTYPES[args.dtype]).removeprefix("torch."),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "architecture": arch,
        "settings": args.settings,  # --set's items (until session 16: "conv_launch")
        "checkpoint": args.checkpoint,
        "lm_loss": lm_loss_backend(device),
        "fla_loss": "fuse_linear_cross_entropy" if args.fla_linear_ce else "fuse_cross_entropy",
        "results": results,
        "ratio": versus(fastest("deltaflow"), fla),
        "ratio_trainer": versus(fastest("deltaflow trainer"), fla),
    }
    write_report(report, args, device_name)
    return report


if __name__ == "__main__":
    main()
