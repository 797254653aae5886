"""Issue 35, point 1: a step's memory is estimated before the first step; a batch that does not
fit runs as micro-batches (gradient accumulation, the same gradients), or the run is refused
in one line; the estimate against a measured peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deltaflow.train import TrainConfig, Trainer, build_model, memory
from tests.test_train import make, toy_config

GB = 2**30


def _grads_of_first_step(grad_accum: int, monkeypatch=None, budget: int | None = None):
    """The gradient of step 0 (fp64 toy model), captured before the optimizer uses it."""
    model, task = make()
    model.double()
    if budget is not None:
        monkeypatch.setattr(memory, "available_bytes", lambda device: budget)
    trainer = Trainer(toy_config(grad_accum=grad_accum), model=model, task=task)
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    trainer.train_step(0)
    return trainer, grads


def test_grad_accumulation_gives_the_same_gradients_in_fp64():
    _, whole = _grads_of_first_step(1)
    for accum in (2, 8):
        _, split = _grads_of_first_step(accum)
        for name, g in whole.items():
            assert g.dtype == torch.float64
            torch.testing.assert_close(split[name], g, rtol=1e-12, atol=1e-14)


def test_a_batch_that_does_not_fit_runs_as_micro_batches(monkeypatch, capsys):
    # toy step: 8 rows x 16 tokens x vocab 11; a budget for ~2 rows' logits
    per_row = memory.estimate_step(num_params=0, micro_batch=1, seq_len=16, vocab_size=11)
    model, task = make()
    params = memory.estimate_step(
        num_params=sum(p.numel() for p in model.parameters()),
        micro_batch=0,
        seq_len=16,
        vocab_size=11,
    ).total
    budget = int((params + 2.5 * per_row.total) / memory.USABLE_FRACTION)
    trainer, split = _grads_of_first_step(1, monkeypatch, budget)
    assert trainer.config.grad_accum == 4 and trainer.micro_batch == 2  # 8 rows -> 4 x 2
    _, whole = _grads_of_first_step(1)
    for name, g in whole.items():
        torch.testing.assert_close(split[name], g, rtol=1e-12, atol=1e-14)
    model, task = make()
    Trainer(toy_config(), model=model, task=task, verbose=True)  # says so in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "running it as 4 micro-batches of 2 (grad_accum 4" in err[0]


def test_the_issues_command_is_split_not_killed(monkeypatch):
    """--hidden-size 32 --num-layers 1, batch 64 x 512, vocabulary 50,257: 25 GB of logits.
    With 10 GB available it runs as micro-batches when the loss comes from the logits, and
    whole with the model's own chunked loss, which holds one chunk of them (issue 31). (mqar
    stands in for the GPT-2 corpus: the same shapes; the plan is made before any step, so
    nothing big is allocated here.)"""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * GB)
    cfg = TrainConfig(
        task="mqar",
        task_kwargs={"seq_len": 512, "vocab_size": 50257},
        model={"hidden_size": 32, "num_layers": 1},
        device="cpu",
        progress=False,
    )
    assert cfg.batch_size == 64
    model = build_model(cfg, 50257)
    model.config.fuse_linear_cross_entropy = False  # the loss from the logits
    trainer = Trainer(cfg, model=model)
    assert not trainer.lean_loss
    assert trainer.config.grad_accum == 4 and trainer.micro_batch == 16
    assert trainer.config.batch_size == 64  # the effective batch is kept
    trainer = Trainer(cfg)
    assert trainer.lean_loss and trainer.config.grad_accum == 1


def test_a_step_that_never_fits_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 * GB)
    cfg = TrainConfig(
        task="mqar",
        task_kwargs={"seq_len": 4096, "vocab_size": 50257, "num_kv_pairs": 8},
        model={"hidden_size": 32, "num_layers": 1},
        device="cpu",
        progress=False,
    )
    with pytest.raises(ValueError) as info:
        Trainer(cfg)
    text = str(info.value)
    assert "\n" not in text and text.startswith("memory: one training step needs")
    # the chunked loss's 2 copies of a 4096 x 50257 chunk need 1.5 GB; 1024 rows fit
    assert "micro-batch 1 x 4096 tokens" in text and "use a shorter --seq-len (1024 fits)" in text


_PEAK = """
import json, sys, torch
from deltaflow.train import TrainConfig, Trainer, build_model, build_task, memory
def rss(field):  # bytes of /proc/self/status's VmRSS (now) or VmHWM (the peak)
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
torch.set_num_threads(1)
fields, loss = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cfg = TrainConfig(task="mqar", device="cpu", progress=False, steps=1, **fields)
task = build_task(cfg)
model = build_model(cfg, task.vocab_size)
if loss["chunk"]:
    model.loss_chunk_size = loss["chunk"]
if not loss["fused"]:
    model.config.fuse_linear_cross_entropy = False  # the loss from the logits
trainer = Trainer(cfg, model=model, task=task)
assert trainer.lean_loss == loss["fused"]
base = rss("VmRSS")
# Forget the peak so far: the set-up's (imports, model, task) was above the step's at times.
open("/proc/self/clear_refs", "w").write("5")
trainer.train_step(0)
peak = rss("VmHWM")
est = memory.estimate_step(
    num_params=trainer.num_params, micro_batch=cfg.batch_size, seq_len=cfg.task_kwargs["seq_len"],
    vocab_size=model.config.vocab_size, hidden_size=model.config.hidden_size,
    num_layers=model.config.num_layers,
    loss_chunk_rows=memory.loss_chunk_rows(model) if trainer.lean_loss else None)
weights = 4 * trainer.num_params  # in RAM before the step (the estimate counts them)
print(json.dumps({"measured": peak - base, "estimate": est.total - weights}))
"""

LOGITS = {"vocab_size": 16384, "hidden_size": 32, "num_layers": 1}  # logits dominate
ACTIVATIONS = {"vocab_size": 256, "hidden_size": 256, "num_layers": 4}  # activations dominate


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
@pytest.mark.parametrize(
    "shape, loss",
    [
        (LOGITS, {"fused": False, "chunk": None}),  # the loss from the logits: 4 copies
        (LOGITS, {"fused": True, "chunk": None}),  # the chunked loss: one chunk of all rows
        (LOGITS, {"fused": True, "chunk": 1024}),  # ... of 1024 of the 2048 rows
        (ACTIVATIONS, {"fused": True, "chunk": None}),
    ],
)
def test_the_estimate_against_a_measured_peak(shape, loss):
    """Peak RSS of one step minus the RSS before it, in a fresh process, vs the estimate.
    Measured, in the order above: 0.78x, 1.05x, 1.11x, 0.86x (deltaflow/train/memory.py).
    The peak is reset before the step: read from the process's start, it was at times the
    set-up's (once 1.33x inside the whole suite, and 1.6x for the 1024-row chunks after
    test_lm_eval; why the set-up peaks higher there was not found)."""
    fields = {
        "batch_size": 8,
        "task_kwargs": {"seq_len": 256, "vocab_size": shape["vocab_size"], "num_kv_pairs": 8},
        "model": {"hidden_size": shape["hidden_size"], "num_layers": shape["num_layers"]},
    }
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # what the earlier tests set is left out
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, json.dumps(fields), json.dumps(loss)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = result["measured"] / result["estimate"]
    assert 0.6 < ratio < 1.5, result
