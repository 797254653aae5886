"""Multi-GPU training on the CPU: 2 processes on the gloo backend, torchrun-style environment.

A tiny DeltaFlow language model (byte tokenizer, a temp text corpus) is trained with DDP and
with FSDP2, and compared with one process on the same global batch. The FSDP test also kills
a run after its step-3 sharded checkpoint, resumes it, and checks that the resumed run is the
uninterrupted one, and that the consolidated ``model.safetensors`` loads into a plain model.

Each test spawns 2 processes (~10 s on 2 cores); ``-m "not multiprocess"`` skips them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _distributed import free_port, set_rank_env, spawn_ranks
from safetensors.torch import load_file

from deltaflow.train import (
    TrainConfig,
    Trainer,
    build_model,
    build_task,
    load_checkpoint,
    model_logits,
    read_log,
)

pytestmark = pytest.mark.multiprocess

STEPS = 6
KILL_AT = 4  # the killed run dies after step 4; its latest checkpoint is step 3


def lm_config(tmp: Path, **changes) -> TrainConfig:
    base = dict(
        task="lm",
        task_kwargs={
            "data_dir": str(tmp / "corpus"),
            "tokenizer": "byte",
            "seq_len": 32,
            "cache_dir": str(tmp / "cache"),
        },
        model={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "backend": "torch"},
        steps=STEPS,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        eval_kwargs={"num_examples": 4, "batch_size": 4},
        progress=False,
        device="cpu",
        precision="fp32",
        seed=0,
    )
    base.update(changes)
    return TrainConfig(**base)


def write_corpus(tmp: Path) -> None:
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(3):  # >= 2 files: one becomes the validation split
        text = f"Document {i}. " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(400))
        (corpus / f"doc{i}.txt").write_text(text)
    task = build_task(lm_config(tmp))  # tokenize once, before the ranks start
    task.stream("train"), task.stream("valid")


def probe_ids() -> torch.Tensor:
    return torch.arange(64).reshape(2, 32) % 200 + 32  # printable bytes


def train_losses(run_dir: Path) -> list[float]:
    records = [r for r in read_log(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def single_process_losses(tmp: Path) -> list[float]:
    out = tmp / "single"
    Trainer(lm_config(tmp, out_dir=str(out))).train()
    return train_losses(out)


# ---------------------------------------------------------------------------- the 2 ranks
class Killed(Exception):
    pass


def _die(trainer: Trainer, step: int) -> None:
    if step == KILL_AT:
        raise Killed


def _worker(rank: int, world: int, port: int, tmp_dir: str, parallel: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    tmp = Path(tmp_dir)
    # Uninterrupted run; then the probe's logits of its final (sharded or replicated) model.
    trainer = Trainer(lm_config(tmp, parallel=parallel, out_dir=str(tmp / "straight")))
    trainer.train()
    with torch.no_grad():
        logits = model_logits(trainer.model.eval(), probe_ids())
    params = {k: v.detach() for k, v in trainer.raw_model.state_dict().items()}
    if parallel == "fsdp":
        params = {k: v.to_local() for k, v in params.items()}  # this rank's shards
    torch.save({"logits": logits, "params": params}, tmp / f"rank{rank}.pt")
    if parallel == "fsdp":
        # Killed after step 4 (checkpoint at 3), then resumed in a fresh Trainer to the end.
        cfg = lm_config(tmp, parallel=parallel, out_dir=str(tmp / "resumed"), ckpt_every=3)
        killed = Trainer(cfg, callbacks=[_die])
        try:
            killed.train()
        except Killed:
            pass
        torch.manual_seed(1234)  # the resumed run must not depend on the process's RNG
        resumed = Trainer(cfg)
        (tmp / f"resumed_from{rank}.json").write_text(json.dumps(resumed.step))
        resumed.train()
        resumed.close()
    trainer.close()


def spawn(tmp: Path, parallel: str) -> None:
    spawn_ranks(_worker, (2, free_port(), str(tmp), parallel), world=2)


# ---------------------------------------------------------------------------- tests
def test_ddp_two_ranks_match_one_process(tmp_path):
    write_corpus(tmp_path)
    spawn(tmp_path, "ddp")
    torch.testing.assert_close(
        train_losses(tmp_path / "straight"), single_process_losses(tmp_path), rtol=1e-4, atol=0
    )
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name  # replicas stay identical


def test_fsdp_two_ranks_sharded_checkpoint_resume_and_export(tmp_path):
    write_corpus(tmp_path)
    spawn(tmp_path, "fsdp")
    straight = train_losses(tmp_path / "straight")
    # Sharded training computes the same losses as one process on the same global batch.
    torch.testing.assert_close(straight, single_process_losses(tmp_path), rtol=1e-4, atol=0)
    # Each rank holds half of every (dim-0 sharded) parameter.
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    vocab = build_task(lm_config(tmp_path)).vocab_size
    embed = "model.embed_tokens.weight"
    assert r0["params"][embed].shape[0] + r1["params"][embed].shape[0] == vocab

    # Killed at step 4, resumed from the sharded step-3 checkpoint: the same run, exactly.
    ckpt = tmp_path / "resumed" / "checkpoints"
    assert (ckpt / "step_0000006" / "dcp" / ".metadata").is_file()
    assert [json.loads((tmp_path / f"resumed_from{r}.json").read_text()) for r in (0, 1)] == [3, 3]
    assert train_losses(tmp_path / "resumed") == straight
    final_straight = load_file(tmp_path / "straight/checkpoints/step_0000006/model.safetensors")
    final_resumed = load_file(ckpt / "step_0000006" / "model.safetensors")
    assert final_straight.keys() == final_resumed.keys()
    for name, value in final_straight.items():
        assert torch.equal(final_resumed[name], value), name

    # The consolidated export loads into a plain one-process model: same logits as FSDP's.
    model = build_model(lm_config(tmp_path), vocab)
    load_checkpoint(tmp_path / "straight", model=model, restore_rng=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    with torch.no_grad():
        logits = model_logits(model.eval(), probe_ids())
    torch.testing.assert_close(logits, r0["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r1["logits"], r0["logits"], rtol=0, atol=0)


def test_resume_refuses_a_checkpoint_of_the_other_parallel_mode(tmp_path):
    write_corpus(tmp_path)
    out = str(tmp_path / "run")
    Trainer(lm_config(tmp_path, steps=1, out_dir=out, parallel="fsdp")).train()
    with pytest.raises(ValueError, match="parallel='fsdp' run"):
        Trainer(lm_config(tmp_path, steps=2, out_dir=out, parallel="ddp"))
    with pytest.raises(ValueError, match="parallel must be 'ddp' or 'fsdp'"):
        lm_config(tmp_path, parallel="zero3")


def _early_stop_worker(rank: int, world: int, port: int, tmp_dir: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    tmp = Path(tmp_dir)
    cfg = lm_config(tmp, out_dir=str(tmp / "early"), eval_every=2, early_stop="loss<=1000")
    trainer = Trainer(cfg)
    trainer.train()
    (tmp / f"early_rank{rank}.json").write_text(json.dumps(trainer.step))
    trainer.close()


def test_ddp_early_stop_ends_every_rank_at_rank0s_step(tmp_path):
    """early_stop under DDP: rank 0 decides at the first evaluation (step 2, a loss any
    model meets) and every rank leaves the loop there; a rank that trained on would hang in
    its next gradient all-reduce (spawn_ranks' deadline fails the test then)."""
    write_corpus(tmp_path)
    spawn_ranks(_early_stop_worker, (2, free_port(), str(tmp_path)), world=2)
    steps = [json.loads((tmp_path / f"early_rank{r}.json").read_text()) for r in (0, 1)]
    assert steps == [2, 2]
    final = json.loads((tmp_path / "early" / "final.json").read_text())
    assert final["stopped_early_at"] == 2
