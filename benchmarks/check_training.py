"""GPU check of compiled training (issue 31, item 2): do compiled blocks give eager's gradients,
and the eager loss curve? Its passing is what flips ``CUDA_BLOCKS_VERIFIED`` (models/compile.py).

1. Gradients, per Triton rule, three entries: ``fp32`` (fp32 weights), ``autocast`` (bf16
   autocast over fp32 weights: the trainer's step) and ``bf16`` (bf16 weights). Each holds
   ``grad_err_compiled_vs_fp32`` and ``grad_err_eager_vs_fp32``: the worst over parameters of
   max|g - g_ref| / max|g_ref|, g_ref the fp32 eager gradients of the same model and batch;
   ``zero_grads_compiled``: parameters whose compiled gradient is all zero where eager's is not
   (torch 2.11's symptom: 12 of 13 for DeltaAttention, 28 of 38 for the 2-layer model, before
   deltaflow/compat.py); ``ok``: compiled within 1e-3 of eager in fp32, compiled error at most
   1.25x eager's in autocast and bf16 (issue 31's tolerances), and no zeroed gradient.
   Cases: ``model``, every rule: the trainer's model and call (2 layers, fused projections,
   ``compile_blocks`` with selective checkpointing); and issue 31's smallest failing cases,
   delta: ``layer`` (DeltaAttention alone under ``torch.compile(fullgraph=True)``),
   ``layer_unfused`` (fused projections off), ``model_unfused``, ``model_no_sac``.
   Softmax attention (``--rules softmax,hybrid``, in the default run): ``softmax`` is the lab's
   ``transformer`` variant (``attn_every=1``: RoPE, SDPA, SwiGLU), ``hybrid`` alternates delta
   and attention layers (``attn_every=2``); each runs ``model``, ``model_no_sac`` (selective
   checkpointing off) and ``model_no_graphs`` (CUDA graphs off), which isolate the factor.
2. Loss curves (``--lm-data DIR``, in ``_check_lm.py``): the 30M LM of
   configs/lm_gated_deltanet.yaml trained ``--lm-steps`` steps (bf16 autocast on CUDA), eager
   op by op and with compiled blocks (same seed and batches), compiled by the check itself
   (the trainer's call, the check's backend), the trainer told ``compile='off'`` in both.
   ``--lm-models transformer`` (default run): the lab's ``transformer`` by the recipe that
   failed, ``lm_corpus_1pass``'s own config (``--lm-seed``), eager (``compile='off'``),
   compiled by the trainer (``'blocks'``: selective checkpointing, CUDA graphs, cudagraph step
   marks), without CUDA graphs and without checkpointing, one unit a run; each compiled run's
   validation loss at the end is judged against eager's (``VAL_TOL``).
3. Packed documents (``packed:<case>``, ``_check_packed.py``): the Triton delta rule and the
   torch backend trained 40 steps on packed documents, ``compile='auto'`` (CUDA) vs ``'off'``.

Each unit (a rule's model entries, delta's smallest cases, the loss curves) runs in its own
process with ``--jobs N`` (the wall time is compiling: the op's kernels per rule and dtype and
inductor's graphs, CPU work); the report ``check_training_<device>.json`` is rewritten after
every unit and each unit's rows also land in ``<report>.parts/`` as they come, so a failure or
a timeout never loses the results before it. The exit status is 1 when an entry fails.

    python3 benchmarks/check_training.py --jobs 9 --out benchmarks/results \\
        --lm-data ../shared/corpus --lm-tokenizer ../shared/tokenizers/gpt2.tiktoken
    python3 benchmarks/check_training.py --rules delta --cases layer   # the smallest case
    python3 benchmarks/check_training.py --jobs 7 --rules softmax --lm-models transformer \\
        --lm-data shared/corpus --lm-tokenizer shared/tokenizers/gpt2.tiktoken  # the gaps only
    python3 benchmarks/check_training.py --smoke   # CPU interpreter, tiny shapes, temp report
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from _common import (
    device,
    device_name,
    git_commit,
    output_dir,
    smoke_corpus,
    smoke_env,
    smoke_requested,
)

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import _check_lm as lm_check  # noqa: E402
import _check_packed as packed_check  # noqa: E402
import torch  # noqa: E402

from deltaflow.layers import DeltaAttention, conv  # noqa: E402
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM  # noqa: E402
from deltaflow.models.compile import compile_blocks  # noqa: E402
from deltaflow.rules import triton_rules  # noqa: E402

MODES = ("fp32", "autocast", "bf16")
SMOKE_MODES = ("fp32", "autocast")  # the two torch 2.11 broke: seconds matter in CI
MODEL_CASES = ("model",)  # every rule
SMALLEST = ("layer", "layer_unfused", "model_unfused", "model_no_sac")  # delta only
# Models with softmax attention, checked like a rule: the lab's transformer and a hybrid.
ATTENTION = {"softmax": dict(attn_every=1), "hybrid": dict(attn_every=2)}
ATTENTION_CASES = ("model", "model_no_sac", "model_no_graphs")  # softmax / hybrid
CASES = MODEL_CASES + SMALLEST + ("model_no_graphs",)
SMOKE_CASES = ("model", "layer")
FP32_TOL = 1e-3  # compiled vs eager, fp32
HALF_RATIO = 1.25  # compiled error vs the fp32 reference, at most this times eager's
# Shapes: T % 64 != 0 (a partial last chunk); --smoke shrinks them to run in seconds on a CPU.
LAYER = dict(hidden_size=256, num_heads=4)
MODEL = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4)
BATCH = (2, 300)
SMOKE_LAYER = dict(hidden_size=32, num_heads=2)
SMOKE_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2)
SMOKE_BATCH = (1, 40)
DRAWS = 4  # draws of weights and batch per entry (smoke: 1)
DRAW_KEYS = (
    "loss_eager",
    "loss_compiled",
    "grad_err_compiled_vs_fp32",
    "grad_err_eager_vs_fp32",
    "grad_err_compiled_vs_eager",
    "grad_normerr_compiled_vs_fp32",
    "grad_normerr_eager_vs_fp32",
    "grad_l2mean_compiled_vs_fp32",
    "grad_l2mean_eager_vs_fp32",
    "zero_grads_compiled",
)


class Setup:
    """Shapes, device, dtypes and compile backend of one run (the GPU's or the smoke one's)."""

    def __init__(self, dev: torch.device, smoke: bool, compile_backend: str) -> None:
        self.dev = dev
        self.layer, self.model, self.batch = (
            (SMOKE_LAYER, SMOKE_MODEL, SMOKE_BATCH) if smoke else (LAYER, MODEL, BATCH)
        )
        # The interpreter computes bf16 dots wrongly: the smoke run's half precision is fp16.
        self.half = torch.float16 if smoke else torch.bfloat16
        self.compile_backend = compile_backend

    def context(self, mode: str) -> AbstractContextManager:
        if mode == "autocast":
            return torch.autocast(self.dev.type, dtype=self.half)
        return nullcontext()

    def dtype(self, mode: str) -> torch.dtype:
        return self.half if mode == "bf16" else torch.float32


def rel_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over parameters of max|a − b| / max|b| (b the reference)."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def norm_errors(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(worst, mean) over parameters of ‖a − b‖ / ‖b‖ (b the reference). The worst is
    reported; the mean is the half-precision entries' gate: no single element or parameter
    decides it (CPU draws, benchmarks/NOTES.md "longhorn's half-precision entries": compiled /
    eager of the mean stayed <= 1.19 in 1184 single draws, where the max-abs rel_error's ratio
    exceeded 1.25 in 8.5-14% of them, max 4.45)."""
    errors = [((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a, b)]
    return max(errors), sum(errors) / len(errors)


def build(case: str, rule: str, setup: Setup, draw: int = 0) -> tuple[torch.nn.Module, Callable]:
    """The fp32 module of ``case`` and its loss function ``(module, mode) -> loss``; ``draw``
    picks the weights (seed ``draw``) and the batch (seed ``1 + draw``)."""
    torch.manual_seed(draw)
    B, T = setup.batch
    g = torch.Generator().manual_seed(1 + draw)
    if case.startswith("layer"):
        module: torch.nn.Module = DeltaAttention(
            **setup.layer, rule=rule, use_decay=True, backend="triton"
        )
        x = torch.randn(B, T, setup.layer["hidden_size"], generator=g).to(setup.dev)

        def loss(m: torch.nn.Module, mode: str) -> torch.Tensor:
            return m(x.to(setup.dtype(mode)))[0].float().pow(2).mean()

    else:
        attn = ATTENTION.get(rule)
        if attn is not None and attn["attn_every"] == 1:  # every layer attention: no rule
            cfg = DeltaFlowConfig(**setup.model, **attn)
        else:
            rule_kw = dict(rule="delta" if attn else rule, use_decay=True, backend="triton")
            cfg = DeltaFlowConfig(**setup.model, **rule_kw, **(attn or {}))
        module = DeltaFlowForCausalLM(cfg)
        ids = torch.randint(0, setup.model["vocab_size"], (B, T), generator=g).to(setup.dev)

        def loss(m: torch.nn.Module, mode: str) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss

    return lm_check.set_fused(module, not case.endswith("_unfused")).to(setup.dev).train(), loss


def loss_and_grads(
    module: torch.nn.Module, loss: Callable, mode: str, setup: Setup
) -> tuple[float, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    with setup.context(mode):
        value = loss(module, mode)
    value.backward()
    return value.item(), [
        torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float().clone()
        for p in module.parameters()
    ]


def check_entry(case: str, rule: str, mode: str, setup: Setup, draws: int = 1) -> dict[str, Any]:
    """One entry: eager and compiled ``case`` in ``mode`` against the fp32 eager reference,
    over ``draws`` draws of weights and batch (one compile: each draw's weights are loaded into
    the same eager and compiled modules). In half precision the compiled and the eager step
    round at different points, so each draw's error ratio is a random variable (session 14:
    one draw put longhorn's bf16 entry at 1.93x): the tolerance judges the mean over draws."""
    base, loss = build(case, rule, setup)
    eager = copy.deepcopy(base).to(setup.dtype(mode))
    fast = copy.deepcopy(base).to(setup.dtype(mode))
    torch._dynamo.reset()  # each entry traces afresh: no graph of an earlier one is reused
    if case.startswith("layer"):
        fast = torch.compile(fast, fullgraph=True, backend=setup.compile_backend)
    else:
        sac = () if case == "model_no_sac" else ("mixer", "mlp")
        graphs = False if case == "model_no_graphs" else None  # None: the trainer's default
        compile_blocks(
            fast, selective_checkpointing=sac, backend=setup.compile_backend, cuda_graphs=graphs
        )
    per_draw: dict[str, list] = {k: [] for k in DRAW_KEYS}
    for draw in range(draws):
        if draw:
            base, loss = build(case, rule, setup, draw)
            for m in (eager, fast):  # in place, cast to each module's dtype: no recompile
                getattr(m, "_orig_mod", m).load_state_dict(base.state_dict())
        _, g_ref = loss_and_grads(base, loss, "fp32", setup)  # fp32 eager: the reference
        loss_e, g_e = loss_and_grads(eager, loss, mode, setup)
        loss_c, g_c = loss_and_grads(fast, loss, mode, setup)
        (worst_c, mean_c), (worst_e, mean_e) = norm_errors(g_c, g_ref), norm_errors(g_e, g_ref)
        errors = {
            "loss_eager": loss_e,
            "loss_compiled": loss_c,
            "grad_err_compiled_vs_fp32": rel_error(g_c, g_ref),
            "grad_err_eager_vs_fp32": rel_error(g_e, g_ref),
            "grad_err_compiled_vs_eager": rel_error(g_c, g_e),
            "grad_normerr_compiled_vs_fp32": worst_c,
            "grad_normerr_eager_vs_fp32": worst_e,
            "grad_l2mean_compiled_vs_fp32": mean_c,
            "grad_l2mean_eager_vs_fp32": mean_e,
            "zero_grads_compiled": sum(
                int(bool(c.eq(0).all()) and not bool(e.eq(0).all())) for c, e in zip(g_c, g_e)
            ),
        }
        for key, value in errors.items():
            per_draw[key].append(value)
    mean = {k: sum(v) / len(v) for k, v in per_draw.items()}
    entry: dict[str, Any] = {
        **{k: mean[k] for k in DRAW_KEYS if k.startswith(("loss", "grad_"))},
        # fp32: the worst draw (no rounding noise to average away)
        "grad_err_compiled_vs_eager": max(per_draw["grad_err_compiled_vs_eager"]),
        "zero_grads_compiled": max(per_draw["zero_grads_compiled"]),
        "params": len(list(base.parameters())),
        "draws": draws,
    }
    if draws > 1:
        entry["per_draw"] = {k: per_draw[k] for k in DRAW_KEYS if k.startswith("grad_")}
    entry["ok"] = entry_ok(entry, mode)
    return entry


def entry_ok(entry: dict[str, Any], mode: str) -> bool:
    """Issue 31's tolerances: fp32 compiled within FP32_TOL of eager (max-abs, every draw);
    autocast and bf16 compiled error against the fp32 reference at most HALF_RATIO times
    eager's (the mean over parameters of ‖Δ‖/‖ref‖, averaged over the draws: see
    norm_errors); no zeroed gradient in any draw."""
    if mode == "fp32":
        within = entry["grad_err_compiled_vs_eager"] <= FP32_TOL
    else:
        compiled, eager = entry["grad_l2mean_compiled_vs_fp32"], entry["grad_l2mean_eager_vs_fp32"]
        within = compiled <= HALF_RATIO * eager
    return bool(within and entry["zero_grads_compiled"] == 0)


# ------------------------------------------------------------------------ units and report


def plan_units(
    rules: list[str],
    cases: list[str],
    lm: bool,
    lm_models: tuple[str, ...] = ("gated_deltanet",),
    packed: tuple[str, ...] = (),
) -> list[str]:
    """The units of work, each one process with --jobs > 1: ``grads:<rule>:<case,...>`` (a
    rule's model entries; delta's smallest cases in two more units, the layer's and the
    model's: in one they would be the longest unit by far; softmax / hybrid: ATTENTION_CASES),
    ``lm`` (gated DeltaNet's curves), ``lm:<model>:<run>`` (one run of another of LM_MODELS)
    and ``packed:<case>``. Longest first."""
    units = []
    if "delta" in rules:
        for group in (SMALLEST[:2], SMALLEST[2:]):
            chosen = [c for c in group if c in cases]
            if chosen:
                units.append(f"grads:delta:{','.join(chosen)}")
    if lm:
        units += [unit for m in lm_models for unit in lm_check.lm_units(m)]
    attention = [c for c in cases if c in ATTENTION_CASES]
    units += [f"grads:{rule}:{','.join(attention)}" for rule in rules if rule in ATTENTION]
    model = [c for c in cases if c in MODEL_CASES]
    units += [
        f"grads:{rule}:{','.join(model)}" for rule in rules if model and rule not in ATTENTION
    ]
    return [u for u in units if not u.endswith(":")] + [f"packed:{case}" for case in packed]


def run_unit(unit: str, args: argparse.Namespace, setup: Setup, parts: Path) -> list[dict]:
    """Run one unit here; each row is appended to ``parts/<unit>.jsonl`` as it comes."""
    rows_file = _unit_file(parts, unit, ".jsonl")
    rows_file.unlink(missing_ok=True)
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    if unit.split(":")[0] in ("lm", "packed"):
        t0 = time.perf_counter()
        try:
            if unit.startswith("packed:"):
                row = packed_check.packed_row(unit, args, parts / "packed")
            else:
                row = lm_check.lm_row(unit, args, parts / "lm")
        except Exception:  # noqa: BLE001 - recorded; the other units still run
            traceback.print_exc()
            row = {"unit": unit, "ok": False, "error": traceback.format_exc(limit=-3)}
        add({**row, "seconds": round(time.perf_counter() - t0, 1)})
        return rows
    _, rule, cases = unit.split(":")
    for case in cases.split(","):
        for mode in args.modes:
            t0 = time.perf_counter()
            try:
                entry = check_entry(case, rule, mode, setup, args.draws)
            except Exception:  # noqa: BLE001 - recorded; the other entries still run
                traceback.print_exc()
                entry = {"ok": False, "error": traceback.format_exc(limit=-3)}
            row = {"case": case, "rule": rule, "mode": mode, **entry}
            add({**row, "seconds": round(time.perf_counter() - t0, 1)})
    return rows


def merge(report: dict[str, Any], unit: str, rows: list[dict], seconds: float) -> None:
    """Rows into the report: ``gradients[case][rule][mode]``, ``lm``, ``lm_<model>`` (its
    ``runs`` and verdict: merge_lm), ``packed_<case>``, ``units[unit]``."""
    for row in rows:
        if "unit" in row:
            lm_check.merge_lm(report, row)
            continue
        entry = {k: v for k, v in row.items() if k not in ("case", "rule", "mode")}
        report["gradients"].setdefault(row["case"], {}).setdefault(row["rule"], {})
        report["gradients"][row["case"]][row["rule"]][row["mode"]] = entry
    report["units"][unit] = {"seconds": round(seconds, 1), "rows": len(rows)}


def failures(report: dict[str, Any], units: list[str]) -> list[str]:
    failed = [
        f"{case}/{rule}/{mode}"
        for case, by_rule in report["gradients"].items()
        for rule, by_mode in by_rule.items()
        for mode, entry in by_mode.items()
        if not entry["ok"]
    ]
    if "lm" in report and not report["lm"]["ok"]:
        failed.append("loss curves")
    for key in sorted(k for k in report if k.startswith(("lm_", "packed_"))):
        if not report[key]["ok"]:
            failed.append(f"loss curves ({key[3:]})" if key[:3] == "lm_" else f"packed ({key[7:]})")
    for unit in units:  # a unit that died may have left some of its rows, not all
        if unit not in report["units"]:
            failed.append(f"{unit} (did not finish)")
        elif report["units"][unit].get("exit"):
            failed.append(f"{unit} (exit {report['units'][unit]['exit']})")
    return failed


def run_units(units: list[str], args: argparse.Namespace, report: dict, save: Callable) -> None:
    """Every unit: in this process (``--jobs 1``), or ``--jobs`` worker processes at once, each
    one unit (the script again with ``--unit``); the report is saved after every unit."""
    parts = Path(args.parts)
    parts.mkdir(parents=True, exist_ok=True)
    if args.jobs == 1:
        setup = Setup(torch.device(device(args.smoke)), args.smoke, args.compile_backend)
        for unit in units:
            t0 = time.perf_counter()
            merge(report, unit, run_unit(unit, args, setup, parts), time.perf_counter() - t0)
            print(f"unit {unit}: {report['units'][unit]['seconds']} s", flush=True)
            save()
        return
    env = dict(os.environ)
    # inductor compiles in a pool of cpu_count processes per process: share the cores instead
    threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    pending, running = list(units), {}
    # `timeout` stops the call with SIGTERM: end the workers, keep the report (saved per unit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        _poll(pending, running, args, parts, env, report, save)
    finally:
        for unit, (proc, t0, log) in running.items():  # stopped: what they had done counts
            proc.kill()
            log.close()
            merge(report, unit, _rows(parts, unit), time.perf_counter() - t0)
            report["units"][unit]["exit"] = "killed"
        if running:
            save()


def _unit_file(parts: Path, unit: str, suffix: str) -> Path:
    return parts / f"{re.sub('[^A-Za-z0-9]+', '_', unit)}{suffix}"


def _rows(parts: Path, unit: str) -> list[dict]:
    path = _unit_file(parts, unit, ".jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _poll(
    pending: list[str],
    running: dict[str, tuple],
    args: argparse.Namespace,
    parts: Path,
    env: dict[str, str],
    report: dict,
    save: Callable,
) -> None:
    """Start units while fewer than --jobs run; merge each one's rows as it ends."""
    while pending or running:
        while pending and len(running) < args.jobs:
            unit = pending.pop(0)
            cmd = [sys.executable, __file__, *args.forwarded, "--unit", unit]
            log = _unit_file(parts, unit, ".log").open("w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[unit] = (proc, time.perf_counter(), log)
        time.sleep(0.2)
        for unit, (proc, t0, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[unit]
            rows = _rows(parts, unit)
            merge(report, unit, rows, time.perf_counter() - t0)
            if proc.returncode != 0:  # it died: its log says why
                report["units"][unit]["exit"] = proc.returncode
            print(
                f"unit {unit}: exit {proc.returncode}, {len(rows)} rows in "
                f"{report['units'][unit]['seconds']} s",
                flush=True,
            )
            save()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rules",
        default=None,
        help="comma-separated Triton rules, softmax, hybrid (default: all; smoke: delta,softmax)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated of {MODES} (default: all; smoke: {','.join(SMOKE_MODES)})",
    )
    p.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated of {CASES} (default: all; smoke: "
        f"{','.join(SMOKE_CASES)}); {', '.join(SMALLEST)} run for delta only",
    )
    p.add_argument("--jobs", type=int, default=1, help="units at once, one process each")
    p.add_argument(
        "--draws",
        type=int,
        default=None,
        help=f"draws of weights and batch per entry, judged on their means (default {DRAWS}; "
        "smoke: 1)",
    )
    p.add_argument(
        "--triton-conv",
        choices=["on", "off"],
        default=None,
        help="the short conv on its Triton kernels (conv.TRITON_SHORT_CONV; default: as set there)",
    )
    p.add_argument(
        "--triton-conv-norm",
        choices=["on", "off"],
        default=None,
        help="conv + SiLU + q/k L2 norms as one Triton op (conv.TRITON_CONV_NORM; default: as "
        "set there)",
    )
    p.add_argument("--lm-data", default=None, help="corpus folder for the loss-curve check")
    p.add_argument("--lm-tokenizer", default=None, help="GPT-2 .tiktoken (default: bytes)")
    p.add_argument("--lm-steps", type=int, default=None, help="200, transformer: preset's; smoke 3")
    p.add_argument("--lm-seed", type=int, default=0, help="the transformer recipe's seed")
    p.add_argument("--packed", default=",".join(packed_check.PACKED), help="cases, or none")
    p.add_argument(
        "--lm-models",
        default=None,
        help=f"comma-separated loss-curve models of {tuple(lm_check.LM_MODELS)} (default: all)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor; smoke: eager, dynamo's graph run eagerly: "
        "torch 2.11's bug is in dynamo, and AOT tracing costs the smoke run minutes in CI)",
    )
    p.add_argument("--out", default=None, help="default benchmarks/results (smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, temp report")
    p.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # a worker's one unit
    p.add_argument("--parts", default=None, help=argparse.SUPPRESS)  # the workers' row files
    args = p.parse_args(argv)
    args.forwarded = list(sys.argv[1:] if argv is None else argv)
    known = [*triton_rules(), *ATTENTION]
    smoke_rules = ["delta", "softmax"]
    rules = args.rules.split(",") if args.rules else smoke_rules if args.smoke else known
    lm_models = args.lm_models.split(",") if args.lm_models else list(lm_check.LM_MODELS)
    packed = [] if args.packed == "none" else args.packed.split(",")
    modes = args.modes.split(",") if args.modes else SMOKE_MODES if args.smoke else MODES
    cases = args.cases.split(",") if args.cases else SMOKE_CASES if args.smoke else CASES
    for name, values, choices in (
        ("--rules", rules, known),
        ("--modes", modes, MODES),
        ("--cases", cases, CASES),
        ("--lm-models", lm_models, tuple(lm_check.LM_MODELS)),
        ("--packed", packed, tuple(packed_check.PACKED)),
    ):
        bad = [v for v in values if v not in choices]
        if bad:
            p.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(choices)}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.draws is None:
        args.draws = 1 if args.smoke else DRAWS
    if args.draws < 1:
        p.error(f"--draws must be >= 1, got {args.draws}")
    args.rules, args.modes, args.cases, args.lm_models = rules, modes, cases, tuple(lm_models)
    args.packed = tuple(packed)
    args.compile_backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    if args.lm_steps is None and args.smoke:
        args.lm_steps = 3  # else None: gated DeltaNet 200, the transformer its preset's
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.triton_conv is not None:  # workers get the flag too (args.forwarded)
        conv.TRITON_SHORT_CONV = args.triton_conv == "on"
    if args.triton_conv_norm is not None:
        conv.TRITON_CONV_NORM = args.triton_conv_norm == "on"
    dev = torch.device(device(args.smoke))
    out = Path(args.out) if args.unit else output_dir(args.out, args.smoke)
    name = re.sub("[^A-Za-z0-9]+", "_", device_name(dev.type)).strip("_")
    path = out / f"check_training_{name}.json"
    args.parts = args.parts or str(out / f"check_training_{name}.parts")
    if args.unit:  # a worker: the parent reads its rows from the parts folder
        args.forwarded += ["--parts", args.parts, "--out", str(out)]
        setup = Setup(dev, args.smoke, args.compile_backend)
        run_unit(args.unit, args, setup, Path(args.parts))
        return
    if args.smoke and args.lm_data is None:
        args.lm_data = str(smoke_corpus(out / "corpus"))
        args.forwarded += ["--lm-data", args.lm_data]
    args.forwarded += ["--parts", args.parts, "--out", str(out)]
    units = plan_units(args.rules, args.cases, bool(args.lm_data), args.lm_models, args.packed)
    report: dict[str, Any] = {
        "device": device_name(dev.type),
        "commit": git_commit(),
        "torch": torch.__version__,
        "compile_backend": args.compile_backend,
        "triton_short_conv": conv.TRITON_SHORT_CONV,
        "triton_conv_norm": conv.TRITON_CONV_NORM,
        "tolerances": {
            "fp32_compiled_vs_eager": FP32_TOL,
            "half_ratio": HALF_RATIO,
            "half_ratio_of": "mean over parameters of |g - g_ref| / |g_ref| (L2), averaged over "
            f"{args.draws} draw(s) of weights and batch",
            "lm_mean_abs_diff_last_50": lm_check.LM_TOL,
            "lm_transformer_val_loss": lm_check.VAL_TOL,
            "packed_max_abs_loss_diff": packed_check.PACKED_TOL,
        },
        "gradients": {},
        "units": {},
    }

    def save() -> None:  # after every unit: a later failure never loses the results before it
        report["failed"] = failures(report, units)
        report["ok"] = not report["failed"]
        path.write_text(json.dumps(report, indent=1) + "\n")

    print(
        f"torch {torch.__version__}, compile backend {args.compile_backend}, "
        f"{len(units)} units, {args.jobs} at once",
        flush=True,
    )
    t0 = time.perf_counter()
    save()
    run_units(units, args, report, save)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    for line in lm_check.summary(report) + packed_check.summary(report):
        print(line, flush=True)
    print(f"wrote {path} ({report['seconds']} s)")
    if report["failed"]:
        raise SystemExit(f"check_training: FAILED {', '.join(report['failed'])} (see {path})")
    print("check_training: done")


if __name__ == "__main__":
    main()
