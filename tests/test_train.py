"""Training harness: schedule, config, optimizer groups, checkpoints, logs, exact resume, DDP.

Runs on a toy task and toy model defined here (no dependency on deltaflow.tasks/models), so
these tests pin the harness itself; tests/test_cli.py covers the real tasks and models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _distributed import free_port, set_rank_env, spawn_ranks
from safetensors.torch import load_file
from torch import nn

from deltaflow.train import (
    DivergenceError,
    RunLogger,
    TrainConfig,
    Trainer,
    apply_overrides,
    latest_checkpoint,
    load_checkpoint,
    lr_at,
    param_groups,
    read_log,
    save_checkpoint,
    train,
)
from deltaflow.train.checkpoint import list_checkpoints


# ---------------------------------------------------------------------------- toy task and model
class ToyTask:
    """Predict the token seen ``lag`` positions earlier; the first ``lag`` are unscored."""

    def __init__(self, vocab_size: int = 11, seq_len: int = 13, lag: int = 2, seed: int = 0):
        self.vocab_size, self.seq_len, self.lag, self.seed = vocab_size, seq_len, lag, seed
        self.chance = 1.0 / vocab_size

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0, length=None):
        split_id = ["train", "valid", "test"].index(split)  # not hash(): salted per process
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + split_id * 100_000 + step)
        ids = torch.randint(0, self.vocab_size, (batch_size, length or self.seq_len), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, self.lag :] = ids[:, : -self.lag]
        labels[:, -1] = -100 if step % 2 else labels[:, -1]  # uneven scored counts across rows
        return {"input_ids": ids, "labels": labels}

    def eval_batches(self, split: str, num_examples: int = 24, batch_size: int = 8, length=None):
        for i in range(num_examples // batch_size):
            yield self.get_batch(batch_size, split=split, step=10_000 + i, length=length)

    def metrics(self, logits: torch.Tensor, batch: dict) -> dict[str, float]:
        labels = batch["labels"]
        mask = labels != -100
        loss = nn.functional.cross_entropy(logits[mask], labels[mask])
        acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
        return {"loss": float(loss), "ppl": float(loss.exp()), "accuracy": float(acc)}


class ToyModel(nn.Module):
    """Embedding + two learned causal shifts + RMSNorm + tied head: can solve ToyTask."""

    def __init__(self, vocab_size: int = 11, dim: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.shift1 = nn.Linear(dim, dim)
        self.shift2 = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: must be saved once and not decayed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(input_ids)
        prev1 = nn.functional.pad(e, (0, 0, 1, 0))[:, :-1]
        prev2 = nn.functional.pad(e, (0, 0, 2, 0))[:, :-2]
        return self.head(self.norm(e + self.shift1(prev1) + self.shift2(prev2)))


def toy_config(**kw) -> TrainConfig:
    base = dict(
        task="toy",
        steps=8,
        batch_size=8,
        lr=3e-2,
        log_every=2,
        eval_every=4,
        progress=False,
        device="cpu",
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def make(seed: int = 0) -> tuple[ToyModel, ToyTask]:
    torch.manual_seed(seed)
    return ToyModel(), ToyTask()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- schedule
def test_lr_schedule_warmup_then_cosine_to_floor():
    kw = dict(base_lr=1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert lrs[100] == pytest.approx(0.1)
    assert lr_at(7, base_lr=2.0, total_steps=10, warmup_steps=0, min_lr_ratio=0.0) < 2.0
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_at(0, base_lr=1.0, total_steps=5, warmup_steps=-1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_at(0, base_lr=1.0, total_steps=5, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="schedule must be one of cosine, wsd, constant"):
        lr_at(0, base_lr=1.0, total_steps=5, schedule="linear")


def test_lr_schedules_wsd_and_constant():
    kw = dict(base_lr=1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    wsd = [lr_at(s, schedule="wsd", decay_fraction=0.2, **kw) for s in range(101)]
    assert wsd[0] == pytest.approx(0.1) and wsd[9] == pytest.approx(1.0)
    assert wsd[10:81] == [1.0] * 71  # stable until the last 20% of the steps
    assert wsd[90] == pytest.approx(0.1 + 0.9 * 0.5) and wsd[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(wsd[80:], wsd[81:]))
    # up to its decay, a run follows the curve of a longer one (wsd runs can be extended)
    longer = [lr_at(s, schedule="wsd", **{**kw, "total_steps": 200}) for s in range(80)]
    assert longer == wsd[:80]
    const = [lr_at(s, schedule="constant", **kw) for s in range(101)]
    assert const[:10] == wsd[:10] and const[10:] == [1.0] * 91


def test_the_trainer_follows_the_configured_schedule():
    model, task = make()
    cfg = toy_config(steps=10, log_every=1, eval_every=0, schedule="wsd", warmup_steps=2)
    trainer = Trainer(cfg, model=model, task=task)
    trainer.train()
    logged = [r["lr"] for r in trainer.logger.of_kind("train")]
    kw = dict(base_lr=cfg.lr, total_steps=10, warmup_steps=2, schedule="wsd")
    assert logged == pytest.approx([lr_at(s, **kw) for s in range(10)])
    assert logged[2:8] == [cfg.lr] * 6  # stable, then the last 20% decays


def test_warmup_longer_than_the_run_is_the_whole_run_everywhere(capsys):
    """One rule (config, lr_at, trainer, lab grid): shortened to the run, with one note."""
    assert lr_at(4, base_lr=1.0, total_steps=5, warmup_steps=20) == pytest.approx(1.0)
    cfg = TrainConfig(steps=10, warmup_steps=20)
    assert cfg.resolved_warmup_steps == 10
    assert "warmup_steps 20 > steps 10: warming up over the whole run" in cfg.warmup_note()
    assert TrainConfig(steps=10, warmup_steps=10).warmup_note() is None
    model, task = make()
    Trainer(toy_config(steps=4, warmup_steps=20), model=model, task=task, verbose=True)
    assert capsys.readouterr().err.count("warmup_steps 20 > steps 4") == 1
    from deltaflow.lab import expand_grid, get_preset

    (spec, *_) = expand_grid(get_preset("quick"), device="cpu", steps=5)
    assert spec.config.warmup_steps == 5 == spec.config.resolved_warmup_steps
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        TrainConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="decay_fraction must be in"):
        TrainConfig(schedule="wsd", decay_fraction=0)


# ---------------------------------------------------------------------------- config
def test_config_yaml_roundtrip_overrides_and_errors(tmp_path):
    cfg = TrainConfig(task="mqar", task_kwargs={"seq_len": 64}, model={"rule": "efla"}, steps=37)
    cfg.to_yaml(tmp_path / "c.yaml")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml") == cfg
    data = apply_overrides(
        cfg.to_dict(),
        [
            "lr=3e-4",
            "weight_decay=0",
            "model.rule=delta",
            "model.use_decay=on",
            "eval_lengths=[8,16]",
        ],
    )
    new = TrainConfig.from_dict(data)
    assert new.lr == 3e-4 and new.weight_decay == 0.0
    assert new.model == {"rule": "delta", "use_decay": True}
    assert new.eval_lengths == [8, 16] and cfg.model == {"rule": "efla"}  # original untouched
    assert cfg.resolved_warmup_steps == 1 and TrainConfig(steps=1000).resolved_warmup_steps == 50
    with pytest.raises(ValueError, match=r"unknown key 'stepz' \(did you mean 'steps'\?\)"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match="vocab_size is taken from the task"):
        TrainConfig(model={"vocab_size": 5})
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides({}, ["lr"])
    (tmp_path / "bad.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="YAML mapping"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")


# ---------------------------------------------------------------------------- optimizer groups
def test_param_groups_skip_norms_biases_embeddings_and_dedupe_tied():
    model, _ = make()
    decay, no_decay = param_groups(model, 0.1)
    decay_ids = {id(p) for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay_ids == {id(model.shift1.weight), id(model.shift2.weight)}
    no_ids = {id(p) for p in no_decay["params"]}
    assert id(model.embed.weight) in no_ids and id(model.norm.weight) in no_ids
    assert id(model.shift1.bias) in no_ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ---------------------------------------------------------------------------- training
def test_training_learns_the_toy_task_and_writes_logs(tmp_path):
    model, task = make()
    cfg = toy_config(steps=60, eval_every=30, out_dir=str(tmp_path / "run"), lr=5e-2)
    summary = Trainer(cfg, model=model, task=task).train()
    assert summary["step"] == 60 and summary["eval"]["accuracy"] > 0.9
    assert summary["eval"]["ppl"] == pytest.approx(math.exp(summary["eval"]["loss"]))
    run = tmp_path / "run"
    records = read_log(run)
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(2, 61, 2))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [30, 60]
    first, last = records[1], [r for r in records if r["kind"] == "train"][-1]
    assert last["loss"] < 0.5 * first["loss"] and last["tokens_per_s"] > 0
    header = (run / "train.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["step", "loss", "grad_norm"] and "tokens_per_s" in header
    assert "accuracy" in (run / "eval.csv").read_text().splitlines()[0]
    assert json.loads((run / "final.json").read_text())["step"] == 60
    assert TrainConfig.from_yaml(run / "run_config.yaml") == cfg


class FiniteToyTask(ToyTask):
    """The toy task read from a finite training split of ``train_tokens`` tokens (like a corpus)."""

    train_tokens = 4 * 8 * 13  # 4 steps of batch 8 (sequences of 13) are one pass

    def train_passes(self, steps: int, batch_size: int) -> float:
        return steps * batch_size * self.seq_len / self.train_tokens


def test_more_than_one_pass_over_a_finite_split_is_warned_about_and_logged(tmp_path, recwarn):
    """A language model trained for ~7 passes over a small corpus memorises it (issue 11's
    50M-token runs): the trainer says so at the start and logs the passes."""
    for steps, warned in ((4, False), (6, True)):
        torch.manual_seed(0)
        out = tmp_path / f"steps{steps}"
        cfg = toy_config(steps=steps, eval_every=0, out_dir=str(out))
        Trainer(cfg, model=ToyModel(), task=FiniteToyTask()).train()
        start = next(r for r in read_log(out) if r["kind"] == "event")
        assert start["event"] == "start" and start["train_passes"] == steps / 4
        messages = [str(w.message) for w in recwarn.list if "training split" in str(w.message)]
        assert bool(messages) == warned, messages
        assert not warned or "~1.5 times" in messages[0]
        recwarn.clear()
    Trainer(toy_config(steps=2, out_dir=str(tmp_path / "toy")), **_toy()).train()
    start = next(r for r in read_log(tmp_path / "toy") if r["kind"] == "event")
    assert "train_passes" not in start  # a task without a finite split logs none


def test_checkpoint_layout_atomic_prune_and_tied_weights(tmp_path):
    model, task = make()
    cfg = toy_config(steps=6, ckpt_every=2, keep_checkpoints=2, out_dir=str(tmp_path))
    Trainer(cfg, model=model, task=task).train()
    kept = list_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_0000004", "step_0000006"]
    assert latest_checkpoint(tmp_path) == kept[-1]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert len(load_file(kept[-1] / "model.safetensors")) == 6  # tied head stored once
    fresh, _ = make(seed=1)
    state = load_checkpoint(tmp_path, model=fresh, restore_rng=False)  # run dir -> latest
    assert state["step"] == 6
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    assert fresh.head.weight is fresh.embed.weight  # still tied after loading
    # A stale temp dir from a killed save is ignored and the pointer still wins.
    (tmp_path / "checkpoints" / ".tmp-step_0000008-1").mkdir()
    assert latest_checkpoint(tmp_path) == kept[-1]


def test_killed_and_resumed_run_equals_straight_run(tmp_path):
    """Train 10 steps straight vs. die at step 7 (checkpoint at 6), resume to 10: same weights."""
    straight_model, task = make()
    Trainer(toy_config(steps=10), model=straight_model, task=task).train()

    class Killed(Exception):
        pass

    def die_at_7(trainer, step):
        if step == 7:
            raise Killed

    cfg = toy_config(steps=10, ckpt_every=3, out_dir=str(tmp_path))
    model, task = make()
    with pytest.raises(Killed):
        Trainer(cfg, model=model, task=task, callbacks=[die_at_7]).train()
    assert latest_checkpoint(tmp_path).name == "step_0000006"
    torch.manual_seed(1234)  # the resumed process starts from different RNG state and init
    resumed_model, task = make(seed=99)
    trainer = Trainer(cfg, model=resumed_model, task=task)
    assert trainer.step == 6
    trainer.train()
    for k, v in weights(straight_model).items():
        assert torch.equal(resumed_model.state_dict()[k], v), k
    steps = [r["step"] for r in read_log(tmp_path) if r["kind"] == "train"]
    assert steps == [2, 4, 6, 8, 10]  # the killed run's step-7 logs were dropped, none doubled
    # Resuming with a different model config is refused instead of silently mixing runs.
    with pytest.raises(ValueError, match="cannot resume"):
        Trainer(cfg.replace(model={"hidden_size": 8}), model=make()[0], task=task)


def test_deadline_stops_at_a_log_step_with_a_checkpoint_and_resumes_exactly(tmp_path):
    """A passed deadline stops the run at the next log step (checkpoint written, no final eval,
    no final.json); each new trainer goes one log window further; the pieces equal one run."""
    straight = Trainer(toy_config(steps=10, out_dir=str(tmp_path / "straight")), **_toy())
    straight.train()
    cfg = toy_config(steps=10, out_dir=str(tmp_path / "cut"))
    stops = []
    for i in range(3):  # deadline already passed: 2 steps per trainer (log_every=2)
        trainer = Trainer(cfg, deadline=0.0, **_toy(seed=7 if i else 0))  # 7: overwritten
        summary = trainer.train()
        stops.append((summary["step"], summary["finished"], latest_checkpoint(cfg.out_dir).name))
    assert stops == [(n, False, f"step_{n:07d}") for n in (2, 4, 6)]
    assert not (tmp_path / "cut" / "final.json").exists()
    resumed = Trainer(cfg, checkpoint_seconds=1e-9, **_toy(seed=7))  # checkpoint at every log
    summary = resumed.train()
    assert summary["finished"] and summary["seconds"] > resumed.seconds_before > 0
    for k, v in weights(straight.raw_model).items():
        assert torch.equal(resumed.raw_model.state_dict()[k], v), k
    curve = [(r["step"], r["loss"]) for r in resumed.logger.of_kind("train")]
    assert curve == [(r["step"], r["loss"]) for r in straight.logger.of_kind("train")]
    evals = [(r["step"], r["accuracy"]) for r in resumed.logger.of_kind("eval")]
    assert evals == [(r["step"], r["accuracy"]) for r in straight.logger.of_kind("eval")]
    stop_events = [r for r in read_log(cfg.out_dir) if r.get("event") == "stop"]
    assert [r["step"] for r in stop_events] == [2, 4, 6]
    with pytest.raises(ValueError, match="checkpoint_seconds"):
        Trainer(cfg, checkpoint_seconds=0, **_toy())


def _toy(seed: int = 0) -> dict:
    model, task = make(seed)
    return {"model": model, "task": task}


def test_grad_accumulation_matches_full_batch():
    a, task = make()
    Trainer(toy_config(steps=4, grad_accum=1), model=a, task=task).train()
    b, task = make()
    Trainer(toy_config(steps=4, grad_accum=4), model=b, task=task).train()
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_eval_lengths_give_per_length_and_headline_metrics():
    model, task = make()
    trainer = Trainer(toy_config(eval_lengths=[9, 17]), model=model, task=task)
    metrics = trainer.evaluate()
    assert {"accuracy@9", "accuracy@17", "ppl@17", "accuracy"} <= set(metrics)
    assert metrics["accuracy"] == metrics["accuracy@9"]  # headline: the first length for LM-like
    task.eval_lengths = [9, 17]  # a task with its own test lengths: headline is their mean
    metrics = Trainer(toy_config(), model=model, task=task).evaluate()
    assert metrics["accuracy"] == pytest.approx(
        (metrics["accuracy@9"] + metrics["accuracy@17"]) / 2
    )


def test_bad_inputs_raise_clear_errors():
    model, task = make()
    with pytest.raises(ValueError, match="must be a multiple of grad_accum"):
        Trainer(toy_config(batch_size=6, grad_accum=4), model=model, task=task)

    class NaNModel(ToyModel):
        def forward(self, input_ids):
            return super().forward(input_ids) * float("nan")

    with pytest.raises(DivergenceError, match="lower the learning rate or enable grad_clip"):
        Trainer(toy_config(grad_clip=0.0), model=NaNModel(), task=task).train()
    # clipping already on: the advice is not to turn it on (session 31's raw-key runs said so)
    with pytest.raises(DivergenceError, match=r"grad_clip=1.0\); lower the learning rate$"):
        Trainer(toy_config(grad_clip=1.0), model=NaNModel(), task=task).train()

    class FlatModel(ToyModel):
        def forward(self, input_ids):
            return super().forward(input_ids)[:, -1]

    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        Trainer(toy_config(), model=FlatModel(), task=task).train()


def test_logger_drops_records_past_resume_step(tmp_path):
    log = RunLogger(tmp_path)
    for step in (1, 2, 3):
        log.log("train", step, loss=1.0 / step)
    log.close()
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # torn line from a kill mid-write
    log = RunLogger(tmp_path, resume_step=2)
    assert [r["step"] for r in log.records] == [1, 2]
    log.close()
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2]


def test_save_checkpoint_replaces_same_step(tmp_path):
    model, _ = make()
    save_checkpoint(tmp_path, model=model, optimizer=None, step=3, config={}, keep=3)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    path = save_checkpoint(tmp_path, model=model, optimizer=None, step=3, config={}, keep=3)
    assert torch.equal(load_file(path / "model.safetensors")["norm.weight"], model.norm.weight)
    assert len(list_checkpoints(tmp_path)) == 1


# ---------------------------------------------------------------------------- data parallel
def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    model, task = make()
    summary = train(toy_config(steps=4, out_dir=out), model=model, task=task)
    torch.save({"w": weights(model), "summary": summary}, Path(out) / f"rank{rank}.pt")


def _ddp_signal_worker(rank: int, world: int, port: int, out: str) -> None:
    """A signal that reaches one rank only (here: rank 1, after step 2) stops every rank at the
    same step, with one checkpoint of it."""
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)

    def signal_rank1(trainer, step):
        if rank == 1 and step == 2:
            trainer._signal = "SIGTERM"

    cfg = toy_config(steps=8, log_every=1, out_dir=str(Path(out) / "signalled"))
    summary = train(cfg, callbacks=[signal_rank1], handle_signals=True, **_toy())
    (Path(out) / f"signalled{rank}.json").write_text(json.dumps(summary))


@pytest.mark.multiprocess
def test_ddp_two_cpu_ranks_match_single_process(tmp_path):
    """torchrun-style env (WORLD_SIZE/RANK) on the gloo backend: same result as one process."""
    spawn_ranks(_ddp_worker, (2, free_port(), str(tmp_path)), world=2)
    single, task = make()
    Trainer(toy_config(steps=4), model=single, task=task).train()
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(r0["w"][k], v, rtol=1e-5, atol=1e-6)
        assert torch.equal(r0["w"][k], r1["w"][k])  # ranks stay in lockstep
    assert r0["summary"]["eval"]["accuracy"] >= 0 and r1["summary"]["eval"] == {}  # rank 0 evals
    assert latest_checkpoint(tmp_path).name == "step_0000004"  # written once, by rank 0


@pytest.mark.multiprocess
def test_a_signal_on_one_ddp_rank_stops_every_rank_at_one_step(tmp_path):
    spawn_ranks(_ddp_signal_worker, (2, free_port(), str(tmp_path)), world=2)
    for rank in (0, 1):
        summary = json.loads((tmp_path / f"signalled{rank}.json").read_text())
        assert (summary["step"], summary["finished"], summary["stopped"]) == (3, False, "SIGTERM")
    assert latest_checkpoint(tmp_path / "signalled").name == "step_0000003"


# ---------------------------------------------------------------------------- logs across resumes
@pytest.mark.parametrize(
    ("ckpt_every", "log_every", "kill_at"), [(3, 2, 5), (2, 3, 4), (5, 4, 8), (1, 3, 2)]
)
def test_logged_losses_after_a_resume_equal_the_uninterrupted_run(
    tmp_path, ckpt_every, log_every, kill_at
):
    """ckpt_every not a multiple of log_every: the checkpoint falls inside a log window, whose
    running loss is saved with it, so the resumed run logs the same means."""
    cfg = toy_config(steps=10, eval_every=3, log_every=log_every, ckpt_every=ckpt_every)
    straight = Trainer(cfg.replace(out_dir=str(tmp_path / "straight")), **_toy())
    straight.train()

    def kill(trainer, step):
        if step == kill_at:
            raise KeyboardInterrupt  # like a kill: nothing saved beyond the last checkpoint

    out = str(tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg.replace(out_dir=out), callbacks=[kill], **_toy()).train()
    Trainer(cfg.replace(out_dir=out), **_toy(seed=5)).train()
    for kind in ("train", "eval"):
        want = [
            {k: v for k, v in r.items() if k != "tokens_per_s"}
            for r in read_log(straight.config.out_dir)
            if r["kind"] == kind
        ]
        got = [
            {k: v for k, v in r.items() if k != "tokens_per_s"}
            for r in read_log(out)
            if r["kind"] == kind
        ]
        assert got == want, kind


# ---------------------------------------------------------------------------- FSDP trust boundary
def test_sharded_resume_verifies_the_signed_manifest_before_reading_any_pickle(
    tmp_path, monkeypatch
):
    """An FSDP checkpoint's dcp/.metadata is a pickle. A planted one (here: a pickle that
    would create a file when loaded), an edited manifest, a manifest signed under another
    key and a checkpoint without one are all refused before DCP reads anything."""
    import pickle

    from deltaflow.train.manifest import CheckpointVerifyError

    monkeypatch.setenv("DELTAFLOW_CHECKPOINT_KEY", "this user's key")
    out = tmp_path / "run"
    cfg = toy_config(steps=4, parallel="fsdp", out_dir=str(out), ckpt_every=2)
    Trainer(cfg.replace(steps=2), **_toy()).train()
    ckpt = out / "checkpoints" / "step_0000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert "dcp/.metadata" in manifest["files"] and "model.safetensors" in manifest["files"]

    class Planted:
        def __reduce__(self):
            return (Path(tmp_path / "pwned").write_text, ("code ran",))

    good_metadata = (ckpt / "dcp" / ".metadata").read_bytes()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(CheckpointVerifyError, match=r"dcp/.metadata does not match its SHA-256"):
        Trainer(cfg, **_toy())
    assert not (tmp_path / "pwned").exists()

    # The planted file with a manifest rewritten to match it: the signature gives it away.
    from deltaflow.train.manifest import sha256_file

    manifest["files"]["dcp/.metadata"] = sha256_file(ckpt / "dcp" / ".metadata")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointVerifyError, match="not signed with this user's checkpoint key"):
        Trainer(cfg, **_toy())
    assert not (tmp_path / "pwned").exists()

    # Genuine files, but signed under another key (another user or machine): refused, unless
    # the caller trusts the folder; no manifest at all: refused the same way.
    (ckpt / "dcp" / ".metadata").write_bytes(good_metadata)
    from deltaflow.train.manifest import write_manifest

    monkeypatch.setenv("DELTAFLOW_CHECKPOINT_KEY", "someone else's key")
    write_manifest(ckpt)
    monkeypatch.setenv("DELTAFLOW_CHECKPOINT_KEY", "this user's key")
    with pytest.raises(CheckpointVerifyError, match="--trust-checkpoint"):
        Trainer(cfg, **_toy())
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointVerifyError, match="has no manifest.json"):
        Trainer(cfg, **_toy())
    trusted = Trainer(cfg, trust_checkpoint=True, **_toy())
    assert trusted.step == 2
    trusted.train()  # and its own checkpoints are signed again, so a plain resume verifies
    assert Trainer(cfg.replace(steps=6), **_toy()).step == 4


def test_manifest_catches_a_truncated_file_and_a_key_file_is_made_once(tmp_path, monkeypatch):
    from deltaflow.train.manifest import checkpoint_key, key_path

    monkeypatch.delenv("DELTAFLOW_CHECKPOINT_KEY", raising=False)
    monkeypatch.setenv("DELTAFLOW_CHECKPOINT_KEY_FILE", str(tmp_path / "keys" / "k"))
    key = checkpoint_key()
    assert len(key) == 64 and checkpoint_key() == key
    assert key_path().stat().st_mode & 0o777 == 0o600
    model, _ = make()
    path = save_checkpoint(tmp_path / "run", model=model, optimizer=None, step=1, config={})
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors does not match its SHA-256"):
        load_checkpoint(path, model=make()[0], restore_rng=False)
