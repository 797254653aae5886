"""benchmarks/check_training.py's verdict (issue 31, item 2): its tolerances, and that a failed
entry, failed loss curves or a unit that died or never finished fail the report (its exit status
decides whether CUDA_BLOCKS_VERIFIED flips). The script runs whole in tests/test_gpu_scripts.py."""

from __future__ import annotations

import pytest
from _scripts import load_script

ct = load_script("benchmarks/check_training.py")


def _entry(compiled_vs_eager=1e-7, compiled=0.02, eager=0.02, zero=0):
    return {
        "grad_err_compiled_vs_eager": compiled_vs_eager,
        "grad_l2mean_compiled_vs_fp32": compiled,
        "grad_l2mean_eager_vs_fp32": eager,
        # reported, not judged: a max-abs ratio far over 1.25 alone fails nothing
        "grad_err_compiled_vs_fp32": 10 * compiled,
        "grad_err_eager_vs_fp32": eager,
        "zero_grads_compiled": zero,
    }


@pytest.mark.parametrize(
    "entry, mode, ok",
    [
        (_entry(compiled_vs_eager=9e-4, compiled=9e-4, eager=0.0), "fp32", True),
        (_entry(compiled_vs_eager=2e-3, compiled=2e-3, eager=0.0), "fp32", False),
        (_entry(compiled_vs_eager=1.0, compiled=1.0, eager=0.0), "fp32", False),  # torch 2.11
        (_entry(compiled=0.024, eager=0.02), "autocast", True),
        (_entry(compiled=0.026, eager=0.02), "autocast", False),
        (_entry(compiled=0.01, eager=0.02), "bf16", True),
        (_entry(compiled=0.01, eager=0.02, zero=4), "bf16", False),  # model autocast, 2.11
    ],
)
def test_tolerances(entry, mode, ok):
    assert ct.entry_ok(entry, mode) is ok


def test_every_failure_fails_the_report():
    units = ct.plan_units(["delta", "efla"], list(ct.CASES), lm=True)
    assert units == [
        "grads:delta:layer,layer_unfused",
        "grads:delta:model_unfused,model_no_sac",
        "lm",
        "grads:delta:model",
        "grads:efla:model",
    ]
    assert ct.plan_units(["efla"], ["layer", "model"], lm=False) == ["grads:efla:model"]
    report = {"gradients": {}, "units": {}}
    ok_row = {"case": "model", "rule": "delta", "mode": "fp32", **_entry(), "ok": True}
    ct.merge(report, "grads:delta:model", [ok_row], 1.0)
    ct.merge(report, "lm", [{"unit": "lm", "ok": True, "seconds": 1.0}], 1.0)
    assert ct.failures(report, units[2:4]) == []
    assert ct.failures(report, units) == [
        f"{units[0]} (did not finish)",
        f"{units[1]} (did not finish)",
        f"{units[4]} (did not finish)",
    ]
    bad = {**ok_row, "rule": "efla", "mode": "bf16", "ok": False}
    ct.merge(report, "grads:efla:model", [bad], 1.0)
    report["units"]["grads:efla:model"]["exit"] = -9  # killed after its first row
    report["lm"]["ok"] = False
    assert ct.failures(report, units[2:]) == [
        "model/efla/bf16",
        "loss curves",
        "grads:efla:model (exit -9)",
    ]
    assert report["gradients"]["model"]["delta"]["fp32"]["ok"] is True


def test_softmax_attention_units_isolate_the_factors():
    """Session 31's Transformer gap: softmax attention (and a hybrid) get the model entry and
    the two cases that tell selective checkpointing from CUDA graphs; the transformer's runs
    (eager and each compiled variant) one unit each, merged into one report entry whose
    verdict fails the report on its own; the packed-documents cases their own units."""
    cases = list(ct.CASES)
    units = ct.plan_units(
        ["delta", "softmax", "hybrid"],
        cases,
        True,
        ("gated_deltanet", "transformer"),
        ("delta", "longhorn"),
    )
    runs = ["eager", "compiled", "compiled_no_graphs", "compiled_no_sac"]
    assert units == [
        "grads:delta:layer,layer_unfused",
        "grads:delta:model_unfused,model_no_sac",
        "lm",
        *[f"lm:transformer:{run}" for run in runs],
        "grads:softmax:model,model_no_sac,model_no_graphs",
        "grads:hybrid:model,model_no_sac,model_no_graphs",
        "grads:delta:model",
        "packed:delta",
        "packed:longhorn",
    ]
    report = {"gradients": {}, "units": {}}
    ct.merge(report, "lm", [{"unit": "lm", "ok": True}], 1.0)
    for run, val in zip(runs, (5.00, 5.01, 5.09, 4.99)):  # no_graphs: session 32's gap
        row = {"unit": f"lm:transformer:{run}", "val_loss": val, "losses": [4.0] * 60}
        row["compiled_blocks"] = run != "eager"
        ct.merge(report, row["unit"], [{**row, "final_train_loss": 4.0}], 1.0)
    entry = report["lm_transformer"]
    assert set(entry["runs"]) == set(runs)
    assert entry["val_loss_diff"] == pytest.approx(0.01)
    assert entry["compiled_no_graphs_val_loss_diff"] == pytest.approx(0.09)
    assert entry["compiled_no_sac_final_train_loss_diff"] == 0.0
    assert ct.failures(report, ["lm"]) == ["loss curves (transformer)"]
    ct.merge(report, "packed:delta", [{"unit": "packed:delta", "ok": True}], 1.0)
    ct.merge(report, "packed:longhorn", [{"unit": "packed:longhorn", "ok": False}], 1.0)
    assert ct.failures(report, ["lm", "packed:delta"]) == [
        "loss curves (transformer)",
        "packed (longhorn)",
    ]
    lines = ct.lm_check.summary(report) + ct.packed_check.summary(report)
    assert len(lines) == 6 and lines[3] == "transformer: ok False"
    assert lines[1].startswith("transformer compiled_no_graphs: validation loss 5.09 vs eager 5.0")
    assert lines[5].startswith("packed longhorn") and lines[5].endswith("ok False")
    args = ct.parse(["--smoke"])
    assert args.rules == ["delta", "softmax"] and args.lm_models == (
        "gated_deltanet",
        "transformer",
    )
    assert args.packed == ("delta", "longhorn") and args.lm_steps == 3
    assert ct.parse(["--packed", "none"]).packed == ()
    assert ct.parse([]).lm_steps is None  # gated DeltaNet 200, the transformer its preset's


@pytest.mark.parametrize(
    "eager, compiled, ok",
    [
        (5.00, 5.00, True),
        (5.00, 5.029, True),
        (5.00, 4.971, True),  # better by as much: within too
        (5.00, 5.031, False),
        (5.00, 4.969, False),  # a compiled run that differs either way is not eager's
        (4.98, 5.07, False),  # session 32, seed 0
        (5.00, None, False),  # the run failed or never finished
        (None, 5.00, False),
    ],
)
def test_transformer_verdict_is_on_validation_loss(eager, compiled, ok):
    """The transformer's criterion: |validation loss compiled - eager| <= VAL_TOL (0.03 nats),
    each compiled variant; a missing run fails it, whatever the others did."""
    assert ct.lm_check.VAL_TOL == 0.03
    assert ct.lm_check.val_within(eager, compiled) is ok
    runs = {"eager": {"val_loss": eager, "compiled_blocks": False}}
    for name in ("compiled", "compiled_no_graphs", "compiled_no_sac"):
        # the two others pass when eager is there
        runs[name] = {"val_loss": eager, "compiled_blocks": True}
    runs["compiled_no_sac"]["val_loss"] = compiled
    assert ct.lm_check.runs_verdict("transformer", runs)["ok"] is ok
    # a compiled run that fell back to eager (its log's event) judges nothing: it fails
    runs["compiled"]["reason"] = "compile: running the blocks eager instead: ..."
    assert ct.lm_check.runs_verdict("transformer", runs)["ok"] is False
    del runs["compiled"]
    assert ct.lm_check.runs_verdict("transformer", runs)["ok"] is False


def test_transformer_recipe_is_the_presets():
    """The transformer's runs train lm_corpus_1pass's own config (deltaflow compare's
    expand_grid): its steps, schedule, optimizer, model and batch, only the data paths, the
    logging and the one validation at the end set by the check; --smoke shrinks the shapes."""
    from deltaflow.lab.grid import expand_grid
    from deltaflow.lab.presets import PRESETS

    preset, variant = ct.lm_check.RECIPE
    lab = next(
        s.config.to_dict()
        for s in expand_grid(PRESETS[preset], shared="/shared")
        if s.variant == variant and s.seed == 0
    )
    args = ct.parse(["--lm-data", "/data/corpus", "--lm-tokenizer", "/t/gpt2.tiktoken"])
    data = ct.lm_check.recipe_config(args, None)
    assert data["steps"] == 431 and data["model"]["attn_every"] == 1  # today's preset
    set_here = ("task_kwargs", "log_every", "eval_every", "eval_lengths", "resume", "ckpt_minutes")
    same = [k for k in lab if k not in set_here]
    assert {k: data[k] for k in same} == {k: lab[k] for k in same}
    assert data["task_kwargs"] == {
        **lab["task_kwargs"],
        "data_dir": "/data/corpus",
        "tokenizer_path": "/t/gpt2.tiktoken",
    }
    assert data["eval_every"] == 0 and data["eval_lengths"] == [512] and data["log_every"] == 1
    assert data["eval_kwargs"] == {"num_examples": 256, "batch_size": 16}
    seeded = ct.lm_check.recipe_config(ct.parse([*args.forwarded, "--lm-seed", "2"]), None)
    assert seeded["seed"] == 2 and seeded["task_kwargs"]["seed"] == 2
    with pytest.raises(ValueError, match="--lm-seed 99"):
        ct.lm_check.recipe_config(ct.parse([*args.forwarded, "--lm-seed", "99"]), None)
    smoke = ct.lm_check.recipe_config(
        ct.parse(["--smoke", "--lm-data", "/c"]), ct.lm_check.SMOKE_LM
    )
    assert smoke["steps"] == 3 and smoke["batch_size"] == ct.lm_check.SMOKE_LM["batch_size"]
    assert smoke["model"]["hidden_size"] == ct.lm_check.SMOKE_LM["hidden_size"]
    assert smoke["lr"] == lab["lr"] and smoke["schedule"] == lab["schedule"]


@pytest.mark.parametrize(
    "row, ok",
    [
        (dict(compiled=True, compile_fallback=None, max_abs_loss_diff=6e-4), True),
        (dict(compiled=True, compile_fallback=None, max_abs_loss_diff=0.019), True),
        (dict(compiled=True, compile_fallback=None, max_abs_loss_diff=0.021), False),
        (dict(compiled=True, compile_fallback=None, max_abs_loss_diff=None), False),
        # session 32's torch backend on CUDA: fell back at its first compiled step
        (
            dict(compiled=False, compile_fallback="compile: running ...", max_abs_loss_diff=0.0),
            False,
        ),
        (dict(compiled=False, compile_fallback=None, max_abs_loss_diff=0.0), False),
    ],
)
def test_packed_verdict(row, ok):
    """A packed case passes only compiled to the end, no fallback, losses within PACKED_TOL."""
    assert ct.packed_check.PACKED_TOL == 0.02
    assert ct.packed_check.packed_ok(row) is ok


def test_packed_task_packs_another_document_count_each_step():
    task = ct.packed_check.PackedCopy()
    counts = [int(task.get_batch(4, step=s)["doc_starts"].sum()) for s in range(40)]
    assert counts[:3] == [4, 5, 6] and counts[32] == 4 and len(set(counts)) == 32


def test_draws_judge_means_over_one_compile(monkeypatch):
    """--draws: each draw's weights and batch go through the same eager and compiled modules;
    the entry holds the per-draw errors and is judged on their means (draw 0 is the one-draw
    entry). Tiny layer on the CPU interpreter, dynamo's eager backend."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    setup = ct.Setup(torch.device("cpu"), True, "eager")
    one = ct.check_entry("layer", "delta", "autocast", setup, draws=1)
    two = ct.check_entry("layer", "delta", "autocast", setup, draws=2)
    assert "per_draw" not in one and two["draws"] == 2
    for key, values in two["per_draw"].items():
        assert len(values) == 2
        assert values[0] == pytest.approx(one[key], rel=1e-6)
        if key != "grad_err_compiled_vs_eager":  # fp32's criterion: the worst draw
            assert two[key] == pytest.approx(sum(values) / 2)
    assert (
        two["per_draw"]["grad_err_eager_vs_fp32"][0] != two["per_draw"]["grad_err_eager_vs_fp32"][1]
    )
    assert two["ok"] == ct.entry_ok(two, "autocast")


def test_packed_unit_reports_a_fallback_and_its_traceback(tmp_path, monkeypatch):
    """A packed case whose compiled run falls back to eager at its first step (a dynamo
    backend that raises, as inductor does when it cannot generate a kernel) fails, with the
    fallback line and the error's traceback in its row (session 32's torch-backend case fell
    back on CUDA and its reason was not kept); the eager losses are the same run's."""
    import argparse

    def failing_backend(gm, example_inputs):
        raise RuntimeError("simulated inductor failure\nsecond line of the report")

    monkeypatch.setattr(ct.packed_check, "PACKED_STEPS", 3)
    args = argparse.Namespace(smoke=True, compile_backend=failing_backend)
    row = ct.packed_check.packed_row("packed:longhorn", args, tmp_path)
    assert row["compiled"] is False and row["ok"] is False
    assert "simulated inductor failure" in row["compile_fallback"]
    assert "RuntimeError" in row["fallback_traceback"]
    assert row["max_abs_loss_diff"] == 0.0 and row["logged"] == [3, 3]
    args.compile_backend = "eager"
    row = ct.packed_check.packed_row("packed:longhorn", args, tmp_path)
    assert row["compiled"] is True and row["ok"] is True and "fallback_traceback" not in row
