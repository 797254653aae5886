"""check_training.py's packed-documents entry (``packed:<case>`` units): the trainer's
compiled blocks on packed documents (``doc_starts`` -> ``cu_seqlens``, another document count
every step) against the same run eager. Session 32 (H200): the Triton delta rule stayed
compiled (max |loss diff| 6e-4); the torch backend (longhorn, chunk 32) fell back to eager at
its first compiled step, its reason not captured: each row keeps the fallback line and the
exception's traceback tail."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch

# The cases: (a) the Triton delta rule, (b) the torch backend (longhorn at chunk 32, which the
# Triton kernels do not take: ops/delta_rule.py resolve_backend). Both with decay.
PACKED = {
    "delta": dict(rule="delta", backend="triton"),
    "longhorn": dict(rule="longhorn", backend="torch", chunk_size=32),
}
PACKED_MODEL = dict(vocab_size=16, hidden_size=64, num_layers=2, num_heads=2, use_decay=True)
PACKED_STEPS, PACKED_BATCH = 40, 4
# --smoke: the Triton case's steps on the CPU interpreter (~3 s a step and run, more with more
# documents); the torch backend's 40 steps take seconds (32 document counts: past dynamo's
# recompile limit of 24, as on the GPU)
SMOKE_TRITON_STEPS = 3
# max |loss compiled - eager| over the steps (bf16 autocast on CUDA). Session 32's Triton
# delta case: 6e-4; a document reading another's state (the bug packing guards against) moves
# the copy loss at each document start by O(1) nats, averaged over ~1-31 starts in 96 tokens
# a row: 0.02 is 30x the measured rounding and below such an error.
PACKED_TOL = 0.02


class PackedCopy:
    """Predict the previous token (vocab 16, T 24), with packed documents: step s adds s % 32
    document starts to the rows' own, so each step of a 32-step stretch has its own document
    count (cu_seqlens of another length). tests/test_train_compile.py trains it too."""

    vocab_size, seq_len = 16, 24

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0, length=None):
        T = length or self.seq_len
        g = torch.Generator().manual_seed(step + (0 if split == "train" else 10_000))
        ids = torch.randint(0, self.vocab_size, (batch_size, T), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, 1:] = ids[:, :-1]
        g = torch.Generator().manual_seed(1000 + step)
        starts = torch.zeros(batch_size, T, dtype=torch.bool)
        starts[:, 0] = True
        inner = torch.randperm(batch_size * (T - 1), generator=g)[: step % 32]
        starts[inner // (T - 1), 1 + inner % (T - 1)] = True
        return {"input_ids": ids, "labels": labels, "doc_starts": starts}

    def eval_batches(self, split: str, num_examples: int = 4, batch_size: int = 4, length=None):
        yield self.get_batch(batch_size, split=split, step=0, length=length)

    def metrics(self, logits: torch.Tensor, batch: dict) -> dict[str, float]:
        mask = batch["labels"] != -100
        return {"loss": torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask])}


def packed_ok(row: dict[str, Any], tol: float = PACKED_TOL) -> bool:
    """The verdict: the compiled run stayed compiled (no fallback) and its losses are eager's
    within ``tol`` at every step."""
    diff = row.get("max_abs_loss_diff")
    return bool(
        row.get("compiled") and not row.get("compile_fallback") and diff is not None and diff <= tol
    )


def packed_row(unit: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``packed:<case>``: the tiny model trained PACKED_STEPS steps on PackedCopy with
    ``compile='auto'`` (CUDA; ``'blocks'`` elsewhere: auto is eager on the CPU) and ``'off'``,
    same seed and batches; the compiled blocks use the check's backend."""
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks
    from deltaflow.train import TrainConfig, Trainer, compiling, read_log

    case = unit.split(":")[1]
    mode = "auto" if torch.cuda.is_available() and not args.smoke else "blocks"
    interpreted = args.smoke and PACKED[case]["backend"] == "triton"
    steps = SMOKE_TRITON_STEPS if interpreted else PACKED_STEPS
    row: dict[str, Any] = {"unit": unit, **PACKED[case], "compile": mode, "steps": steps}
    trainer_compile = compiling.compile_blocks
    compiling.compile_blocks = functools.partial(compile_blocks, backend=args.compile_backend)
    losses = {}
    try:
        for name in (mode, "off"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = DeltaFlowForCausalLM(DeltaFlowConfig(**PACKED_MODEL, **PACKED[case]))
            cfg = TrainConfig(
                task="copy",
                steps=steps,
                batch_size=PACKED_BATCH,
                lr=1e-3,
                log_every=1,
                compile=name,
                progress=False,
                out_dir=str(out / f"packed_{case}_{name}"),
                resume=False,
            )
            trainer = Trainer(cfg, model=model, task=PackedCopy(), export_final=False)
            try:
                trainer.train()
            finally:
                trainer.close()
            losses[name] = [r["loss"] for r in read_log(cfg.out_dir) if r["kind"] == "train"]
            if name == mode:
                row["compiled"] = bool(trainer.compiled)
                row["compile_fallback"] = trainer.compile_fallback
                row["device"] = str(trainer.device)
                if trainer.compile_error is not None:  # the fallback's whole error
                    row["fallback_traceback"] = trainer.compile_error
    finally:
        compiling.compile_blocks = trainer_compile
    pairs = list(zip(losses[mode], losses["off"]))
    row["max_abs_loss_diff"] = max(abs(a - b) for a, b in pairs) if pairs else None
    row["logged"] = [len(losses[mode]), len(losses["off"])]
    row["ok"] = packed_ok(row) and row["logged"] == [steps, steps]
    print(
        f"packed {case}: compiled {row['compiled']}, max |loss diff| "
        f"{row['max_abs_loss_diff']}, fallback {row['compile_fallback']}",
        flush=True,
    )
    return row


def summary(report: dict[str, Any]) -> list[str]:
    """One line per packed case of the report (printed by the parent at the end)."""
    return [
        f"packed {key[7:]} ({row.get('backend')}): compiled {row.get('compiled')}, max |loss "
        f"diff| {row.get('max_abs_loss_diff')} (tol {PACKED_TOL}), fallback "
        f"{row.get('compile_fallback') or row.get('error')}, ok {row['ok']}"
        for key, row in sorted(report.items())
        if key.startswith("packed_")
    ]
