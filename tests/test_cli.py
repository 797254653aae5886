"""The `deltaflow` CLI and the compare lab, end to end on tiny real tasks and models."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

import deltaflow.lab.runner as runner
from deltaflow.cli import build_parser, main
from deltaflow.lab import Preset, compare, expand_grid, select_best
from deltaflow.lab.report import results_table
from deltaflow.train import latest_checkpoint, read_log

TINY_MODEL = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"]
TINY_MQAR = ["--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"]
FAST = ["--device", "cpu", "--no-progress", "--log-every", "1", "--batch-size", "8"]
EVAL = ["--set", "eval_kwargs={num_examples: 32, batch_size: 32}"]


def test_train_eval_resume_roundtrip(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *TINY_MQAR, "--rule", "efla", "--decay", *TINY_MODEL, *FAST, *EVAL]
    assert main([*args, "--steps", "3", "--ckpt-every", "2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 3 and 0 <= summary["eval"]["accuracy"] <= 1
    assert latest_checkpoint(out).name == "step_0000003"
    saved = yaml.safe_load((out / "run_config.yaml").read_text())
    assert saved["model"]["rule"] == "efla" and saved["model"]["use_decay"] is True
    # Asking for more steps of the finished run extends it from step 3.
    assert main([*args, "--steps", "5", "--out", str(out)]) == 0
    capsys.readouterr()
    events = [r for r in read_log(out) if r["kind"] == "event"]
    assert [e["event"] for e in events] == ["start", "extend"] and events[1]["step"] == 3
    assert [r["step"] for r in read_log(out) if r["kind"] == "train"] == [1, 2, 3, 4, 5]

    saved_to = tmp_path / "results" / "eval.json"
    argv = ["eval", str(out), "--device", "cpu", "--json", "--num-examples", "16"]
    assert main([*argv, "--batch-size", "4", "--output", str(saved_to)]) == 0
    captured = capsys.readouterr()
    metrics = json.loads(captured.out)
    assert {"accuracy", "scaled_accuracy", "loss"} <= set(metrics)
    assert metrics["num_scored"] == 16 * 2  # 16 examples x 2 queries: the override took effect
    assert json.loads(saved_to.read_text()) == metrics  # --output
    assert "eval mqar valid:   0%|" in captured.err  # the progress bar, with its total
    assert main([*argv, "--no-progress"]) == 0
    assert "eval mqar" not in capsys.readouterr().err


def test_config_file_flags_and_set_precedence(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "task": "mqar",
                "task_kwargs": {"seq_len": 64, "num_kv_pairs": 4},
                "model": {"rule": "delta", "hidden_size": 64},
                "lr": "1e-3",  # YAML 1.1 reads this as a string; must still work
                "steps": 100,
            }
        )
    )
    argv = ["train", "--config", str(cfg), "--rule", "longhorn", "--steps", "7"]
    argv += ["--set", "model.hidden_size=32", "--qk-norm", "l2,none", "--print-config"]
    assert main(argv) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"] == {"rule": "longhorn", "hidden_size": 32, "qk_norm": ["l2", "none"]}
    assert resolved["steps"] == 7 and resolved["lr"] == 1e-3
    assert resolved["task_kwargs"] == {"seq_len": 64, "num_kv_pairs": 4}


def test_shipped_config_files_parse(capsys):
    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs, "configs/*.yaml missing"
    for path in configs:
        assert main(["train", "--config", str(path), "--print-config"]) == 0, path
    capsys.readouterr()


def test_bad_input_is_a_clear_error_not_a_traceback(capsys):
    assert (
        main(["train", "--task", "nope", "--steps", "1", "--device", "cpu", "--no-progress"]) == 2
    )
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["train", "--steps", "0", "--print-config"]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--set", "no_equals_sign"])


def test_parser_has_every_subcommand():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"train", "eval", "generate", "compare"} <= set(sub.choices)
    try:
        import deltaflow.analysis.cli  # noqa: F401
    except ImportError:
        return
    assert "stability" in sub.choices


def test_generate_from_a_byte_level_lm(tmp_path, capsys):
    data = tmp_path / "text"
    data.mkdir()
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (data / "b.txt").write_text("a stitch in time saves nine. " * 40)
    out = tmp_path / "lm"
    argv = ["train", "--task", "lm", "--data-dir", str(data), "--seq-len", "32", *TINY_MODEL]
    argv += [
        "--task-arg",
        f"cache_dir={tmp_path / 'cache'}",
        "--steps",
        "2",
        *FAST,
        "--out",
        str(out),
    ]
    argv += ["--set", "eval_kwargs={num_examples: 4}"]
    assert main(argv) == 0
    capsys.readouterr()
    argv = ["generate", str(out), "--prompt", "the quick", "--max-new-tokens", "12"]
    assert main([*argv, "--device", "cpu", "--num-samples", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("--- sample") == 2 and text.count("the quick") == 2
    # greedy through the static decode step (the CUDA path, run eagerly) prints the same text
    greedy = [*argv, "--device", "cpu", "--temperature", "0"]
    assert main(greedy) == 0
    default_text = capsys.readouterr().out
    assert main([*greedy, "--decode-mode", "eager"]) == 0
    assert capsys.readouterr().out == default_text
    # greedy decoding through the cache equals greedy decoding by full forwards
    import torch

    from deltaflow.cli.common import _load_trained
    from deltaflow.lab.generate import sample

    _, model, _ = _load_trained(str(out), "cpu")
    ids = torch.tensor([[116, 104, 101, 32, 113]])
    cached = sample(model, ids, 6, temperature=0)
    full = ids
    for _ in range(6):
        full = torch.cat([full, model(input_ids=full).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, full)


# ---------------------------------------------------------------------------- the lab
def tiny_preset() -> Preset:
    return Preset(
        name="tiny",
        description="test grid",
        base={
            "steps": 2,
            "batch_size": 8,
            "log_every": 1,
            "eval_kwargs": {"num_examples": 16, "batch_size": 16},
            "model": {"num_layers": 1, "num_heads": 2, "backend": "torch"},
        },
        cells={
            "mqar": {
                "task": "mqar",
                "task_kwargs": {"seq_len": 16, "num_kv_pairs": 2, "vocab_size": 24},
            }
        },
        variants=["linear", "deltanet"],
        widths=[8, 16],
        lrs=[1e-3, 3e-3],
        metric="accuracy",
    )


def test_compare_grid_writes_table_plots_and_resumes(tmp_path, monkeypatch):
    preset = tiny_preset()
    rows, table = compare(
        preset, tmp_path, device="cpu", progress=False, command="deltaflow x", jobs=2
    )
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)  # 2 variants x 2 widths
    assert table.splitlines()[0] == "| model | d=8 | d=16 | params | best lr |"
    assert {r["best_lr"] for r in rows} <= {1e-3, 3e-3}
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 8
    assert (tmp_path / "metric_vs_width.png").stat().st_size > 1000
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    report = (tmp_path / "results.md").read_text()
    assert "metric_vs_width.png" in report and "deltaflow x" in report
    assert len(json.loads((tmp_path / "summary.json").read_text())) == 4

    def no_training(*a, **k):
        raise AssertionError("finished runs must not be retrained")

    real_run_one = runner.run_one
    monkeypatch.setattr(runner, "run_one", no_training)
    rows2, table2 = compare(preset, tmp_path, device="cpu", progress=False, resume=True)
    assert table2 == table
    # without resume (the default) every run is trained again; the old log is kept aside
    trained = []

    def counting(spec, **kw):
        trained.append(spec.run_id)
        return real_run_one(spec, **kw)

    monkeypatch.setattr(runner, "run_one", counting)
    compare(preset, tmp_path, device="cpu", progress=False, jobs=1)
    assert len(trained) == 8
    assert len((tmp_path / "runs.prev.jsonl").read_text().splitlines()) == 8
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 8
    # a changed grid point (steps) gets a new id: it is not silently reused
    ids = {s.run_id for s in expand_grid(preset, device="cpu")}
    assert not ids & {s.run_id for s in expand_grid(preset, device="cpu", steps=3)}
    # which GPU of a host runs it is not: a grid pinned to 'cuda:1' resumes a 'cuda' grid's runs
    on_gpu = [s.run_id for s in expand_grid(preset, device="cuda")]
    assert on_gpu == [s.run_id for s in expand_grid(preset, device="cuda:1")]
    assert not ids & set(on_gpu)


def _record(variant, lr, seed, value, status="ok", width=None):
    return {
        "variant": variant,
        "cell": "c",
        "width": width,
        "lr": lr,
        "seed": seed,
        "status": status,
        "eval": {"m": value, "m@8": value} if status == "ok" else {},
        "curve": [[1, 1.0]],
    }


def test_select_best_picks_lr_by_seed_aggregate_and_penalizes_failures():
    preset = Preset(
        "p", "", {}, {"c": {"task": "mqar"}}, ["a"], [0.1, 0.2], seeds=[0, 1], metric="m"
    )
    records = [
        _record("a", 0.1, 0, 0.9),
        _record("a", 0.1, 1, 0.1),  # mean 0.5, max 0.9
        _record("a", 0.2, 0, 0.6),
        _record("a", 0.2, 1, 0.6),  # mean 0.6, max 0.6
    ]
    (row,) = select_best(records, preset)
    assert row["best_lr"] == 0.2 and row["value"] == pytest.approx(0.6) and row["std"] == 0
    preset.seed_aggregate = "max"
    (row,) = select_best(records, preset)
    assert row["best_lr"] == 0.1 and row["value"] == pytest.approx(0.9)
    # best of seeds: every metric of the row comes from the best seed's run, not a per-metric
    # max over seeds (seed 1's larger loss must not appear)
    records[0]["eval"]["loss"], records[1]["eval"]["loss"] = 0.2, 3.0
    (row,) = select_best(records, preset)
    assert row["metrics"] == {"m": 0.9, "m@8": 0.9, "loss": 0.2}
    # a diverged seed makes its lr the worst under 'mean'
    preset.seed_aggregate = "mean"
    records[2] = _record("a", 0.2, 0, None, status="diverged")
    (row,) = select_best(records, preset)
    assert row["best_lr"] == 0.1 and row["value"] == pytest.approx(0.5)
    # every metric carries its seed spread; the table shows it beside non-headline metrics too
    assert row["metrics_std"]["m@8"] == pytest.approx(0.4)
    preset.table_metrics = ["m", "m@8"]
    assert "| a | 0.500 ± 0.400 | 0.500 ± 0.400 |" in results_table([row], preset)
    row["runs_finished"] = "2/3"  # an interim report marks every column of the cell
    assert "| a | 0.500 ± 0.400* | 0.500 ± 0.400* |" in results_table([row], preset)
    preset.table_metrics = None
    # lower is better (perplexity)
    preset.higher_is_better = False
    records = [_record("a", 0.1, 0, 30.0), _record("a", 0.2, 0, 20.0)]
    (row,) = select_best(records, preset)
    assert row["best_lr"] == 0.2 and row["metrics"]["m@8"] == 20.0
    (row,) = select_best([_record("a", 0.1, 0, None, status="diverged")], preset)
    assert math.isinf(row["value"])


def test_compare_cli_dry_run_and_list(capsys):
    assert main(["compare", "--dry-run", "--variants", "linear,deltanet", "--steps", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the main job (mqar_rebind: linear, deltanet; parity: deltanet) x 3 seeds, written
    # outside the committed results/, from scratch
    assert lines[-1] == "9 runs of 5 steps -> runs/compare/quick (from scratch)"
    assert main(["compare", "--dry-run", "--resume"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("(resuming)")
    assert main(["compare", "--list"]) == 0
    assert "mqar_512" in capsys.readouterr().out
    assert main(["compare", "--preset", "state_tracking", "--dry-run", "--seeds", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("45 runs")
    assert main(["compare", "--variants", "deltanett", "--dry-run"]) == 2
    assert "unknown variant 'deltanett' (did you mean 'deltanet'?)" in capsys.readouterr().err


def test_compare_cli_passes_every_knob_through(monkeypatch, tmp_path, capsys):
    import deltaflow.lab

    seen = {}

    def fake_compare(preset, out, **kw):
        seen.update(kw, preset=preset, out=out)
        return [], "| table |"

    monkeypatch.setattr(deltaflow.lab, "compare", fake_compare)
    argv = ["compare", "--preset", "mqar_512", "--out", str(tmp_path), "--jobs", "3"]
    argv += ["--threads", "2", "--note", "CPU-scale", "--widths", "16,32", "--lrs", "1e-2"]
    argv += ["--set", "model.num_layers=1", "--batch-size", "8", "--steps", "9", "--seeds", "2"]
    argv += ["--time-limit", "9", "--checkpoint-every", "0", "--keep-run-dirs"]
    assert main([*argv, "--device", "cpu", "--variants", "linear"]) == 0
    assert "| table |" in capsys.readouterr().out
    assert seen["jobs"] == 3 and seen["threads"] == 2 and seen["note"] == "CPU-scale"
    assert seen["time_limit_minutes"] == 9 and seen["checkpoint_minutes"] is None
    assert seen["keep_run_dirs"] and not seen["resume"]
    assert seen["overrides"] == {"model": {"num_layers": 1}, "batch_size": 8}
    assert seen["steps"] == 9 and seen["device"] == "cpu" and seen["out"] == tmp_path
    preset = seen["preset"]
    assert preset.widths == [16, 32] and preset.lrs == [1e-2] and preset.seeds == [0, 1]
    assert preset.variants == ["linear"]
    assert seen["command"].startswith("deltaflow compare --preset mqar_512")


def test_quick_preset_is_the_rebinding_contrast_and_margin_line_judges_every_seed():
    from deltaflow.lab import get_preset
    from deltaflow.lab.report import contrast_line

    preset = get_preset("quick")
    specs = expand_grid(preset, device="cpu")
    assert len(specs) == 12 and {s.seed for s in specs} == {0, 1, 2}
    by_cell = {c: {s.variant for s in specs if s.cell == c} for c in preset.cells}
    assert by_cell == {
        "mqar_rebind": {"linear", "deltanet"},
        "parity": {"deltanet", "deltanet_neg"},
    }
    assert all(
        s.config.task_kwargs["bindings_per_key"] > 1 for s in specs if s.cell == "mqar_rebind"
    )

    def row(variant, values):
        std = statistics.pstdev(values)
        return {
            "variant": variant,
            "cell": "mqar_rebind",
            "width": None,
            "std": std,
            "seed_values": dict(enumerate(values)),
        }

    good = [row("deltanet", [0.98, 0.99, 0.97]), row("linear", [0.2, 0.25, 0.15])]
    line = contrast_line(good, preset)
    assert "mqar_rebind: deltanet - linear per seed +0.780, +0.740, +0.820" in line
    assert "separated on every seed" in line and "parity" not in line  # no parity rows given
    # mean of +0.78, +0.74, +0.82 and t(0.975, 2) * sd / sqrt(3) = 4.303 * 0.04 / 1.732
    assert "mean +0.780 ± 0.099 (95% t-interval, deltanet ahead)" in line
    # one seed where the margin is within the spread: not a robust separation
    bad = [row("deltanet", [0.98, 0.99, 0.5]), row("linear", [0.2, 0.25, 0.45])]
    assert "NOT separated" in contrast_line(bad, preset)
