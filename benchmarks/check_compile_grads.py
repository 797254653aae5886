"""GPU check of issue 31: do compiled DeltaAttention blocks give eager's gradients?

For every rule of the Triton table (Triton backend, fused projections: the GPU training path),
DeltaAttention alone (``torch.compile(fullgraph=True)``) and a 2-layer model (``compile_blocks``,
selective checkpointing) are run eager and compiled in three settings: ``fp32`` (fp32 weights
and activations), ``autocast`` (bf16 autocast over fp32 weights: the trainer's step) and
``bf16`` (bf16 weights). One row per (part, rule, mode) with the relative gradient errors
(max over parameters of max|a - b| / max|b|) against eager in that setting and against an fp32
eager reference, and the number of parameters whose compiled gradient is all zero (the
symptom: 12 of 13 on torch 2.11 before deltaflow/compat.py).

A row passes when its compiled gradients are within 1e-3 of eager's in fp32, and within 1.25x
eager's error against the fp32 reference in autocast and bf16 (issue 31's tolerances), with no
all-zero gradient eager does not have. The report is written after every row.

    python3 benchmarks/check_compile_grads.py --out benchmarks/results     # GPU, every rule
    python3 benchmarks/check_compile_grads.py --rules delta --parts layer   # the smallest case
    python3 benchmarks/check_compile_grads.py --smoke   # CPU interpreter, dynamo only, fp16
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from _common import device, device_name, git_commit, output_dir, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402
from check_training import rel_error  # noqa: E402

from deltaflow.layers import DeltaAttention  # noqa: E402
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM  # noqa: E402
from deltaflow.models.compile import compile_blocks  # noqa: E402
from deltaflow.rules import triton_rules  # noqa: E402

MODES = ("fp32", "autocast", "bf16")
SMOKE_MODES = ("fp32", "autocast")
PARTS = ("layer", "model")
FP32_TOL = 1e-3  # compiled vs eager, fp32
HALF_RATIO = 1.25  # compiled error vs the fp32 reference, at most this times eager's
# Shapes: T % 64 != 0 (a partial last chunk); --smoke shrinks them to run in seconds on a CPU.
LAYER = dict(hidden_size=256, num_heads=4)
MODEL = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4)
BATCH = (2, 300)
SMOKE_LAYER = dict(hidden_size=32, num_heads=2)
SMOKE_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2)
SMOKE_BATCH = (1, 40)


class Setup:
    """Shapes, devices and dtypes of one run (the GPU's or the smoke one's)."""

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


def _fused(module: torch.nn.Module) -> torch.nn.Module:
    for m in module.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = True  # the GPU's default, here on every device
    return module


def build(part: str, rule: str, setup: Setup) -> tuple[torch.nn.Module, Callable]:
    """The fp32 module of ``part`` and its loss function ``(module, mode) -> loss``."""
    torch.manual_seed(0)
    B, T = setup.batch
    g = torch.Generator().manual_seed(1)
    if part == "layer":
        module: torch.nn.Module = DeltaAttention(
            **setup.layer, rule=rule, use_decay=True, backend="triton"
        )
        x = torch.randn(B, T, setup.layer["hidden_size"], generator=g).to(setup.dev)

        def loss(m: torch.nn.Module, mode: str) -> torch.Tensor:
            return m(x.to(setup.dtype(mode)))[0].float().pow(2).mean()

    else:
        cfg = DeltaFlowConfig(**setup.model, rule=rule, use_decay=True, backend="triton")
        module = DeltaFlowForCausalLM(cfg)
        ids = torch.randint(0, setup.model["vocab_size"], (B, T), generator=g).to(setup.dev)

        def loss(m: torch.nn.Module, mode: str) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss

    return _fused(module).to(setup.dev).train(), loss


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


def check_row(part: str, rule: str, mode: str, setup: Setup) -> dict[str, Any]:
    base, loss = build(part, rule, setup)
    _, g_ref = loss_and_grads(base, loss, "fp32", setup)  # fp32 eager: the reference
    eager = copy.deepcopy(base).to(setup.dtype(mode))
    fast = copy.deepcopy(base).to(setup.dtype(mode))
    torch._dynamo.reset()  # each row traces afresh: no graph of an earlier row is reused
    if part == "layer":
        fast = torch.compile(fast, fullgraph=True, backend=setup.compile_backend)
    else:
        compile_blocks(fast, backend=setup.compile_backend)
    loss_e, g_e = loss_and_grads(eager, loss, mode, setup)
    loss_c, g_c = loss_and_grads(fast, loss, mode, setup)
    zero = sum(int(bool(c.eq(0).all()) and not bool(e.eq(0).all())) for c, e in zip(g_c, g_e))
    row = {
        "part": part,
        "rule": rule,
        "mode": mode,
        "loss_eager": loss_e,
        "loss_compiled": loss_c,
        "grad_err_compiled_vs_eager": rel_error(g_c, g_e),
        "grad_err_eager_vs_fp32": rel_error(g_e, g_ref),
        "grad_err_compiled_vs_fp32": rel_error(g_c, g_ref),
        "zero_grads_compiled": zero,
        "params": len(g_c),
    }
    if mode == "fp32":
        within = row["grad_err_compiled_vs_eager"] <= FP32_TOL
    else:
        within = row["grad_err_compiled_vs_fp32"] <= HALF_RATIO * row["grad_err_eager_vs_fp32"]
    row["ok"] = bool(within and zero == 0)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rules", default=None, help="comma-separated (default: every Triton rule; smoke: delta)"
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated of {MODES} (default: all; smoke: fp32,autocast, the two that "
        "torch 2.11 broke: seconds matter in CI)",
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {PARTS}")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor; smoke: eager, dynamo's graph run eagerly: "
        "torch 2.11's bug is in dynamo, and AOT tracing costs the smoke run minutes in CI)",
    )
    p.add_argument("--out", default=None, help="default benchmarks/results (smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, temp report")
    args = p.parse_args()
    rules = args.rules.split(",") if args.rules else ["delta"] if args.smoke else triton_rules()
    modes = args.modes.split(",") if args.modes else SMOKE_MODES if args.smoke else MODES
    parts = args.parts.split(",")
    for name, values, known in (
        ("--rules", rules, triton_rules()),
        ("--modes", modes, MODES),
        ("--parts", parts, PARTS),
    ):
        bad = [v for v in values if v not in known]
        if bad:
            p.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    dev = torch.device(device(args.smoke))
    setup = Setup(dev, args.smoke, backend)
    out = output_dir(args.out, args.smoke)
    path = out / f"check_compile_grads_{re.sub('[^A-Za-z0-9]+', '_', device_name(dev.type))}.json"
    report: dict[str, Any] = {
        "device": device_name(dev.type),
        "commit": git_commit(),
        "torch": torch.__version__,
        "compile_backend": backend,
        "rows": [],
    }
    print(f"torch {torch.__version__}, compile backend {backend}", flush=True)
    failed = []
    for part in parts:
        for rule in rules:
            for mode in modes:
                t0 = time.perf_counter()
                try:
                    row = check_row(part, rule, mode, setup)
                except Exception:  # noqa: BLE001 - recorded; the other rows still run
                    traceback.print_exc()
                    row = {"part": part, "rule": rule, "mode": mode, "ok": False}
                    row["error"] = traceback.format_exc(limit=-3)
                row["seconds"] = round(time.perf_counter() - t0, 1)
                report["rows"].append(row)
                Path(path).write_text(json.dumps(report, indent=1) + "\n")
                if not row["ok"]:
                    failed.append(f"{part}/{rule}/{mode}")
                print(json.dumps(row), flush=True)
    print(f"wrote {path}")
    if failed:
        raise SystemExit(f"check_compile_grads: FAILED {', '.join(failed)} (see {path})")
    print("check_compile_grads: done")


if __name__ == "__main__":
    main()
