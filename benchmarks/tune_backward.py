"""Launch-setting sweep for the fused backward and the two-pass forward, one GPU call.

    python benchmarks/tune_backward.py [--out DIR] [--variants NAME,...] [--profile] [--rules]
    python benchmarks/tune_backward.py --smoke [--rules --profile]   # CPU, Triton interpreter

For each variant (a set of launch settings of ``deltaflow/ops/triton/*.py``): a correctness check
against the float64 chunked torch backend (bf16 and fp32, all six gradients, NaN-poisoned outputs),
then forward and forward+backward medians (``triton.testing.do_bench``) at the issue's three
shapes, with fla timed in the same run. ``--profile`` adds a per-kernel table of one
forward+backward at (8, 4096, 16, 128) from torch.profiler; ``--rules`` checks and times every
rule of the Triton rule table. ``--smoke``: the base variant at one tiny shape on the CPU
interpreter (fp16 for bf16; timings mean nothing), no fla, the report in a temporary folder.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

from _common import (
    bench_ms,
    device,
    device_name,
    git_commit,
    load_fla,
    low_precision,
    output_dir,
    smoke_env,
    smoke_requested,
)

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402
import triton  # noqa: E402

from deltaflow import delta_rule as _delta_rule  # noqa: E402
from deltaflow.ops import triton_backend as tb  # noqa: E402
from deltaflow.ops.triton import decode, dstates, gradients, outputs, prepare, states  # noqa: E402
from deltaflow.rules import triton_rules  # noqa: E402

# no host sync per call: time the kernels as a training loop runs them. The Triton backend by
# name: 'auto' picks it on CUDA anyway, but would pick torch on the CPU interpreter (--smoke).
delta_rule = functools.partial(_delta_rule, check_values=False, backend="triton")
# each launch setting lives beside the kernel it launches (FORWARD_MODE: the backend's choice)
STAGES = (prepare, states, dstates, outputs, gradients, decode)


def apply_setting(name: str, value) -> None:
    owner = next((m for m in (tb, *STAGES) if hasattr(m, name)), None)
    if owner is None:
        raise ValueError(f"unknown launch setting {name!r}")
    setattr(owner, name, value)


SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 32, 64)]
SHAPES_RUN = list(SHAPES)
# --smoke: every shape and check at one tiny shape (two chunks, ragged), on the CPU
SMOKE_SHAPE = (1, 70, 1, 16)
DEV = "cuda"  # main() sets "cpu" for --smoke
LOW = torch.bfloat16  # the low-precision dtype checked and timed (fp16 for --smoke)
BASE = {
    "FORWARD_MODE": "auto",
    "TWO_PASS_BV": 64,
    "STATES_WARPS": 4,
    "STATES_STAGES": 1,
    "BWD_STATES_BV": 64,
    "DSTATES_BV": 64,
    "DSTATES_WARPS": 4,
    "DSTATES_STAGES": 1,
    "GRADS_BV": 64,
    "GRADS_WARPS": 8,
}
VARIANTS = {
    "base": {},
    "grads4w": {"GRADS_WARPS": 4},
    "grads32": {"GRADS_BV": 32},
    "grads32_4w": {"GRADS_BV": 32, "GRADS_WARPS": 4},
    "dst32": {"DSTATES_BV": 32, "BWD_STATES_BV": 32},
    "stages2": {"DSTATES_STAGES": 2, "STATES_STAGES": 2},
    "tp32": {"TWO_PASS_BV": 32},
    "tp32_2w": {"TWO_PASS_BV": 32, "STATES_WARPS": 2},
    "tp32_8w": {"TWO_PASS_BV": 32, "STATES_WARPS": 8},
    "tp16": {"TWO_PASS_BV": 16},
    "fused_fwd": {"FORWARD_MODE": "fused"},
    "two_pass_fwd": {"FORWARD_MODE": "two_pass"},
}


def inputs(B, T, H, D, dtype=None, seed=0):
    dtype = dtype or LOW
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, T, H, D, device=DEV, generator=g).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=DEV, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, device=DEV, generator=g).to(dtype)
    beta = torch.rand(B, T, H, device=DEV, generator=g).to(dtype)
    ld = (-0.05 * torch.rand(B, T, H, device=DEV, generator=g)).to(dtype)
    return [x.requires_grad_(True) for x in (q, k.to(dtype), v, beta, ld)]


def grads_of(xs, backend, do, ds, s0=None, **kw):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    s0 = None if s0 is None else s0.detach().clone().requires_grad_(True)
    q, k, v, beta, ld = xs
    o, s = delta_rule(
        q,
        k,
        v,
        beta,
        log_decay=ld,
        initial_state=s0,
        output_final_state=True,
        backend=backend,
        **kw,
    )
    torch.autograd.backward([o, s], [do.to(o.dtype), ds])
    return [o, s] + [x.grad for x in xs] + ([] if s0 is None else [s0.grad])


def check(rule="delta", neg=False, shape=(2, 1000, 4, 128), dtype=None) -> float:
    """Worst ‖Δ‖/‖ref‖ over outputs and gradients against the float64 torch backend."""
    B, T, H, D = SMOKE_SHAPE if DEV == "cpu" else shape
    xs = inputs(B, T, H, D, dtype, seed=1)
    s0 = torch.randn(B, H, D, D, device=DEV)
    do = torch.randn(B, T, H, D, device=DEV)
    ds = torch.randn(B, H, D, D, device=DEV)
    ref = grads_of(
        [x.double() for x in xs],
        "torch",
        do.double(),
        ds.double(),
        s0.double(),
        rule=rule,
        negative_eigenvalues=neg,
    )
    tb.POISON_OUTPUTS = True
    try:
        got = grads_of(xs, "triton", do, ds, s0, rule=rule, negative_eigenvalues=neg)
    finally:  # a failed check must not poison the timings after it
        tb.POISON_OUTPUTS = False
    worst = 0.0
    for g, r in zip(got, ref):
        if g is None and r is None:  # an input the rule does not read (kaczmarz, linear: beta)
            continue
        g = torch.zeros_like(r) if g is None else g.double()
        r = torch.zeros_like(g) if r is None else r
        if not torch.isfinite(g).all():
            return float("nan")
        worst = max(worst, ((g - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def bench(fn) -> float:
    return bench_ms(fn, DEV, warmup=25, rep=100)


def synchronize() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def time_shape(shape, fla=None, rule="delta"):
    B, T, H, D = shape
    q, k, v, beta, ld = inputs(B, T, H, D)
    do = torch.randn_like(v)
    out = {}
    with torch.no_grad():
        out["fwd"] = bench(lambda: delta_rule(q, k, v, beta, rule=rule, log_decay=ld))
    print("  fwd", shape, out["fwd"], flush=True)

    def fb():
        o, _ = delta_rule(q, k, v, beta, rule=rule, log_decay=ld)
        o.backward(do)

    fb()
    synchronize()
    print("  one fwd+bwd done", flush=True)
    out["fwd_bwd"] = bench(fb)
    print("  fwd+bwd", shape, out["fwd_bwd"], flush=True)
    if fla is not None:
        ldf = ld.detach().float().requires_grad_(True)
        with torch.no_grad():
            out["fla_fwd"] = bench(lambda: fla(q, k, v, ldf, beta))

        def fbf():
            o, _ = fla(q, k, v, ldf, beta)
            o.backward(do)

        out["fla_fwd_bwd"] = bench(fbf)
    return out


def profile(shape=(8, 4096, 16, 128)) -> str:
    B, T, H, D = SMOKE_SHAPE if DEV == "cpu" else shape
    q, k, v, beta, ld = inputs(B, T, H, D)
    do = torch.randn_like(v)
    for _ in range(3 if DEV == "cuda" else 1):
        o, _ = delta_rule(q, k, v, beta, log_decay=ld)
        o.backward(do)
    synchronize()
    cuda = DEV == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(5 if cuda else 1):
            o, _ = delta_rule(q, k, v, beta, log_decay=ld)
            o.backward(do)
        synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=20)


def run_variant(name: str, fla) -> dict:
    settings = {**BASE, **VARIANTS[name]}
    for key, value in settings.items():
        apply_setting(key, value)
    rec = {"settings": settings}
    rec["err_bf16"] = check(dtype=LOW)
    rec["err_fp32"] = check(dtype=torch.float32, shape=(1, 300, 2, 128))
    print(name, "err bf16", rec["err_bf16"], "fp32", rec["err_fp32"], flush=True)
    for shape in SHAPES_RUN:
        rec[str(shape)] = time_shape(shape, fla if name == "base" else None)
        print(name, shape, rec[str(shape)], flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    rec["compiled"] = compiled_stats()
    return rec


def compiled_stats() -> list:
    """Registers, spills and shared memory of every kernel compiled so far in this process."""
    stats = []
    for module in STAGES:
        for name in dir(module):
            fn = getattr(module, name)
            try:
                caches = [c[0] for c in getattr(fn, "device_caches", {}).values()]
            except (TypeError, IndexError):
                continue
            for cache in caches:
                for compiled in cache.values():
                    stats.append(
                        f"{name}: regs {compiled.n_regs}, spills {compiled.n_spills}, "
                        f"shared {compiled.metadata.shared}, warps {compiled.metadata.num_warps}"
                    )
    print("\n".join(stats), flush=True)
    return stats


def main() -> None:
    global DEV, LOW
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="default benchmarks/results (smoke: temp)")
    parser.add_argument("--variants", default=None, help="default all (smoke: base)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rules", action="store_true", help="every Triton rule, first shape")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    parser.add_argument("--one-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="", help="e.g. 16x2048x32x64,8x4096x16x128")
    args = parser.parse_args()
    DEV, LOW = device(args.smoke), low_precision(args.smoke)
    if args.variants is None:
        args.variants = "base" if args.smoke else ",".join(VARIANTS)
    if args.smoke:  # one tiny shape stands for all three (and names the report's columns)
        SHAPES[:] = SHAPES_RUN[:] = [SMOKE_SHAPE]
    elif args.shapes:
        SHAPES_RUN[:] = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.smoke:
        print("fla skipped (--smoke)")
        fla = None
    else:
        fla = load_fla("fla.ops.gated_delta_rule:chunk_gated_delta_rule")
    device_label = device_name(DEV)
    commit = git_commit()
    print(f"{device_label}, commit {commit}, triton {triton.__version__}", flush=True)
    results = {"device": device_label, "commit": commit, "variants": {}}
    fla_times = {}
    if args.one:  # one variant in this process (a crash must not take the others with it)
        rec = run_variant(args.one, fla)
        Path(args.one_out).write_text(json.dumps(rec))
        return
    out = output_dir(args.out, args.smoke)
    for name in filter(None, args.variants.split(",")):
        tmp = out / f".variant_{name}.json"
        proc = subprocess.run(
            [sys.executable, __file__, "--one", name, "--one-out", str(tmp)]
            + (["--shapes", args.shapes] if args.shapes else [])
            + (["--smoke"] if args.smoke else []),
            timeout=400,
        )
        if proc.returncode != 0 or not tmp.exists():
            print(f"variant {name} failed (exit {proc.returncode})", flush=True)
            continue
        rec = json.loads(tmp.read_text())
        tmp.unlink()
        for s in SHAPES:
            if "fla_fwd" in rec[str(s)]:
                fla_times[s] = (rec[str(s)].pop("fla_fwd"), rec[str(s)].pop("fla_fwd_bwd"))
        results["variants"][name] = rec
    results["fla"] = {str(s): v for s, v in fla_times.items()}
    low = str(LOW).removeprefix("torch.")
    lines = [
        f"# Backward sweep: {device_label}, {low}, commit {commit}",
        "",
        f"| variant | err {low} | err fp32 | "
        + " | ".join(f"{s} fwd / fwd+bwd (x fla)" for s in SHAPES)
        + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in SHAPES) + " |",
    ]
    for name, rec in results["variants"].items():
        cells = []
        for s in SHAPES:
            if str(s) not in rec:
                cells.append("-")
                continue
            t = rec[str(s)]
            f = fla_times.get(s)
            ratio = f" ({f[0] / t['fwd']:.2f}x / {f[1] / t['fwd_bwd']:.2f}x)" if f else ""
            cells.append(f"{t['fwd']:.3f} / {t['fwd_bwd']:.3f} ms{ratio}")
        lines.append(
            f"| {name} | {rec['err_bf16']:.1e} | {rec['err_fp32']:.1e} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "fla: " + ", ".join(f"{s}: {v[0]:.3f} / {v[1]:.3f} ms" for s, v in fla_times.items()),
    ]
    if args.rules:
        for key, value in BASE.items():
            apply_setting(key, value)
        lines += [
            "",
            f"| rule | neg | err {low} | fwd ms | fwd+bwd ms |",
            "| --- | --- | --- | --- | --- |",
        ]
        for rule in triton_rules():  # the rules the Triton backend runs
            for neg in (False, True):
                if rule == "trapezoid" and neg:
                    continue
                err = check(rule=rule, neg=neg)
                # one timing per rule; none in smoke mode (the variants' timing covers the code)
                timed = not neg and not args.smoke
                t = time_shape(SHAPES[0], None, rule) if timed else {"fwd": 0, "fwd_bwd": 0}
                lines.append(
                    f"| {rule} | {neg} | {err:.1e} | {t['fwd']:.3f} | {t['fwd_bwd']:.3f} |"
                )
                print(lines[-1], flush=True)
    if args.profile:
        for key, value in BASE.items():
            apply_setting(key, value)
        table = profile()
        lines += [
            "",
            f"Per-kernel profile, one fwd+bwd x5 at {SHAPES[0]}:",
            "```",
            table,
            "```",
        ]
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_label).strip("_")
    (out / f"tune_backward_{tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"tune_backward_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = sorted(set(filter(None, args.variants.split(","))) - set(results["variants"]))
    if failed:  # the report is written; the exit status says the sweep is incomplete
        raise SystemExit(f"tune_backward: variants failed: {', '.join(failed)}")
    print(f"wrote {out / f'tune_backward_{tag}.md'}")


if __name__ == "__main__":
    main()
