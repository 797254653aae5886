"""The GPU model-training benchmark runs end to end in its CPU smoke mode (no fla)."""

from __future__ import annotations

import json
import re

from _scripts import load_script


def test_model_training_benchmark_cpu_smoke(tmp_path):
    bench = load_script("benchmarks/model_training.py")
    args = "--device cpu --layers 2 --seq 64 --batch 2 --steps 2 --warmup 1 --skip-fla"
    args += f" --hidden 64 --heads 2 --head-dim 32 --vocab 256 --top 5 --out {tmp_path}"
    report = bench.main(args.split())
    ours = report["results"]["deltaflow"]
    assert ours["tokens_per_s"] > 0 and ours["parameters"] > 0
    assert ours["profile"]["ranges"]["fwd/mixer"]["calls"] == 2
    assert "fla" not in report["results"] and report["ratio"] is None
    saved = json.loads((tmp_path / "model_training_cpu_B2_T64.json").read_text())
    assert saved["architecture"]["num_layers"] == 2
    assert "| deltaflow |" in (tmp_path / "model_training_cpu_B2_T64.md").read_text()
    assert (tmp_path / "model_training_cpu_B2_T64_profile.txt").stat().st_size > 0


def test_model_training_times_the_trainers_own_step(tmp_path):
    """--trainer: Trainer.train_step beside the benchmark's step (issue 31: the trainer's default
    step against the benchmark's), in the report and its table."""
    bench = load_script("benchmarks/model_training.py")
    args = "--device cpu --layers 1 --seq 32 --batch 2 --steps 1 --warmup 1 --skip-fla --trainer"
    args += f" --hidden 32 --heads 2 --head-dim 16 --vocab 64 --top 0 --out {tmp_path}"
    report = bench.main(args.split())
    trainer = report["results"]["deltaflow trainer"]
    assert trainer["tokens_per_s"] > 0 and trainer["config"]["trainer"]["grad_accum"] == 1
    assert set(report["results"]) == {"deltaflow trainer", "deltaflow"}
    assert report["ratio_trainer"] is None  # no fla here
    assert (
        "The trainer rows: Trainer.train_step"
        in (tmp_path / "model_training_cpu_B2_T32.md").read_text()
    )


def test_training_compile_policy():
    """compile='auto' compiles the blocks on CUDA, not on CPU; 'blocks' everywhere."""
    import pytest
    import torch

    from deltaflow.models.compile import resolve_compile

    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile("blocks", torch.device("cpu")) is True
    assert resolve_compile("blocks", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="compile must be"):
        resolve_compile("always", torch.device("cpu"))


def test_compiled_blocks_match_eager_on_cpu():
    """Fused projections + selective checkpointing + compiled blocks: same loss and gradients as
    today's eager op-by-op layer (float64, CPU)."""
    import torch

    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks

    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=61, hidden_size=32, num_layers=2, num_heads=2, rule="delta", use_decay=True
    )
    ref = DeltaFlowForCausalLM(cfg).double().train()
    fast = DeltaFlowForCausalLM(cfg).double().train()
    fast.load_state_dict(ref.state_dict())
    for m in fast.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = True
    compile_blocks(fast)
    ids = torch.randint(0, 61, (2, 37))
    grads = []
    for model in (ref, fast):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_compiled_blocks_evaluate_under_no_grad_on_cpu():
    """A compiled model's no-grad forward (the trainer's evaluation) traces the torch backend's
    forward-only path: its chunk copy used to be an ``out=`` op whose traced strides a view
    refused (BackendCompilerFailed at the first evaluation of `--compile blocks` on CPU)."""
    import torch

    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks

    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, rule="delta", use_decay=True
    )
    ref = DeltaFlowForCausalLM(cfg).eval()
    fast = DeltaFlowForCausalLM(cfg).eval()
    fast.load_state_dict(ref.state_dict())
    compile_blocks(fast, backend="aot_eager")  # the same trace as inductor, no C++ codegen
    ids = torch.randint(0, 61, (2, 70))
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_model_training_benchmark_times_the_triton_conv(tmp_path):
    """--triton-conv both: each deltaflow variant with the tap sum and with the Triton short conv
    (interpreter here), named apart, the switch recorded in the config and left as it was."""
    from deltaflow.layers import conv

    bench = load_script("benchmarks/model_training.py")
    args = "--device cpu --layers 1 --seq 16 --batch 1 --steps 1 --warmup 0 --skip-fla --top 0"
    args += f" --hidden 32 --heads 2 --head-dim 16 --vocab 64 --triton-conv both --out {tmp_path}"
    before = conv.TRITON_SHORT_CONV
    try:
        report = bench.main(args.split())
    finally:
        conv.TRITON_SHORT_CONV = before
    results = report["results"]
    assert set(results) == {"deltaflow", "deltaflow (triton conv)"}
    assert [r["config"]["triton_short_conv"] for r in results.values()] == [False, True]
    assert all(r["tokens_per_s"] > 0 for r in results.values())


def test_model_training_benchmark_times_the_conv_norm_switch(tmp_path):
    """--triton-conv-norm both: each deltaflow variant with and without conv.TRITON_CONV_NORM,
    named apart, the switch recorded in the config and left as it was."""
    from deltaflow.layers import conv

    bench = load_script("benchmarks/model_training.py")
    args = "--device cpu --layers 1 --seq 16 --batch 1 --steps 1 --warmup 0 --skip-fla --top 0"
    args += " --hidden 32 --heads 2 --head-dim 16 --vocab 64 --triton-conv-norm both"
    args += f" --out {tmp_path}"
    before = conv.TRITON_CONV_NORM
    try:
        report = bench.main(args.split())
    finally:
        conv.TRITON_CONV_NORM = before
    results = report["results"]
    assert set(results) == {"deltaflow", "deltaflow (triton conv norm)"}
    assert [r["config"]["triton_conv_norm"] for r in results.values()] == [False, True]
    assert all(r["tokens_per_s"] > 0 for r in results.values())


def test_gpu_time_finds_idle_gaps():
    """The profile's GPU idle time: the union of overlapping kernels is busy, the holes between
    them idle, the largest hole first with the kernels on either side."""
    import pytest

    gpu_time = load_script("benchmarks/_step_profile.py").gpu_time
    t = gpu_time([(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (30, 31, "d"), (100, 110, "e")])
    assert (t["span_ms"], t["busy_ms"], t["n_gaps"]) == pytest.approx((0.11, 0.033, 2))
    assert t["idle_ms"] == pytest.approx(0.077)
    assert t["gaps"][0] == {"ms": 0.069, "after": "d", "before": "e"}
    assert gpu_time([])["idle_ms"] == 0.0


def test_set_types_each_item_by_the_constant_it_names():
    """--set MODULE.NAME=VALUE (benchmarks/_settings.py): bool from 0/1/true/false, int, str
    (checked where its values are a fixed set), comma-separated and repeatable, the last of a
    name winning; a bad item is one line naming it and what was expected."""
    import importlib

    import pytest

    settings = load_script("benchmarks/_settings.py")
    parsed = settings.parse(
        ["conv.TRITON_CONV_NORM=true,conv_norm_triton.BWD_TILES=2", "conv_norm_triton.BWD_TILES=4"]
        + ["triton_backend.SAVE_FOR_BACKWARD=prepare, compile.CUDA_GRAPHS=0,"]
    )
    assert parsed == {
        "conv.TRITON_CONV_NORM": True,
        "conv_norm_triton.BWD_TILES": 4,
        "triton_backend.SAVE_FOR_BACKWARD": "prepare",
        "compile.CUDA_GRAPHS": False,
    }
    bad = {
        "foo.X=1": "no module 'foo', expected one of conv, ",
        "conv_norm_triton.NOPE=1": "conv_norm_triton has no setting 'NOPE', expected one of BWD_BT",
        "conv_norm_triton.BWD_BT=abc": "BWD_BT is an int (now 16), got 'abc'",
        "conv.TRITON_SHORT_CONV=yes": "is a bool (0/1/true/false; now False), got 'yes'",
        "triton_backend.SAVE_FOR_BACKWARD=all": "is one of none, prepare, states, t (now 't')",
        "loss.DEFAULT_CHUNK_SIZE=1": "expected one of FUSED_CE_BACKEND",  # bound at import
        "conv_norm_triton.BWD_BT": "is not MODULE.NAME=VALUE",
    }
    for item, message in bad.items():
        with pytest.raises(settings.SettingError, match=re.escape(message)):
            settings.parse([item])
    # the fixed sets hold today's values (the loss's from its own tuple)
    for key, choices in settings.CHOICES.items():
        module, name = key.split(".")
        assert getattr(importlib.import_module(settings.MODULES[module]), name) in choices
    assert (
        settings.CHOICES["loss.FUSED_CE_BACKEND"]
        == importlib.import_module("deltaflow.models.loss").BACKENDS
    )
    assert (
        settings.CHOICES["triton_backend.SAVE_FOR_BACKWARD"]
        == importlib.import_module("deltaflow.ops.triton_backend").SAVE_CHOICES
    )
    assert (
        settings.CHOICES["common.FP32_MIN_KEY_BLOCK_WHEN"]
        == importlib.import_module("deltaflow.ops.triton.common").FP32_MIN_KEY_BLOCK_CHOICES
    )


def test_model_training_applies_and_records_set(tmp_path, capsys):
    """--set before the runs: conv.TRITON_CONV_NORM=1 names the run as --triton-conv-norm on
    does (build_deltaflow starts from the switch as set), the launch setting is the module's
    during the run, the report keeps both under "settings"; a bad item exits with one line."""
    import pytest

    from deltaflow.layers import conv, conv_norm_triton

    bench = load_script("benchmarks/model_training.py")
    args = "--device cpu --layers 1 --seq 16 --batch 1 --steps 1 --warmup 0 --skip-fla --top 0"
    args += " --hidden 32 --heads 2 --head-dim 16 --vocab 64 --out " + str(tmp_path)
    args += " --set conv.TRITON_CONV_NORM=1 --set conv_norm_triton.BWD_TILES=2"
    before = conv.TRITON_CONV_NORM, conv_norm_triton.BWD_TILES
    try:
        report = bench.main(args.split())
        assert conv_norm_triton.BWD_TILES == 2
    finally:
        conv.TRITON_CONV_NORM, conv_norm_triton.BWD_TILES = before
    assert set(report["results"]) == {"deltaflow (triton conv norm)"}
    expected = {"conv.TRITON_CONV_NORM": True, "conv_norm_triton.BWD_TILES": 2}
    assert report["settings"] == expected
    saved = json.loads((tmp_path / "model_training_cpu_B1_T16.json").read_text())
    assert saved["settings"] == expected and "conv_launch" not in saved
    assert (
        "conv_norm_triton.BWD_TILES = 2." in (tmp_path / "model_training_cpu_B1_T16.md").read_text()
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--set", "conv_norm_triton.BWD_BT=abc"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "--set 'conv_norm_triton.BWD_BT=abc': BWD_BT is an int (now 16)" in err


def test_applied_settings_last_for_the_block_only():
    """_settings.applied (kernels.py --variant): the settings hold inside the block and the
    previous values come back after it, also when the block raises."""
    import pytest

    from deltaflow.ops import triton_backend

    settings = load_script("benchmarks/_settings.py")
    before = (triton_backend.SAVE_FOR_BACKWARD, triton_backend.SEGMENT_WAVES)
    items = settings.parse(
        ["triton_backend.SAVE_FOR_BACKWARD=states,triton_backend.SEGMENT_WAVES=5"]
    )
    with settings.applied(items):
        assert (triton_backend.SAVE_FOR_BACKWARD, triton_backend.SEGMENT_WAVES) == ("states", 5)
    assert (triton_backend.SAVE_FOR_BACKWARD, triton_backend.SEGMENT_WAVES) == before
    with pytest.raises(RuntimeError), settings.applied(items):
        raise RuntimeError
    assert (triton_backend.SAVE_FOR_BACKWARD, triton_backend.SEGMENT_WAVES) == before
