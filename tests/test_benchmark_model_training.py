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
    saved = json.loads((tmp_path / "model_training_cpu.json").read_text())
    assert saved["architecture"]["num_layers"] == 2
    assert "| deltaflow |" in (tmp_path / "model_training_cpu.md").read_text()
    assert (tmp_path / "model_training_cpu_profile.txt").stat().st_size > 0
