"""``early_stop``: a run whose evaluation reaches the threshold ends there, finished (final
checkpoint, final.json, an ``early_stop`` event, ``stopped_early_at``), and stays finished when
resumed; a threshold never reached trains every step; a bad rule is one line naming the field.
The toy task and model of test_train (the toy reaches accuracy 1.0 by step 20)."""

from __future__ import annotations

import json

import pytest
from test_config_errors import FAST, SMALL_EVAL, TINY, TINY_MQAR, one_line_error
from test_train import make, toy_config

from deltaflow.cli import main
from deltaflow.train import TrainConfig, Trainer, latest_checkpoint, read_log
from deltaflow.train.checkpoint import read_state_json


def _toy(seed: int = 0) -> dict:
    model, task = make(seed)
    return {"model": model, "task": task}


def _events(run) -> list[tuple[str, int]]:
    return [(r["event"], r["step"]) for r in read_log(run) if r["kind"] == "event"]


def test_reaching_the_threshold_ends_the_run_finished_and_resuming_trains_no_further(tmp_path):
    run = tmp_path / "run"
    cfg = toy_config(
        steps=40, eval_every=10, lr=5e-2, early_stop="accuracy>=0.99", out_dir=str(run)
    )
    trainer = Trainer(cfg, verbose=True, **_toy())
    summary = trainer.train()
    assert summary["finished"] and summary["step"] == summary["stopped_early_at"] == 20
    assert summary["eval"]["accuracy"] >= 0.99
    records = read_log(run)
    (event,) = [r for r in records if r.get("event") == "early_stop"]
    assert event["step"] == 20 and event["metric"] == "accuracy" and event["threshold"] == 0.99
    assert event["value"] == summary["eval"]["accuracy"] and event["rule"] == "accuracy>=0.99"
    # the evaluation that stopped it is the last one (no second one at the same step), and the
    # log's last training record is the stop's step
    assert [r["step"] for r in records if r["kind"] == "eval"] == [10, 20]
    assert max(r["step"] for r in records if r["kind"] == "train") == 20
    final = json.loads((run / "final.json").read_text())
    assert final["stopped_early_at"] == 20 and final["finished"] and final["step"] == 20
    state = read_state_json(latest_checkpoint(run))
    assert state["step"] == 20 and state["finished"] and state["stopped_early_at"] == 20

    # resumed with the same config: a finished run, nothing trained, the summary it recorded
    again = Trainer(cfg, **_toy(seed=3))
    assert again.step == 20 and again.stopped_early_at == 20
    summary = again.train()
    assert summary["already_finished"] and summary["stopped_early_at"] == 20
    assert again.step == 20 and latest_checkpoint(run).name == "step_0000020"
    assert max(r["step"] for r in read_log(run) if r["kind"] == "train") == 20
    # more steps cannot extend it (it would stop again): refused, --fork named
    with pytest.raises(ValueError, match="stopped early at step 20.*--fork"):
        Trainer(cfg.replace(steps=80), **_toy())
    # a fork without the early stop trains on from its final checkpoint to its steps
    fork = Trainer(
        cfg.replace(early_stop=None, out_dir=str(tmp_path / "fork")), fork_from=run, **_toy()
    )
    assert fork.step == 20
    summary = fork.train()
    assert summary["finished"] and summary["step"] == 40 and "stopped_early_at" not in summary


def test_a_threshold_never_reached_trains_every_step(tmp_path):
    run = tmp_path / "run"
    cfg = toy_config(steps=8, eval_every=4, early_stop="loss<=1e-9", out_dir=str(run))
    summary = Trainer(cfg, **_toy()).train()
    assert summary["finished"] and summary["step"] == 8 and "stopped_early_at" not in summary
    assert "early_stop" not in [e for e, _ in _events(run)]
    assert "stopped_early_at" not in json.loads((run / "final.json").read_text())
    # reached only at the last step: a run that trained every step, not an early stop
    summary = Trainer(toy_config(steps=8, eval_every=4, early_stop="loss<=1e9"), **_toy()).train()
    assert summary["stopped_early_at"] == 4
    summary = Trainer(toy_config(steps=4, eval_every=4, early_stop="loss<=1e9"), **_toy()).train()
    assert summary["step"] == 4 and "stopped_early_at" not in summary


def test_a_metric_the_evaluation_does_not_report_is_one_line(tmp_path):
    class NoAccuracy(type(make()[1])):
        def metrics(self, logits, batch):
            return {k: v for k, v in super().metrics(logits, batch).items() if k != "accuracy"}

    model, _ = make()
    cfg = toy_config(steps=8, eval_every=4, early_stop="accuracy>=0.5")
    with pytest.raises(ValueError, match="reports no 'accuracy' \\(it reports loss, ppl\\)"):
        Trainer(cfg, model=model, task=NoAccuracy()).train()


@pytest.mark.parametrize(
    "value, match",
    [
        ("acc>=0.9", "early_stop: unknown metric 'acc'; known: accuracy"),
        ("accuray>=0.9", "did you mean 'accuracy'"),
        ("accuracy>=high", "early_stop: the threshold 'high' is not a finite number"),
        ("accuracy>=nan", "not a finite number"),
        ("loss>=0.1", "early_stop: loss is lower-is-better: write loss<=X"),
        ("accuracy<=0.9", "early_stop: accuracy is higher-is-better: write accuracy>=X"),
        ("accuracy>0.9", "write accuracy>=X"),
        ("accuracy>=1.5", "accuracy is at most 1"),
        ("0.99", "early_stop must look like METRIC>=X or METRIC<=X"),
        (0.99, "early_stop must be a string"),
        ({"accuracy": 0.99}, "early_stop must be a string"),
    ],
)
def test_bad_rules_are_one_line_naming_the_field(value, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        TrainConfig(early_stop=value, eval_every=10)
    assert "\n" not in str(err.value)


def test_rules_are_written_one_way_and_checked_against_the_task():
    assert TrainConfig(early_stop=" accuracy >= 0.99 ", eval_every=5).early_stop == "accuracy>=0.99"
    rule = TrainConfig(early_stop="ppl<=30", eval_every=5, task="lm").early_stop_rule
    assert (rule.metric, rule.op, rule.threshold) == ("ppl", "<=", 30.0)
    assert rule.reached(29.0) and rule.reached(30.0) and not rule.reached(31.0)
    assert not rule.reached(float("nan"))
    with pytest.raises(ValueError, match="task 'lm' reports no 'accuracy'; it reports loss"):
        TrainConfig(early_stop="accuracy>=0.5", eval_every=5, task="lm")
    with pytest.raises(ValueError, match="task 'mqar' reports no 'ppl'"):
        TrainConfig(early_stop="ppl<=2", eval_every=5)
    with pytest.raises(ValueError, match="checked at each evaluation: set eval_every > 0"):
        TrainConfig(early_stop="accuracy>=0.9", eval_every=0)
    assert TrainConfig().early_stop is None and TrainConfig().early_stop_rule is None


def test_command_line_flag_set_and_errors(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY_MQAR, *TINY, *FAST, *SMALL_EVAL, "--steps", "6", "--eval-every", "2"]
    assert main([*argv, "--early-stop", "loss<=1e9", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "early stop at step 2/6: loss" in captured.err
    assert json.loads(captured.out)["stopped_early_at"] == 2
    assert main([*argv, "--early-stop", "loss<=1e9", "--out", str(out)]) == 0  # again: nothing
    assert "already finished at step 2: it stopped early (loss<=1e9)" in capsys.readouterr().err
    assert ("early_stop", 2) in _events(out) and len(
        list((out / "checkpoints").glob("step_*"))
    ) == 1
    one_line_error(capsys, ["train", "--early-stop", "acc>=0.9"], "early_stop: unknown metric")
    one_line_error(capsys, ["train", "--set", "early_stop=loss>=1"], "lower-is-better")
    one_line_error(
        capsys, ["train", "--set", "early_stop=accuracy>=0.9", "--eval-every", "0"], "eval_every"
    )
