"""GPU kernel benchmark: deltaflow Triton vs flash-linear-attention (fla) vs deltaflow's torch
backend, same run, same GPU, medians of ``triton.testing.do_bench``.

    python benchmarks/kernels.py [--out benchmarks/results] [--skip-torch] [--rounds 2]
    python benchmarks/kernels.py --smoke     # CPU, Triton interpreter, tiny shapes, no fla (CI)

Every Triton rule's forward at the shapes of ``RULE_SHAPES``, delta with decay against fla at
every shape (forward, forward + backward), and decode. ``--rounds`` interleaves the whole list
that many times (each number is the median of the rounds' medians), so that a clock or thermal
drift during the run shows as spread instead of as a difference between implementations.
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
import statistics
from pathlib import Path

from _common import copy_bandwidth, git_commit, load_fla, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

import torch  # noqa: E402
import triton  # noqa: E402

from deltaflow import delta_rule as _delta_rule  # noqa: E402
from deltaflow import delta_rule_step  # noqa: E402
from deltaflow.rules import triton_rules  # noqa: E402

# no host sync per call: time the kernels as a training loop runs them
delta_rule = functools.partial(_delta_rule, check_values=False)

SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 32, 64), (8, 2048, 32, 256)]
RULE_SHAPES = [(8, 4096, 16, 128), (16, 2048, 32, 64)]  # every Triton rule's forward here
DECODE_BATCHES = [1, 64, 256]
SMOKE_SHAPES = [(1, 65, 2, 32)]
SMOKE_DECODE_BATCHES = [1]
DEVICE = "cuda"


def inputs(B, T, H, D, dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, T, H, D, device=DEVICE, dtype=dtype, generator=g)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, D, device=DEVICE, generator=g), dim=-1
    ).to(dtype)
    v = torch.randn(B, T, H, D, device=DEVICE, dtype=dtype, generator=g)
    beta = torch.rand(B, T, H, device=DEVICE, dtype=dtype, generator=g)
    log_decay = (-0.05 * torch.rand(B, T, H, device=DEVICE, generator=g)).to(dtype)
    xs = [q, k, v, beta, log_decay]
    if grad:
        xs = [x.requires_grad_(True) for x in xs]
    return xs


def bench(fn) -> float:
    if DEVICE == "cpu":  # smoke: run once, the time means nothing
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measurements(fla, skip_torch: bool, shapes, decode_batches):
    """(kind, shape, impl, rule, bytes or None, the function to time), in the order they run."""
    for B, T, H, D in shapes:
        shape = [B, T, H, D]
        q, k, v, beta, ld = inputs(B, T, H, D)
        # Fewest bytes a forward must move: read q, k, v, beta, log α once, write o once.
        nbytes = (
            sum(x.numel() * x.element_size() for x in (q, k, v, beta, ld))
            + v.numel() * v.element_size()
        )
        # every rule where (B, H, D) is a rule shape's: the warm-up's short T compiles the same
        every_rule = any((B, H, D) == (b, h, d) for b, _, h, d in RULE_SHAPES)
        rules = triton_rules() if every_rule or DEVICE == "cpu" else ["delta"]
        for rule in rules:
            yield (
                "forward",
                shape,
                "deltaflow-triton",
                rule,
                nbytes,
                (
                    lambda rule=rule, q=q, k=k, v=v, beta=beta, ld=ld: delta_rule(
                        q, k, v, beta, rule=rule, log_decay=ld, backend="triton"
                    )
                ),
            )
        if fla is not None:
            yield (
                "forward",
                shape,
                "fla",
                "delta",
                nbytes,
                (lambda q=q, k=k, v=v, beta=beta, ld=ld: fla[0](q, k, v, ld.float(), beta)),
            )
        if not skip_torch:
            yield (
                "forward",
                shape,
                "deltaflow-torch",
                "delta",
                nbytes,
                (
                    lambda q=q, k=k, v=v, beta=beta, ld=ld: delta_rule(
                        q, k, v, beta, log_decay=ld, backend="torch"
                    )
                ),
            )
        qg, kg, vg, bg, lg = inputs(B, T, H, D, grad=True)
        do = torch.randn_like(vg)

        def fwd_bwd_ours(qg=qg, kg=kg, vg=vg, bg=bg, lg=lg, do=do):
            o, _ = delta_rule(qg, kg, vg, bg, log_decay=lg, backend="triton")
            o.backward(do)

        yield "forward+backward", shape, "deltaflow-triton", "delta", None, fwd_bwd_ours
        # fla's D=256 backward autotunes for minutes (longer than a device call): not timed
        if fla is not None and D <= 128:

            def fwd_bwd_fla(qg=qg, kg=kg, vg=vg, bg=bg, lg=lg, do=do):
                o, _ = fla[0](qg, kg, vg, lg, bg)
                o.backward(do)

            yield "forward+backward", shape, "fla", "delta", None, fwd_bwd_fla

    H, D = (16, 128) if DEVICE == "cuda" else (2, 32)
    for B in decode_batches:
        q, k, v, beta, ld = inputs(B, 1, H, D)
        state = torch.randn(B, H, D, D, device=DEVICE)
        nbytes = 2 * state.numel() * 4  # the state is read and written once per token
        yield (
            "decode",
            [B, 1, H, D],
            "deltaflow-triton",
            "delta",
            nbytes,
            (
                lambda q=q, k=k, v=v, beta=beta, ld=ld, state=state: delta_rule_step(
                    q, k, v, beta, state, log_decay=ld
                )
            ),
        )
        if fla is not None:
            yield (
                "decode",
                [B, 1, H, D],
                "fla",
                "delta",
                nbytes,
                (
                    lambda q=q, k=k, v=v, beta=beta, ld=ld, state=state: fla[1](
                        q, k, v, ld.float(), beta=beta, initial_state=state, output_final_state=True
                    )
                ),
            )


def _warm_worker(index: int, workers: int) -> int:
    """Compile (run once, at a short T) every kernel the timed run launches; every
    ``workers``-th measurement from ``index``. Compiling is most of a first run's time, and the
    kernels specialise on heads and head sizes, not on T."""
    shapes = [(B, 128, H, D) for B, _, H, D in SHAPES]
    todo = list(measurements(None, True, shapes, DECODE_BATCHES))
    for *_, fn in todo[index::workers]:
        fn()
    torch.cuda.synchronize()
    return len(todo[index::workers])


def warm(workers: int) -> None:
    from concurrent.futures import ProcessPoolExecutor

    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, ctx) as pool:
        done = sum(pool.map(_warm_worker, range(workers), [workers] * workers))
    print(f"warm: compiled the kernels of {done} measurements in {workers} processes")


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (>= 1)")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument(
        "--warm-only",
        type=int,
        metavar="WORKERS",
        default=0,
        help="only compile every kernel the timed run needs, in this many processes, and exit",
    )
    args = parser.parse_args(argv)
    if args.warm_only:
        warm(args.warm_only)
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.smoke:
        DEVICE = "cpu"
        fla, shapes, batches, rounds = None, SMOKE_SHAPES, SMOKE_DECODE_BATCHES, 1
        print("smoke mode: CPU, Triton interpreter, fla skipped")
    else:
        if not torch.cuda.is_available():
            print("error: kernels.py needs a CUDA GPU; run it with --smoke on a CPU")
            return 2
        fla = load_fla(
            "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
            "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
        )
        shapes, batches, rounds = SHAPES, DECODE_BATCHES, args.rounds
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    bw = copy_bandwidth(DEVICE)
    commit = git_commit()
    print(f"{device}: copy bandwidth {bw / 1e12:.2f} TB/s, commit {commit}")
    times: dict[tuple, list[float]] = {}
    meta_of: dict[tuple, tuple] = {}
    for r in range(rounds):
        for kind, shape, impl, rule, nbytes, fn in measurements(
            fla, args.skip_torch or args.smoke, shapes, batches
        ):
            key = (kind, tuple(shape), impl, rule)
            times.setdefault(key, []).append(bench(fn))
            meta_of[key] = nbytes
            print(
                f"round {r}: {kind} {tuple(shape)} {impl} {rule} {times[key][-1]:.3f} ms",
                flush=True,
            )
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    records = []
    for (kind, shape, impl, rule), ms_list in times.items():
        ms = statistics.median(ms_list)
        rec = {
            "kind": kind,
            "shape": list(shape),
            "impl": impl,
            "rule": rule,
            "ms": ms,
            "rounds_ms": ms_list,
            "tokens_per_s": shape[0] * shape[1] / (ms * 1e-3),
        }
        nbytes = meta_of[(kind, shape, impl, rule)]
        if nbytes is not None:
            rec["bytes_per_s"] = nbytes / (ms * 1e-3)
            rec["fraction_of_copy_bw"] = rec["bytes_per_s"] / bw
        records.append(rec)
    fla_ms = {(r["kind"], tuple(r["shape"])): r["ms"] for r in records if r["impl"] == "fla"}
    for rec in records:
        ref = fla_ms.get((rec["kind"], tuple(rec["shape"])))
        if ref and rec["impl"] != "fla":
            rec["speed_vs_fla"] = ref / rec["ms"]

    out = Path(args.out)
    if args.smoke:
        print(f"smoke ok: {len(records)} measurements ran")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    tag = device.replace(" ", "_")
    meta = {
        "device": device,
        "copy_bandwidth_Bps": bw,
        "dtype": "bfloat16",
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rounds": rounds,
    }
    (out / f"kernels_{tag}.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    lines = [
        f"# Kernel benchmark: {device}, bf16, commit {commit}",
        f"copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}, "
        f"triton {triton.__version__}; median of {rounds} interleaved rounds of do_bench medians",
        "",
        "| kind | (B, T, H, D) | impl | rule | ms | rounds (ms) | tokens/s | % of copy BW "
        "| speed vs fla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        ratio = f"{r['speed_vs_fla']:.2f}x" if "speed_vs_fla" in r else ""
        frac = f"{100 * r['fraction_of_copy_bw']:.0f}%" if "fraction_of_copy_bw" in r else ""
        spread = "/".join(f"{x:.3f}" for x in r["rounds_ms"])
        lines.append(
            f"| {r['kind']} | {tuple(r['shape'])} | {r['impl']} | {r['rule']} | "
            f"{r['ms']:.3f} | {spread} | {r['tokens_per_s']:.3g} | {frac} | {ratio} |"
        )
    (out / f"kernels_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
