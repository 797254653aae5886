"""GPU checks of the fast training path (issue 27): compiled blocks with fused projections and
selective checkpointing against today's eager op-by-op layer.

1. Gradients: loss and every parameter gradient of a small model, compiled vs eager op-by-op,
   for every rule (fp32), and in bf16 against an fp32 reference (the compiled bf16 error must
   stay within the eager bf16 error, times a margin).
2. Loss curves: ``--lm-data DIR`` trains the 30M LM of configs/lm_gated_deltanet.yaml for
   ``--lm-steps`` steps both ways (same seed, same batches) and compares the logged losses.

    python3 benchmarks/check_training.py --out benchmarks/results \\
        --lm-data ../shared/corpus --lm-tokenizer ../shared/tokenizers/gpt2.tiktoken
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.models.compile import compile_blocks
from deltaflow.rules import RULES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_training import git_commit  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4)


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """Today's op-by-op layer: six projections, three convolutions."""
    for m in model.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = False
    return model


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), [p.grad.float().clone() for p in model.parameters()]


def rel_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over parameters of max|a − b| / max|b| (b the reference)."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def check_gradients(device: torch.device, rules: list[str]) -> list[dict[str, Any]]:
    rows = []
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (4, 300), generator=g).to(device)  # T % 64 != 0
    for rule in rules:
        for decay in (False, True) if rule == "delta" else (rule != "linear",):
            torch.manual_seed(0)
            base = DeltaFlowForCausalLM(DeltaFlowConfig(**SMALL, rule=rule, use_decay=decay))
            state = base.state_dict()
            t0 = time.perf_counter()
            row: dict[str, Any] = {"rule": rule, "decay": decay}
            ref = unfuse(DeltaFlowForCausalLM(base.config)).to(device)
            ref.load_state_dict(state)
            loss_ref, g_ref = loss_and_grads(ref.train(), ids)  # fp32 eager, op by op
            for dtype in ("fp32", "bf16") if (rule, decay) == ("delta", True) else ("fp32",):
                dt = torch.float32 if dtype == "fp32" else torch.bfloat16
                eager = unfuse(DeltaFlowForCausalLM(base.config)).to(device)
                eager.load_state_dict(state)
                eager = eager.to(dt).train()
                fast = DeltaFlowForCausalLM(base.config).to(device)
                fast.load_state_dict(state)
                fast = fast.to(dt).train()
                compile_blocks(fast)
                loss_e, g_e = loss_and_grads(eager, ids)
                loss_f, g_f = loss_and_grads(fast, ids)
                row[dtype] = {
                    "loss_eager": loss_e,
                    "loss_compiled": loss_f,
                    "loss_fp32_eager": loss_ref,
                    "grad_err_eager_vs_fp32": rel_error(g_e, g_ref),
                    "grad_err_compiled_vs_fp32": rel_error(g_f, g_ref),
                    "grad_err_compiled_vs_eager": rel_error(g_f, g_e),
                }
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def lm_curves(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from deltaflow.train import TrainConfig, train
    from deltaflow.train.trainer import build_model, build_task

    curves: dict[str, Any] = {}
    for name, compiled in (("eager op-by-op", False), ("compiled", True)):
        cfg = TrainConfig(
            task="lm",
            task_kwargs=dict(
                data_dir=args.lm_data,
                tokenizer="bpe",
                tokenizer_path=args.lm_tokenizer,
                seq_len=512,
            ),
            model=dict(rule="delta", use_decay=True, hidden_size=384, num_layers=6, num_heads=6),
            steps=args.lm_steps,
            batch_size=32,
            lr=1.5e-3,
            warmup_steps=20,
            log_every=1,
            eval_lengths=[512],
            eval_kwargs={"num_examples": 16, "batch_size": 8},
            out_dir=str(out / f"lm_{'compiled' if compiled else 'eager'}"),
            resume=False,
            compile="blocks" if compiled else "off",
            progress=False,
        )
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, build_task(cfg).vocab_size)
        if not compiled:
            unfuse(model)
        t0 = time.perf_counter()
        train(cfg, model=model)
        lines = (Path(cfg.out_dir) / "log.jsonl").read_text().splitlines()
        losses = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
        curves[name] = {"losses": losses, "seconds": time.perf_counter() - t0}
        print(f"{name}: {len(losses)} logged losses, last {losses[-1]:.4f}", flush=True)
    a, b = (curves[k]["losses"] for k in curves)
    n = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    curves["max_abs_diff"] = max(diffs)
    curves["mean_abs_diff_last_50"] = sum(diffs[-50:]) / len(diffs[-50:])
    return curves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated")
    p.add_argument("--lm-data", default=None, help="corpus folder for the loss-curve check")
    p.add_argument("--lm-tokenizer", default=None)
    p.add_argument("--lm-steps", type=int, default=200)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "commit": git_commit()}
    report["gradients"] = check_gradients(device, args.rules.split(","))
    if args.lm_data:
        report["lm"] = lm_curves(args, out)
    (out / "check_training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'check_training.json'}")


if __name__ == "__main__":
    main()
