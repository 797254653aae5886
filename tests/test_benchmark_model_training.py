"""The GPU model-training benchmark runs end to end in its CPU smoke mode (no fla)."""

from __future__ import annotations

import json

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
