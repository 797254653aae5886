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
    the two cases that tell selective checkpointing from CUDA graphs, and the transformer's
    loss curves their own unit and report entry, which fails the report on its own."""
    cases = list(ct.CASES)
    units = ct.plan_units(
        ["delta", "softmax", "hybrid"], cases, True, ("gated_deltanet", "transformer")
    )
    assert units == [
        "grads:delta:layer,layer_unfused",
        "grads:delta:model_unfused,model_no_sac",
        "lm",
        "lm:transformer",
        "grads:softmax:model,model_no_sac,model_no_graphs",
        "grads:hybrid:model,model_no_sac,model_no_graphs",
        "grads:delta:model",
    ]
    report = {"gradients": {}, "units": {}}
    ct.merge(report, "lm", [{"unit": "lm", "ok": True}], 1.0)
    ct.merge(report, "lm:transformer", [{"unit": "lm:transformer", "ok": False}], 1.0)
    assert ct.failures(report, ["lm", "lm:transformer"]) == ["loss curves (transformer)"]
    args = ct.parse(["--smoke"])
    assert args.rules == ["delta", "softmax"] and args.lm_models == (
        "gated_deltanet",
        "transformer",
    )


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
