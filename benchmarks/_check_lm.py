"""check_training.py's second check: the loss curves of a ~30M LM trained eager and compiled
from the same seed and batches (gated DeltaNet since issue 31; the lab's Transformer since
session 31, whose compiled runs trained worse than eager on the GPU), and the models it runs."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from deltaflow.models.compile import compile_blocks

# The loss-curve models: gated DeltaNet (since issue 31) and the lab's transformer, whose
# compiled curve is also run without CUDA graphs and without selective checkpointing.
LM_MODELS = {
    "gated_deltanet": (dict(rule="delta", use_decay=True), ("compiled",)),
    "transformer": (
        dict(attn_every=1),
        ("compiled", "compiled_no_graphs", "compiled_no_sac"),
    ),
}
# The loss-curve LM (configs/lm_gated_deltanet.yaml's 30M) and its smoke twin.
LM = dict(hidden_size=384, num_layers=6, num_heads=6, seq_len=512, batch_size=32, eval_batch=8)
SMOKE_LM = dict(hidden_size=32, num_layers=1, num_heads=2, seq_len=64, batch_size=2, eval_batch=2)
LM_TOL = 0.05  # mean |loss difference| over the last 50 logged steps (before the fix: 0.37)


def set_fused(module: torch.nn.Module, fused: bool) -> torch.nn.Module:
    """Fused (one GEMM for the input projections) or op-by-op projections in every layer."""
    for m in module.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = fused  # on: the GPU's default, here on every device
    return module


def lm_curves(
    args: argparse.Namespace, out: Path, lm: dict[str, int], model_name: str = "gated_deltanet"
) -> dict[str, Any]:
    """``model_name``'s loss curves (LM_MODELS): eager, then each compiled variant, every run
    from the same seed and batches. gated_deltanet: the blocks compiled here with the check's
    backend, the trainer told ``compile='off'`` (as since issue 31). transformer: the trainer
    compiles (``compile='blocks'``, as ``auto`` does on CUDA: its cudagraph step marks
    included), with the check's backend and the variant's CUDA graphs / checkpointing."""
    import functools

    from deltaflow.models import compile as compile_mod
    from deltaflow.train import TrainConfig, compiling, train
    from deltaflow.train.build import build_model, build_task

    model_kw, variants = LM_MODELS[model_name]
    by_trainer = model_name != "gated_deltanet"
    curves: dict[str, Any] = {}
    for name in ("eager op-by-op", *variants):
        compiled = name != "eager op-by-op"
        cfg = TrainConfig(
            task="lm",
            task_kwargs=dict(
                data_dir=args.lm_data,
                tokenizer="bpe" if args.lm_tokenizer else "byte",
                tokenizer_path=args.lm_tokenizer,
                seq_len=lm["seq_len"],
            ),
            model=dict(
                **model_kw,
                hidden_size=lm["hidden_size"],
                num_layers=lm["num_layers"],
                num_heads=lm["num_heads"],
            ),
            steps=args.lm_steps,
            batch_size=lm["batch_size"],
            lr=1.5e-3,
            warmup_steps=min(20, args.lm_steps),
            log_every=1,
            eval_lengths=[lm["seq_len"]],
            eval_kwargs={"num_examples": 2 * lm["eval_batch"], "batch_size": lm["eval_batch"]},
            out_dir=str(out / f"lm_{model_name}_{name.split()[0]}"),
            resume=False,
            # gated_deltanet: both runs 'off' (the blocks are compiled here, with the check's
            # backend); transformer: the trainer compiles them, as a lab run does
            compile="blocks" if compiled and by_trainer else "off",
            progress=False,
        )
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, build_task(cfg).vocab_size)
        graphs_switch, trainer_compile = compile_mod.CUDA_GRAPHS, compiling.compile_blocks
        if compiled and by_trainer:
            sac = () if name == "compiled_no_sac" else ("mixer", "mlp")
            compile_mod.CUDA_GRAPHS = graphs_switch and name != "compiled_no_graphs"
            compiling.compile_blocks = functools.partial(
                compile_blocks, backend=args.compile_backend, selective_checkpointing=sac
            )
        elif compiled:
            compile_blocks(model, backend=args.compile_backend)
        else:
            set_fused(model, False)
        t0 = time.perf_counter()
        try:
            train(cfg, model=model)
        finally:
            compile_mod.CUDA_GRAPHS, compiling.compile_blocks = graphs_switch, trainer_compile
            torch._dynamo.reset()  # the next run compiles its own graphs
        lines = (Path(cfg.out_dir) / "log.jsonl").read_text().splitlines()
        # the run's checkpoints and weights (~0.5 GB per run: session 14's GPU call could not
        # bring its report folder back) are not the report: only its log stays
        for path in Path(cfg.out_dir).iterdir():
            if path.name != "log.jsonl":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        records = list(map(json.loads, lines))
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        curves[name] = {"losses": losses, "seconds": time.perf_counter() - t0}
        # what the run did: compiled or fell back, CUDA graphs, micro-batches
        for r in records:
            if r.get("event") == "start":
                curves[name]["grad_accum"] = r.get("config", {}).get("grad_accum")
            if r.get("event") in ("start", "compile_fallback"):
                for key in ("compiled_blocks", "cuda_graphs", "compile_fallback", "reason"):
                    if key in r:
                        curves[name][key] = r[key]
        print(
            f"{model_name} {name}: {len(losses)} logged losses, last {losses[-1]:.4f}", flush=True
        )
    eager = curves["eager op-by-op"]["losses"]
    oks = []
    for name in variants:
        other = curves[name]["losses"]
        n = min(len(eager), len(other))
        diffs = [abs(x - y) for x, y in zip(eager[:n], other[:n])]
        # the compiled run's signed mean over the last 50: > 0 is a worse compiled curve
        signed = [y - x for x, y in zip(eager[:n], other[:n])][-50:]
        prefix = "" if name == "compiled" else f"{name}_"
        curves[f"{prefix}max_abs_diff"] = max(diffs)
        curves[f"{prefix}mean_abs_diff_last_50"] = sum(diffs[-50:]) / len(diffs[-50:])
        curves[f"{prefix}mean_diff_last_50"] = sum(signed) / len(signed)
        oks.append(curves[f"{prefix}mean_abs_diff_last_50"] <= LM_TOL)
    curves["model"] = model_name
    curves["ok"] = all(oks)
    return curves
