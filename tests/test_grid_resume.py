"""Grid runs cut off mid-run (a kill, or `deltaflow compare --time-limit`) continue from their
checkpoints with --resume and end as the uninterrupted runs do: same loss and eval curves,
same final metrics, same weights (CPU). Tiny real models on a tiny MQAR; each grid < 2 s.
"""

from __future__ import annotations

import json
import math
import tarfile
import time
import types
from pathlib import Path

import pytest
import torch
from _scripts import load_script
from safetensors.torch import load_file

import deltaflow.lab.runner as runner
import deltaflow.train.stopping as stopping_module
from deltaflow.cli import main
from deltaflow.lab import Preset, compare, expand_grid
from deltaflow.lab.report import run_details
from deltaflow.train import Trainer, latest_checkpoint, read_log

STEPS, LOG_EVERY = 20, 5


def tiny_preset() -> Preset:
    return Preset(
        name="tiny",
        description="test grid",
        base={
            "steps": STEPS,
            "batch_size": 8,
            "log_every": LOG_EVERY,
            "eval_every": 10,
            "eval_kwargs": {"num_examples": 16, "batch_size": 16},
            "model": {"num_layers": 1, "num_heads": 2, "hidden_size": 8, "backend": "torch"},
        },
        cells={
            "mqar": {
                "task": "mqar",
                "task_kwargs": {"seq_len": 16, "num_kv_pairs": 2, "vocab_size": 24},
            }
        },
        variants=["linear", "deltanet"],
        lrs=[3e-3],
        metric="accuracy",
    )


def specs():
    return expand_grid(tiny_preset(), device="cpu")


def run_dir(out: Path, spec) -> Path:
    return out / "runs" / runner.run_dir_name(spec.run_id)


def final_weights(out: Path, spec) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir(out, spec)) / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted grid: records by id, and the run directories (kept) for weights."""
    out = tmp_path_factory.mktemp("straight")
    records = runner.run_grid(specs(), out, progress=False, keep_run_dirs=True)
    return {r["id"]: r for r in records}, out


def same_result(record: dict, reference: dict) -> None:
    assert record["status"] == reference["status"] == "ok"
    assert record["curve"] == reference["curve"]  # every log step, pre- and post-resume
    assert [s for s, _ in record["curve"]] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert record["eval_curve"] == reference["eval_curve"]
    assert [e["step"] for e in record["eval_curve"]] == [10, 20]
    assert record["eval"] == reference["eval"] and record["train_loss"] == reference["train_loss"]


def stop_at_the_deadline(monkeypatch) -> None:
    """The trainers' clock says the deadline has passed (the grid's own clock does not, so the
    runs start): every run stops at its first log step of this invocation."""
    clock = types.SimpleNamespace(time=lambda: math.inf, perf_counter=time.perf_counter)
    monkeypatch.setattr(stopping_module, "time", clock)


# ------------------------------------------------------------------------- a kill mid-run
def test_killed_grid_resumes_each_run_from_its_checkpoint(tmp_path, monkeypatch, straight):
    by_id, _ = straight
    first, second = specs()
    real_step = Trainer.train_step

    def killed_at_step_12(self, step):
        if step == 12:  # like the 10-minute limit: the process dies, nothing is written
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", killed_at_step_12)
    with pytest.raises(KeyboardInterrupt):  # checkpoint at every log step: at 5 and 10
        runner.run_grid(specs(), tmp_path, progress=False, checkpoint_minutes=1e-9)
    assert latest_checkpoint(run_dir(tmp_path, first)).name == "step_0000010"
    assert not (tmp_path / "runs.jsonl").read_text()  # nothing finished, nothing recorded
    monkeypatch.setattr(Trainer, "train_step", real_step)

    records = runner.run_grid(specs(), tmp_path, progress=False, resume=True)
    for spec, record in zip((first, second), records):
        same_result(record, by_id[spec.run_id])
    # finished: one record per run in runs.jsonl; run directories deleted (not kept by default)
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [first.run_id, second.run_id]
    assert not any((tmp_path / "runs").iterdir())


# ------------------------------------------------------------------------- --time-limit
def test_time_limit_stops_runs_cleanly_and_resume_finishes_them(tmp_path, monkeypatch, straight):
    by_id, straight_out = straight
    stop_at_the_deadline(monkeypatch)
    for resume in (False, True):  # two invocations, each stops every run after 5 more steps
        rows, text = compare(
            tiny_preset(),
            tmp_path,
            device="cpu",
            progress=False,
            jobs=1,
            command="deltaflow x",
            time_limit_minutes=60,
            resume=resume,
        )
        assert rows == []  # no finished run: an empty table
    assert "**2 of 2 runs unfinished**" in text and "deltaflow x --resume" in text
    assert "**2 of 2 runs unfinished**" in (tmp_path / "results.md").read_text()
    assert not (tmp_path / "runs.jsonl").read_text()  # unfinished runs are not results
    for spec in specs():
        assert latest_checkpoint(run_dir(tmp_path, spec)).name == "step_0000010"
    monkeypatch.undo()

    records = runner.run_grid(specs(), tmp_path, progress=False, resume=True, keep_run_dirs=True)
    for spec, record in zip(specs(), records):
        same_result(record, by_id[spec.run_id])
        for name, tensor in final_weights(straight_out, spec).items():
            assert torch.equal(final_weights(tmp_path, spec)[name], tensor), name
        events = [r for r in read_log(run_dir(tmp_path, spec)) if r["kind"] == "event"]
        assert [(r["event"], r["step"]) for r in events] == [
            ("start", 0),
            ("stop", 5),
            ("resume", 5),
            ("stop", 10),
            ("resume", 10),
        ]
        assert record["seconds"] > 0


def test_without_resume_old_run_dirs_are_moved_aside_not_continued(tmp_path, monkeypatch):
    stop_at_the_deadline(monkeypatch)
    runner.run_grid(specs(), tmp_path, progress=False, deadline=time.time() + 3600)
    monkeypatch.undo()
    first = specs()[0]
    assert latest_checkpoint(run_dir(tmp_path, first)).name == "step_0000005"
    runner.run_grid(specs()[:1], tmp_path, progress=False, keep_run_dirs=True)
    events = [r["event"] for r in read_log(run_dir(tmp_path, first)) if r["kind"] == "event"]
    assert events == ["start"]  # trained from scratch: no stop, no resume
    prev = tmp_path / "runs.prev" / runner.run_dir_name(first.run_id)
    assert latest_checkpoint(prev).name == "step_0000005"


def test_runs_queued_past_the_deadline_do_not_start(tmp_path):
    records = runner.run_grid(specs(), tmp_path, progress=False, deadline=time.time() - 1)
    assert [(r["status"], r["step"]) for r in records] == [("partial", None)] * 2
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert runner.training_deadline(100.0, 9) == 100.0 + 540 - 54  # 10% reserve
    assert runner.training_deadline(100.0, 100) == 100.0 + 6000 - 60  # at most 60 s
    assert runner.training_deadline(100.0, 1) == 100.0 + 60 - 10  # at least 10 s


def test_compare_cli_time_limit_exits_0_and_says_how_to_continue(tmp_path, capsys):
    argv = ["compare", "--out", str(tmp_path), "--device", "cpu", "--no-progress"]
    argv += ["--variants", "deltanet", "--seeds", "1", "--lrs", "1e-3", "--steps", "3"]
    assert main([*argv, "--time-limit", "0.1"]) == 0  # 6 s minus the 10 s reserve: none start
    out = capsys.readouterr().out
    assert "runs unfinished** (time limit reached" in out
    assert "--time-limit 0.1 --resume" in out
    assert "[unfinished]" in out and "not started" in out
    for flag, value, message in [
        ("--time-limit", "0", "--time-limit must be > 0 minutes"),
        ("--checkpoint-every", "-1", "--checkpoint-every must be >= 0 minutes"),
    ]:
        assert main([*argv, "--dry-run", flag, value]) == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------------- report only
def test_report_only_tables_the_finished_runs_and_trains_nothing(tmp_path, straight):
    """A grid trained piece by piece (one variant per command) is reported as a whole with
    train=False: finished cells in the table, missing ones named as not trained, no file of a
    run touched and no run started."""
    by_id, _ = straight
    linear, deltanet = specs()
    only_linear = tiny_preset()
    only_linear.variants = ["linear"]
    compare(only_linear, tmp_path, device="cpu", progress=False, resume=True)
    runs_log = (tmp_path / "runs.jsonl").read_text()
    assert json.loads(runs_log)["eval"] == by_id[linear.run_id]["eval"]

    rows, table = compare(tiny_preset(), tmp_path, device="cpu", progress=False, train=False)
    assert [r["variant"] for r in rows] == ["linear"]  # deltanet has no finished run: no row
    assert rows[0]["value"] == by_id[linear.run_id]["eval"]["accuracy"]
    assert "runs_finished" not in rows[0] and "*" not in table.split("\n")[2]  # cell complete
    assert "**1 of 2 runs not trained yet**" in table

    # a cell whose lr sweep is half done: its best so far, marked
    wider = tiny_preset()
    wider.lrs = [3e-3, 1e-2]
    rows, table = compare(wider, tmp_path, device="cpu", progress=False, train=False)
    assert rows[0]["runs_finished"] == "1/2" and rows[0]["best_lr"] == 3e-3
    assert table.split("\n")[2].startswith(f"| linear | {rows[0]['value']:.3f}*")
    assert "**3 of 4 runs not trained yet**: a value marked * is the best" in table
    assert (tmp_path / "runs.jsonl").read_text() == runs_log  # not moved, not appended
    assert not (tmp_path / "runs" / runner.run_dir_name(deltanet.run_id)).exists()
    report = (tmp_path / "results.md").read_text()
    assert "report only: this invocation trained nothing" in report
    assert "cpu (" in report  # the device the finished run recorded, not a guess
    train_loss, valid_loss = (
        by_id[linear.run_id]["train_loss"],
        by_id[linear.run_id]["eval"]["loss"],
    )
    assert (
        f"last logged training loss {train_loss:.3f}-{train_loss:.3f} vs validation loss "
        f"{valid_loss:.3f}-{valid_loss:.3f}" in report
    )


def test_report_only_from_the_command_line(tmp_path, capsys):
    argv = ["compare", "--out", str(tmp_path), "--device", "cpu", "--no-progress"]
    argv += ["--variants", "deltanet", "--seeds", "1", "--lrs", "1e-3", "--steps", "3"]
    assert main([*argv, "--report-only"]) == 0  # nothing finished: an empty table
    out = capsys.readouterr().out
    assert "runs not trained yet" in out and "without --report-only, with --resume" in out
    assert not (tmp_path / "runs.jsonl").exists() or not (tmp_path / "runs.jsonl").read_text()


def test_gpu_runs_record_their_peak_memory(tmp_path, monkeypatch):
    """Each run's record carries its own peak GPU memory (the peak is reset per run, since a
    worker trains several): what planning how many runs share one GPU needs. Simulated."""
    calls = []
    monkeypatch.setattr(runner, "_uses_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    records = runner.run_grid(specs()[:1], tmp_path, progress=False)
    assert calls == ["reset"] and records[0]["peak_gpu_memory_gib"] == 3.0


def test_a_gpu_run_record_names_the_gpu(monkeypatch):
    """The record's device names the GPU model. Session 31's first GPU call lost every run of
    9 minutes to a typo here (torch.cuda.getdevice_name): CPU runs never reach that line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert runner.device_name("cuda") == "cuda (NVIDIA H200)"
    assert runner.device_name("auto") == "cuda (NVIDIA H200)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.device_name("auto").startswith("cpu (")


# ------------------------------------------------------------------------- across machines
def test_packed_checkpoints_continue_a_run_on_another_machine(tmp_path, monkeypatch, straight):
    """experiments/pack_resume.py packs the newest checkpoint of each unfinished run; unpacked by
    collect_device.py into another folder (the next fresh machine's carry), the runs continue
    from there and end as the uninterrupted runs do."""
    pack_resume = load_script("experiments/pack_resume.py")
    collect = load_script("experiments/collect_device.py")
    by_id, straight_out = straight
    device = tmp_path / "device" / "issue11" / "mad"  # a folder collect_device knows
    stop_at_the_deadline(monkeypatch)
    for _ in range(2):  # two calls: checkpoints at steps 5 and 10, the newest is 10
        runner.run_grid(specs(), device, progress=False, resume=True, deadline=time.time() + 3600)
    monkeypatch.undo()

    archive = tmp_path / "out" / "resume.tgz"
    archive.parent.mkdir()
    assert pack_resume.pack(device.parent, archive, max_bytes=1) == []  # nothing fits
    assert not archive.exists()
    packed = pack_resume.pack(device.parent, archive, max_bytes=2**30)
    assert sorted(p.name for p in packed) == sorted(run_dir(device, s).name for s in specs())
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert all(n.startswith("issue11/mad/runs/") for n in names)
    assert any("step_0000010" in n for n in names) and not any("step_0000005" in n for n in names)

    local = tmp_path / "here"
    first, second = specs()
    stale = run_dir(local / "issue11" / "mad", first) / "checkpoints" / "step_0000005"
    stale.mkdir(parents=True)  # an older restore of the same run: replaced, not merged
    restored = collect.restore_checkpoints(archive, local)
    assert len(restored) == 2 and not stale.exists()

    out = local / "issue11" / "mad"
    records = runner.run_grid(specs(), out, progress=False, resume=True, keep_run_dirs=True)
    for spec, record in zip(specs(), records):
        same_result(record, by_id[spec.run_id])
        for name, tensor in final_weights(straight_out, spec).items():
            assert torch.equal(final_weights(out, spec)[name], tensor), name
        events = [r for r in read_log(run_dir(out, spec)) if r["kind"] == "event"]
        assert [(r["event"], r["step"]) for r in events][-1] == ("resume", 10)

    # collected: the directories of runs finished since leave the carry (here: the first)
    (out / "runs.jsonl").write_text("")
    results = tmp_path / "results"
    (results / "mad").mkdir(parents=True)
    (results / "mad" / "runs.jsonl").write_text(json.dumps(by_id[first.run_id]) + "\n")
    collect.prepare_carry(results, local / "issue11")
    assert not run_dir(out, first).exists() and run_dir(out, second).exists()


def test_committed_grids_keep_their_run_ids():
    """Run ids hash a run's whole config: a new TrainConfig field that only says how a run is
    executed (ckpt_minutes, compile) must not change them, or --resume and --report-only stop
    recognising every committed run (results/quick is the main job's committed grid)."""
    from deltaflow.lab import get_preset

    committed = Path(__file__).parents[1] / "results" / "quick" / "runs.jsonl"
    ids = {json.loads(line)["id"] for line in committed.read_text().splitlines() if line}
    assert ids == {s.run_id for s in expand_grid(get_preset("quick"), device="auto")}


def test_committed_zoology_grids_keep_their_run_ids():
    """mqar_512_zoology's committed records (issue 33) keep their ids now that TrainConfig has
    early_stop: a field that changes training, left out of ids at its old value (None)."""
    from deltaflow.lab import get_preset
    from deltaflow.lab.grid import LATER_FIELD_DEFAULTS

    assert LATER_FIELD_DEFAULTS["early_stop"] is None
    ids = set()
    for name in ("i33_mqar_zoology_attention", "i33_mqar_zoology_eager", "i33_mqar_zoology_pair"):
        committed = Path(__file__).parents[1] / "results" / "issue11" / name / "runs.jsonl"
        ids |= {json.loads(line)["id"] for line in committed.read_text().splitlines() if line}
    preset = get_preset("mqar_512_zoology")
    preset.seeds, preset.lrs = [0, 1, 2], [*preset.lrs, 1e-3]  # the commands' --seeds, --lrs
    specs = expand_grid(preset, device="cuda")
    assert len(ids) == 16 and ids <= {s.run_id for s in specs}
    # an early stop is another run: ids of their own
    stopped = expand_grid(preset, device="cuda", overrides={"early_stop": "accuracy>=0.99"})
    assert not {s.run_id for s in stopped} & {s.run_id for s in specs}


def test_a_grid_with_an_early_stop_records_where_each_run_stopped(tmp_path, straight):
    """--set early_stop=...: runs that reach it end finished ("ok") at that evaluation, and the
    record says where (None: the run trained every step)."""
    threads = torch.get_num_threads()  # threads=1 below is for the process: set back after
    try:
        _early_stop_grids(tmp_path, straight)
    finally:
        torch.set_num_threads(threads)


def _early_stop_grids(tmp_path, straight) -> None:
    overrides = {"early_stop": "loss<=1e9"}  # reached at the first evaluation (step 10 of 20)
    stopped = expand_grid(tiny_preset(), device="cpu", overrides=overrides)[:1]
    never = expand_grid(tiny_preset(), device="cpu", overrides={"early_stop": "loss<=1e-9"})[:1]
    (record,) = runner.run_grid(stopped, tmp_path / "a", progress=False, threads=1)
    assert record["status"] == "ok" and record["stopped_early_at"] == 10
    assert [e["step"] for e in record["eval_curve"]] == [10]
    assert record["curve"][-1][0] == 10 and record["config"]["early_stop"] == "loss<=1e9"
    (trained,) = runner.run_grid(never, tmp_path / "b", progress=False, threads=1)
    assert trained["status"] == "ok" and trained["stopped_early_at"] is None
    assert [e["step"] for e in trained["eval_curve"]] == [10, 20]
    # the report says where the runs ended (one budget or two)
    both = [record, trained]
    lines = run_details(tiny_preset(), stopped, both, both, train=False, seconds=0.0)
    assert (
        "early_stop loss<=1e-9, loss<=1e9: 1 of 2 runs stopped early, at steps 10-10; "
        "1 trained every step"
    ) in lines
    # --resume: the early-stopped run is a finished one (its record kept, nothing trained)
    (again,) = runner.run_grid(stopped, tmp_path / "a", progress=False, resume=True)
    assert again["stopped_early_at"] == 10
    # a grid without early_stop keeps records as before
    assert not [r for r in straight[0].values() if "stopped_early_at" in r]
