"""GPU kernel benchmark: deltaflow Triton vs flash-linear-attention (fla) vs deltaflow's torch
backend, same run, same GPU, medians of ``triton.testing.do_bench``.

    python benchmarks/kernels.py [--out benchmarks/results] [--skip-torch] [--rules-only]

Writes ``kernels_<device>.json`` and ``kernels_<device>.md`` with device, dtype and commit.
fla's gated backward is refused on Hopper with Triton < 3.7.1 (fla issue #640); its guard is
forced here for timing only (fla's gradients are not used for anything).
"""

# Closures below are timed at once inside their loop iteration, so late binding is harmless.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import functools
import json
import subprocess
from pathlib import Path

import torch
import triton

from deltaflow import delta_rule as _delta_rule
from deltaflow import delta_rule_step
from deltaflow.rules import RULES

# no host sync per call: time the kernels as a training loop runs them
delta_rule = functools.partial(_delta_rule, check_values=False)

SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 32, 64)]
DECODE_BATCHES = [1, 64, 256]


def load_fla():
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # noqa: BLE001 - report and go on without fla
        print(f"fla not available: {e!r}")
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: see the module docstring
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def copy_bandwidth() -> float:
    x = torch.empty(2**29, dtype=torch.uint8, device="cuda")  # 512 MiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)  # bytes read + written per second


def inputs(B, T, H, D, dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1
    ).to(dtype)
    v = torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=g)
    beta = torch.rand(B, T, H, device="cuda", dtype=dtype, generator=g)
    log_decay = (-0.05 * torch.rand(B, T, H, device="cuda", generator=g)).to(dtype)
    xs = [q, k, v, beta, log_decay]
    if grad:
        xs = [x.requires_grad_(True) for x in xs]
    return xs


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    fla = load_fla()
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"{device}: copy bandwidth {bw / 1e12:.2f} TB/s, commit {commit}")
    records = []

    def record(kind, shape, impl, ms, nbytes=None, rule="delta"):
        tokens = shape[0] * shape[1]
        rec = {
            "kind": kind,
            "shape": shape,
            "impl": impl,
            "rule": rule,
            "ms": ms,
            "tokens_per_s": tokens / (ms * 1e-3),
        }
        if nbytes is not None:
            rec["bytes_per_s"] = nbytes / (ms * 1e-3)
            rec["fraction_of_copy_bw"] = rec["bytes_per_s"] / bw
        records.append(rec)
        print(json.dumps(rec))

    for B, T, H, D in SHAPES:
        shape = [B, T, H, D]
        q, k, v, beta, ld = inputs(B, T, H, D)
        # Fewest bytes a forward must move: read q, k, v, beta, log α once, write o once.
        nbytes = (
            sum(x.numel() * x.element_size() for x in (q, k, v, beta, ld))
            + v.numel() * v.element_size()
        )
        for rule in sorted(RULES) if (B, T) == (8, 4096) else ["delta"]:
            ms = bench(
                lambda rule=rule: delta_rule(
                    q, k, v, beta, rule=rule, log_decay=ld, backend="triton"
                )
            )
            record("forward", shape, "deltaflow-triton", ms, nbytes, rule)
        if fla is not None:
            ms = bench(lambda: fla[0](q, k, v, ld.float(), beta))
            record("forward", shape, "fla", ms, nbytes)
        if not args.skip_torch:
            ms = bench(lambda: delta_rule(q, k, v, beta, log_decay=ld, backend="torch"))
            record("forward", shape, "deltaflow-torch", ms, nbytes)

        qg, kg, vg, bg, lg = inputs(B, T, H, D, grad=True)
        do = torch.randn_like(vg)

        def fwd_bwd_ours():
            o, _ = delta_rule(qg, kg, vg, bg, log_decay=lg, backend="triton")
            o.backward(do)

        record("forward+backward", shape, "deltaflow-triton", bench(fwd_bwd_ours))
        if fla is not None:

            def fwd_bwd_fla():
                o, _ = fla[0](qg, kg, vg, lg, bg)
                o.backward(do)

            record("forward+backward", shape, "fla", bench(fwd_bwd_fla))
        torch.cuda.empty_cache()

    H, D = 16, 128
    for B in DECODE_BATCHES:
        q, k, v, beta, ld = inputs(B, 1, H, D)
        state = torch.randn(B, H, D, D, device="cuda")
        nbytes = 2 * state.numel() * 4  # the state is read and written once per token
        ms = bench(lambda: delta_rule_step(q, k, v, beta, state, log_decay=ld))
        record("decode", [B, 1, H, D], "deltaflow-triton", ms, nbytes)
        if fla is not None:
            ms = bench(
                lambda: fla[1](
                    q, k, v, ld.float(), beta=beta, initial_state=state, output_final_state=True
                )
            )
            record("decode", [B, 1, H, D], "fla", ms, nbytes)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.replace(" ", "_")
    meta = {
        "device": device,
        "copy_bandwidth_Bps": bw,
        "dtype": "bfloat16",
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    (out / f"kernels_{tag}.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    fla_ms = {(r["kind"], tuple(r["shape"])): r["ms"] for r in records if r["impl"] == "fla"}
    lines = [
        f"# Kernel benchmark: {device}, bf16, commit {commit}",
        f"copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}, "
        f"triton {triton.__version__}; medians of do_bench",
        "",
        "| kind | (B, T, H, D) | impl | rule | ms | tokens/s | % of copy BW | fla / this |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        ref = fla_ms.get((r["kind"], tuple(r["shape"])))
        ratio = f"{ref / r['ms']:.2f}x" if ref else ""
        frac = f"{100 * r['fraction_of_copy_bw']:.0f}%" if "fraction_of_copy_bw" in r else ""
        lines.append(
            f"| {r['kind']} | {tuple(r['shape'])} | {r['impl']} | {r['rule']} | "
            f"{r['ms']:.3f} | {r['tokens_per_s']:.3g} | {frac} | {ratio} |"
        )
    (out / f"kernels_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
