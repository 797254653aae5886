"""The context-parallel benchmark's own logic, without processes: the search for the largest
sequence that trains, the gradient comparison, the report. (Its CPU smoke run, which starts the
worker processes, is in benchmarks/multigpu.py's docstring.)"""

from __future__ import annotations

import argparse

import torch
from _scripts import load_script


def test_search_doubles_then_refines_in_eighths(tmp_path, monkeypatch):
    """1 GPU runs out of memory above 100k tokens; the CP phase times out at 512k tokens
    (which says nothing about memory: no refinement, a note instead)."""
    bench = load_script("benchmarks/context_parallel.py")
    limits = {1: 100_000, 2: 300_000}  # the longest T each setting fits
    phases = []

    def fake_phase(args, out, gpus, lengths, tag):
        phases.append((gpus, tag, list(lengths)))
        records = []
        for T in lengths:  # increasing; a real phase stops at its first failure
            if gpus == 2 and T >= 524288:
                records.append({"seq": T, "fits": None, "note": "timed out after 300 s"})
                break
            records.append({"seq": T, "fits": T <= limits[gpus], "peak_memory_gb": [1.0]})
            if T > limits[gpus]:
                break
        return records

    monkeypatch.setattr(bench, "_search_phase", fake_phase)
    args = argparse.Namespace(gpus=2, cp_search_start=32768, cp_search_max=2**21)
    rows = bench.search(args, tmp_path)
    assert phases[0] == (1, "doubling", [32768 * 2**i for i in range(7)])
    assert phases[1][:2] == (1, "refine")
    assert all(65536 < T < 131072 and T % 2048 == 0 for T in phases[1][2])
    one, cp = rows
    assert one["largest_seq"] == max(T for T in phases[1][2] if T <= 100_000)
    assert one["smallest_failed"] == min(T for T in phases[1][2] if T > 100_000)
    assert cp["largest_seq"] == 262144 and "timed out" in cp["note"]
    assert "smallest_failed" not in cp and [p[1] for p in phases if p[0] == 2] == ["doubling"]
    report = {
        "device": "test",
        "torch": torch.__version__,
        "commit": "x",
        "setup": dict(
            gpus=2,
            layers=2,
            hidden=8,
            heads=1,
            head_dim=8,
            vocab=9,
            steps=1,
            warmup=0,
            checkpointing=False,
        ),
        "search": rows,
    }
    text = bench.markdown(report)
    assert f"| 1 | {one['largest_seq']:,} |" in text and "x longer than 1 GPU" in text


def test_gradient_comparison():
    bench = load_script("benchmarks/context_parallel.py")
    ref = {"a": torch.ones(4), "b": torch.full((2,), 2.0)}
    same = bench.compare_gradients({k: v.clone() for k, v in ref.items()}, ref)
    assert same["relative_l2_error"] == 0 and abs(same["cosine"] - 1) < 1e-12
    off = bench.compare_gradients({"a": torch.ones(4), "b": torch.full((2,), 2.2)}, ref)
    assert off["worst_tensor"] == "b" and abs(off["worst_tensor_relative_error"] - 0.1) < 1e-6
