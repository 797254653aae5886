"""GPU kernel benchmark: deltaflow Triton vs flash-linear-attention (fla) vs deltaflow's torch
backend, same run, same GPU, medians of ``triton.testing.do_bench``.

    python benchmarks/kernels.py [--out benchmarks/results] [--skip-torch] [--rounds 2]
    python benchmarks/kernels.py --smoke     # CPU, Triton interpreter, tiny shapes, no fla (CI)
    python benchmarks/kernels.py --save-for-backward [--rounds 3]   # what the forward keeps
    python benchmarks/kernels.py --sequence-parallel [--rounds 3]   # segmented state passes
    python benchmarks/kernels.py --variant sp:triton_backend.SEQUENCE_PARALLEL_STATES=auto \
        --variant prep:triton_backend.SAVE_FOR_BACKWARD=prepare     # settings beside fla

``--variant NAME:ITEMS`` (repeatable; ITEMS as ``--set``'s) times delta's forward and forward +
backward at every shape again under those settings, interleaved with the default and fla in the
same rounds, as impl ``deltaflow-triton+NAME`` with its own ratio to fla. Forward + backward
returns the gradients (``torch.autograd.grad``) instead of adding them into the leaves' ``.grad``,
for every implementation.

``--save-for-backward``: instead of the table below, delta with decay's forward and forward +
backward at ``SAVE_SHAPES`` under each ``triton_backend.SAVE_FOR_BACKWARD`` value
(``triton_backend.SAVE_CHOICES``, "none" first), interleaved in one process, with the bytes
autograd keeps from the forward beyond the inputs, the peak memory of a forward + backward,
and the gradients' largest relative difference from "none" (benchmarks/NOTES.md, "Issue
31/32, session 16"). Writes
``kernels_save_<device>.json`` and ``.md``. ``--sequence-parallel``: the same table for
``triton_backend.SEQUENCE_PARALLEL_STATES`` "off" and "on" at ``SEQUENCE_PARALLEL_SHAPES``
(benchmarks/NOTES.md, "Issue 32, session 17"; gradients vs "off": rounding, not 0), written to
``kernels_seqpar_<device>.json`` and ``.md``.

Every Triton rule's forward at the shapes of ``RULE_SHAPES``, delta with decay against fla at
every shape (forward, forward + backward), and decode. ``--rounds`` interleaves the whole list
that many times (each number is the median of the rounds' medians), so that a clock or thermal
drift during the run shows as spread instead of as a difference between implementations.
Writes ``kernels_<device>.json`` and ``kernels_<device>.md`` with device, dtype and commit.
fla's gated backward is refused on Hopper with Triton < 3.7.1 (fla issue #640); its guard is
forced here for timing only (fla's gradients are not used for anything).

Warm-up (benchmarks/gpu_check.sh runs both beside the check, each in its own process):

    python benchmarks/kernels.py --warm-only 8   # compile our kernels on 8 processes, no GPU
    python benchmarks/kernels.py --warm-fla      # compile + autotune fla's at the timed shapes

Everything warm, the timed part is ~33 timings a round (every rule at the two RULE_SHAPES,
delta and fla at every shape, decode), each one ``do_bench`` of 25 ms warm-up + 100 ms of
repeats plus its setup: ~0.2 s, ~7 s a round, ~15 s for ``--rounds 2`` (each round prints
its seconds). Cold, the time is all compiling: our kernels (31 specializations, prepare's the
longest) and fla's autotuning (every config of every autotuned kernel compiled and timed, one
process: minutes). fla 0.6.0 creates every autotuner with ``cache_results=True``
(``fla.utils.env.autotune_cache_kwargs``: ``FLA_CACHE_RESULTS``, default 1), so Triton 3.6
writes each tuning result into its disk cache (``<kernel>.autotune.json``, keyed by the
kernel's source, its configs and its autotune key) and a later process reuses it without
timing anything: the ``--warm-fla`` process tunes, the timed run reads.
``TRITON_CACHE_AUTOTUNING=1`` turns the same on for autotuners created without the flag.
"""

# Closures below are timed at once inside their loop iteration, so late binding is harmless.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import _settings
from _common import copy_bandwidth, git_commit, load_fla, smoke_env, smoke_requested

# --warm-only traces launches (Triton's JIT intercepted, no GPU needed): the interpreter would
# run the kernels instead, so its smoke run leaves the interpreter off.
if smoke_requested() and not any(a.startswith("--warm-only") for a in sys.argv[1:]):
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
# --save-for-backward: one layer of the 400M model's step at B=8 T=2048 and at B=2 T=8192 (the
# forward's two-pass form either way: 8 x 8 x 2 programs < 132 SMs), and a shape whose forward
# is the fused one (the "states" mode then takes the two-pass form: its cost shows there).
SAVE_SHAPES = [(8, 2048, 8, 128), (2, 8192, 8, 128), (8, 4096, 16, 128)]
SMOKE_SAVE_SHAPES = [(1, 65, 2, 32)]
# --sequence-parallel: the state passes split across segments (issue 32) at the two shapes whose
# passes leave the H100 idle (32 programs on 132 SMs) and one that fills it (256 programs).
SEQUENCE_PARALLEL_SHAPES = [(2, 8192, 8, 128), (1, 32768, 16, 128), (8, 4096, 16, 128)]
SMOKE_SEQUENCE_PARALLEL_SHAPES = [(1, 200, 2, 32)]
SEQUENCE_PARALLEL_MODES = ("off", "on")
SMOKE_SHAPES = [(1, 65, 2, 32)]
SMOKE_DECODE_BATCHES = [1]
DECODE_HEADS = (16, 128)  # decode's (H, D); smoke: SMOKE_DECODE_HEADS
SMOKE_DECODE_HEADS = (2, 32)
# The warm-up compiles at this sequence length instead of each shape's: the kernels specialise
# on heads, head sizes and batch (and on ints being 1 or multiples of 16), which T = 128 keeps;
# traced on a CPU, the four SHAPES and their T = 128 twins launch the same 31 specializations
# (tests/test_gpu_scripts.py checks the same at small shapes).
WARM_T = 128
DEVICE = "cuda"
FLA_BACKWARD_MAX_D = 128  # --fla-backward-256: 256


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


def with_settings(settings: dict, fn):
    """``fn`` run under ``settings`` (``--variant``'s), the previous values back after each
    call: variants interleave with the default in one process."""

    def run():
        with _settings.applied(settings):
            return fn()

    return run


def measurements(
    fla,
    skip_torch: bool,
    shapes,
    decode_batches,
    decode_heads=DECODE_HEADS,
    all_rules=False,
    variants: dict[str, dict] | None = None,
):
    """(kind, shape, impl, rule, bytes or None, the function to time), in the order they run.
    Every Triton rule's forward where (B, H, D) is a RULE_SHAPES one (``all_rules``: at every
    shape, as the smoke run does), delta's elsewhere; each of ``variants`` (name -> ``--set``
    items) times delta's forward and forward + backward again under its settings, as impl
    ``deltaflow-triton+NAME``."""
    variants = variants or {}
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
        rules = triton_rules() if every_rule or all_rules else ["delta"]
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
        xg = inputs(B, T, H, D, grad=True)
        do = torch.randn_like(xg[2])

        # torch.autograd.grad, not .backward(): the gradients are returned, not added into the
        # leaves' .grad (a training step's gradients flow on to the projections; accumulating
        # into .grad cost both implementations the same ~0.4 ms at (8, 4096, 16, 128))
        def fwd_bwd_ours(xg=xg, do=do):
            o, _ = delta_rule(*xg[:4], log_decay=xg[4], backend="triton")
            torch.autograd.grad(o, xg, do)

        yield "forward+backward", shape, "deltaflow-triton", "delta", None, fwd_bwd_ours
        for name, settings in variants.items():
            yield (
                "forward",
                shape,
                f"deltaflow-triton+{name}",
                "delta",
                nbytes,
                with_settings(
                    settings,
                    lambda q=q, k=k, v=v, beta=beta, ld=ld: delta_rule(
                        q, k, v, beta, log_decay=ld, backend="triton"
                    ),
                ),
            )
            yield (
                "forward+backward",
                shape,
                f"deltaflow-triton+{name}",
                "delta",
                None,
                with_settings(settings, fwd_bwd_ours),
            )
        # fla's D=256 backward autotunes for minutes: timed only with --fla-backward-256 (its
        # tunings warmed by an earlier --warm-fla --fla-backward-256 into Triton's cache)
        if fla is not None and D <= FLA_BACKWARD_MAX_D:

            def fwd_bwd_fla(xg=xg, do=do):
                o, _ = fla[0](*xg[:3], xg[4], xg[3])
                torch.autograd.grad(o, xg, do)

            yield "forward+backward", shape, "fla", "delta", None, fwd_bwd_fla

    H, D = decode_heads
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


def _kept_bytes(fn) -> int:
    """Bytes of the storages autograd saves while ``fn`` runs a forward, the inputs' aside."""
    saved: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if not (x.is_leaf and x.requires_grad):  # the inputs are saved in every mode
            storage = x.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(saved.values())


def _memory_and_grads(xs, do, fwd) -> tuple[int, int | None, list]:
    """Kept bytes, the peak of one forward + backward above what was allocated before it
    (CUDA; None on the CPU) and its gradients."""
    for x in xs:
        x.grad = None
    kept = _kept_bytes(fwd)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    fwd().backward(do)
    peak = None
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    return kept, peak, [x.grad.float() for x in xs]


GRAD_NAMES = ("q", "k", "v", "beta", "log_decay")


def compare_modes(setting: str, modes: tuple[str, ...], shapes, rounds: int) -> list[dict]:
    """Per shape and value of ``triton_backend.<setting>`` (``modes``, the first the reference):
    forward and forward + backward ms (medians of the rounds, the modes interleaved in each),
    kept and peak bytes, the gradients' largest relative max-abs difference from the first
    mode's (SAVE_FOR_BACKWARD: the same kernels on the same values, 0), and each gradient's
    error against the same inputs run in fp32 under the first mode (which of two modes that
    differ is the closer one)."""
    from deltaflow.ops import triton_backend

    default = getattr(triton_backend, setting)
    times: dict[tuple, list[float]] = {}
    records: dict[tuple, dict] = {}
    try:
        for r in range(rounds):
            for shape in shapes:
                xs = inputs(*shape, grad=True)
                do = torch.randn_like(xs[2])
                ref = None  # the first mode's gradients
                if r == 0:  # the same inputs in fp32 under the first mode: each mode's error
                    setattr(triton_backend, setting, modes[0])
                    xs32 = [x.detach().float().requires_grad_(True) for x in xs]
                    o32 = delta_rule(*xs32[:4], log_decay=xs32[4], backend="triton")[0]
                    fp32 = torch.autograd.grad(o32, xs32, do.float())
                    del o32, xs32
                for mode in modes:
                    setattr(triton_backend, setting, mode)

                    def fwd(xs=xs):
                        return delta_rule(*xs[:4], log_decay=xs[4], backend="triton")[0]

                    def fwd_bwd(xs=xs, do=do):
                        fwd(xs).backward(do)

                    key = (tuple(shape), mode)
                    for kind, fn in (("forward", fwd), ("fwd_bwd", fwd_bwd)):
                        times.setdefault((*key, kind), []).append(bench(fn))
                    print(
                        f"round {r}: {setting} {mode} {tuple(shape)} forward "
                        f"{times[(*key, 'forward')][-1]:.3f} ms, forward+backward "
                        f"{times[(*key, 'fwd_bwd')][-1]:.3f} ms",
                        flush=True,
                    )
                    if r == 0:  # memory and gradients: the same every round
                        kept, peak, grads = _memory_and_grads(xs, do, fwd)
                        ref = ref or grads
                        diff = max(
                            ((g - g0).abs().max() / g0.abs().max().clamp_min(1e-30)).item()
                            for g, g0 in zip(grads, ref)
                        )
                        # ‖g − g_fp32‖ / ‖g_fp32‖ per gradient, as check_triton measures
                        err = {
                            name: ((g - g32).norm() / g32.norm().clamp_min(1e-30)).item()
                            for name, g, g32 in zip(GRAD_NAMES, grads, fp32)
                        }
                        records[key] = {
                            "kept_bytes": kept,
                            "peak_bytes": peak,
                            "grad_diff_vs_first": diff,
                            "grad_err_vs_fp32": err,
                        }
    finally:
        setattr(triton_backend, setting, default)
    out = []
    for (shape, mode), rec in records.items():
        B, T, H, _ = shape
        out.append(
            {
                "shape": list(shape),
                "mode": mode,
                **{
                    f"{k}_ms": statistics.median(times[(shape, mode, k)])
                    for k in ("forward", "fwd_bwd")
                },
                "rounds_fwd_bwd_ms": times[(shape, mode, "fwd_bwd")],
                **rec,
                "kept_bytes_per_token_head": rec["kept_bytes"] / (B * T * H),
            }
        )
    return out


def worst(errors: dict[str, float]) -> str:
    name = max(errors, key=errors.get)
    return f"{errors[name]:.1e} ({name})"


def save_report(
    records: list[dict], device: str, commit: str, rounds: int, setting: str
) -> list[str]:
    lines = [
        f"# {setting}: {device}, bf16, delta with decay, commit {commit}",
        f"median of {rounds} interleaved rounds of do_bench medians; kept = bytes autograd saves "
        "beyond the inputs; peak = a forward + backward's peak above what was allocated before",
        "",
        "| (B, T, H, D) | mode | forward ms | fwd+bwd ms | rounds (ms) | kept MB "
        "| kept B/token/head | peak MB | grads vs the first mode | grads vs fp32 (worst) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e6:.1f}"
        spread = "/".join(f"{x:.3f}" for x in r["rounds_fwd_bwd_ms"])
        lines.append(
            f"| {tuple(r['shape'])} | {r['mode']} | {r['forward_ms']:.3f} | {r['fwd_bwd_ms']:.3f} "
            f"| {spread} | {r['kept_bytes'] / 1e6:.1f} | {r['kept_bytes_per_token_head']:.0f} "
            f"| {peak} | {r['grad_diff_vs_first']:.1e} | {worst(r['grad_err_vs_fp32'])} |"
        )
    return lines


def warm_shapes(
    shapes: list[tuple[int, int, int, int]], sms: int
) -> list[tuple[int, int, int, int]]:
    """Each shape at WARM_T, except where a state pass runs in segments at the shape's T (the
    segment kernels' launches depend on T; the backend's own decision,
    triton_backend.dense_segments): the shape as it is timed."""
    from deltaflow.ops.triton_backend import dense_segments

    return [(B, T if dense_segments(B, T, H, D, sms) else WARM_T, H, D) for B, T, H, D in shapes]


def warm_specializations(shapes, sms: int, all_rules: bool = False) -> list[list]:
    """What each measurement at ``shapes`` launches (decode aside: it needs CUDA tensors to
    reach its kernel and compiles in about a second), traced on CPU tensors: nothing runs."""
    from _launches import record

    global DEVICE
    device, DEVICE = DEVICE, "cpu"
    try:
        todo = measurements(None, True, shapes, [], all_rules=all_rules)
        return [record(fn, sms) for *_, fn in todo]
    finally:
        DEVICE = device


def _compile_warm(kind: str, args: tuple, key) -> tuple[float, dict]:
    """A compile task: specialization ``key`` of measurement ``args[0]`` (at the warm shapes,
    traced on CPU tensors) compiled into Triton's disk cache, nothing launched on the GPU."""
    import itertools

    from _launches import compile_task, intercepted

    global DEVICE
    index, sms, shapes = args
    DEVICE = "cpu"
    todo = measurements(None, True, shapes, [])
    *_, fn = next(itertools.islice(todo, index, None))

    def traced(handler) -> None:
        with intercepted(handler, sms):
            fn()

    return compile_task(key, traced)


def warm(workers: int, smoke: bool) -> int:
    """Compile every kernel specialization the timed run launches (decode aside), each once,
    the longest first, on ``workers`` processes: check_triton's compile phase
    (_check_schedule.compile_phase) over this script's measurements. CPU only: no GPU memory
    and no launch beside fla's autotuning (gpu_check.sh runs both at once). Smoke: trace only
    (the interpreter compiles nothing)."""
    from _check_schedule import warm_up

    start = time.perf_counter()
    sms = 132 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
    shapes = warm_shapes(SMOKE_SHAPES if smoke else SHAPES, sms)
    keys = warm_specializations(shapes, sms, all_rules=smoke)
    cases = [("measurement", (i, sms, shapes)) for i in range(len(keys))]
    if not warm_up(cases, keys, _compile_warm, workers, smoke, start):
        return 1
    print(
        "smoke ok: traced, nothing compiled"
        if smoke
        else f"warm: done in {time.perf_counter() - start:.0f} s"
    )
    return 0


def warm_fla(fla) -> int:
    """Run each of fla's measurements once at the timed shapes: every autotuned kernel is
    compiled and tuned for the autotune keys the timed run will use, and the results land in
    Triton's disk cache (the module docstring says why the timed run then reuses them). The
    head sizes the Done-when compares (128, then 64) come first, D = 256 last: on a shared GPU
    the later tunings are the ones another process's kernels may disturb."""
    if fla is None:
        print("warm-fla: fla not available, nothing to warm")
        return 0
    start = time.perf_counter()
    for kind, shape, impl, _, _, fn in measurements(fla, True, SHAPES, DECODE_BATCHES):
        if impl != "fla":
            continue
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"warm-fla: {kind} {tuple(shape)} {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"warm-fla: done in {time.perf_counter() - start:.0f} s")
    return 0


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
        help="only compile every kernel of ours the timed run needs, on this many processes "
        "(CPU only), and exit",
    )
    parser.add_argument(
        "--warm-fla",
        action="store_true",
        help="only run fla's measurements once (compile + autotune into Triton's disk cache) "
        "and exit",
    )
    parser.add_argument(
        "--save-for-backward",
        action="store_true",
        help="time forward and forward + backward under each triton_backend.SAVE_FOR_BACKWARD "
        "value in one process, with kept and peak memory (and nothing else)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="the same with triton_backend.SEQUENCE_PARALLEL_STATES off and on (issue 32)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:MODULE.NAME=VALUE[,...]",
        help="also time delta's forward and forward + backward at every shape under these "
        "settings (as --set's items), interleaved with the rest, as impl deltaflow-triton+NAME "
        "(repeatable)",
    )
    parser.add_argument(
        "--fla-backward-256",
        action="store_true",
        help="time (or with --warm-fla, tune) fla's forward + backward at D = 256 too: its "
        "autotuning takes minutes, so warm it in a process of its own first",
    )
    _settings.add_settings_arg(parser)
    args = parser.parse_args(argv)
    global FLA_BACKWARD_MAX_D
    if args.fla_backward_256:
        FLA_BACKWARD_MAX_D = 256
    try:
        settings = _settings.parse(args.set)
        variants = {}
        for text in args.variant:
            name, colon, items = text.partition(":")
            if not colon or not name or name in variants:
                raise _settings.SettingError(
                    f"--variant {text!r}: expected NAME:MODULE.NAME=VALUE[,...] with a new NAME"
                )
            variants[name] = _settings.parse([items])
    except _settings.SettingError as e:  # one line, not argparse's usage block
        parser.error(str(e))
    if args.smoke and args.sequence_parallel:  # several segments at the smoke's T = 200
        settings = {"triton_backend.SEGMENT_CHUNKS": 1, **settings}
    _settings.apply(settings)
    if settings:
        print(f"settings: {json.dumps(settings)}")
    if args.save_for_backward and args.sequence_parallel:
        parser.error("--save-for-backward and --sequence-parallel are separate runs: give one")
    compare = args.save_for_backward or args.sequence_parallel
    if compare and variants:
        parser.error("--variant belongs to the main table, not --save-for-backward / "
                     "--sequence-parallel")  # fmt: skip
    if compare and (args.warm_only or args.warm_fla):
        parser.error(f"{'--save-for-backward' if args.save_for_backward else '--sequence-parallel'}"
                     " times; --warm-only / --warm-fla only compile")  # fmt: skip
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warm_only < 0:
        parser.error(f"--warm-only must be a number of processes >= 1, got {args.warm_only}")
    if args.warm_only and args.warm_fla:
        parser.error("--warm-only and --warm-fla are separate processes: give one")
    if not args.smoke and not torch.cuda.is_available():
        print("error: kernels.py needs a CUDA GPU; run it with --smoke on a CPU")
        return 2
    if args.warm_only:
        return warm(args.warm_only, args.smoke)
    if args.smoke:
        DEVICE = "cpu"
        fla, shapes, batches, rounds = None, SMOKE_SHAPES, SMOKE_DECODE_BATCHES, 1
        decode_heads = SMOKE_DECODE_HEADS
        print("smoke mode: CPU, Triton interpreter, fla skipped")
    else:
        fla = load_fla(
            "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
            "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
        )
        shapes, batches, rounds = SHAPES, DECODE_BATCHES, args.rounds
        decode_heads = DECODE_HEADS
    if args.warm_fla:
        return warm_fla(fla)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    commit = git_commit()
    if compare:
        rounds = 1 if args.smoke else args.rounds
        if args.save_for_backward:
            from deltaflow.ops.triton_backend import SAVE_CHOICES

            setting, modes, name, file = (
                "SAVE_FOR_BACKWARD",
                SAVE_CHOICES,
                "save-for-backward",
                "save",
            )
            shapes = SMOKE_SAVE_SHAPES if args.smoke else SAVE_SHAPES
        else:
            setting, modes, name = (
                "SEQUENCE_PARALLEL_STATES",
                SEQUENCE_PARALLEL_MODES,
                "sequence-parallel",
            )
            file = "seqpar"
            shapes = SMOKE_SEQUENCE_PARALLEL_SHAPES if args.smoke else SEQUENCE_PARALLEL_SHAPES
        records = compare_modes(setting, modes, shapes, rounds)
        lines = save_report(records, device, commit, rounds, setting)
        print("\n".join(lines))
        if args.smoke:
            print(f"smoke ok: {len(records)} {name} measurements ran")
            return 0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = device.replace(" ", "_")
        meta = {"device": device, "commit": commit, "torch": torch.__version__, "rounds": rounds}
        meta["settings"] = settings
        (out / f"kernels_{file}_{tag}.json").write_text(
            json.dumps({"meta": meta, "records": records}, indent=1)
        )
        (out / f"kernels_{file}_{tag}.md").write_text("\n".join(lines) + "\n")
        return 0
    bw = copy_bandwidth(DEVICE)
    print(f"{device}: copy bandwidth {bw / 1e12:.2f} TB/s, commit {commit}")
    times: dict[tuple, list[float]] = {}
    meta_of: dict[tuple, tuple] = {}
    for r in range(rounds):
        round_start, timed = time.perf_counter(), 0
        for kind, shape, impl, rule, nbytes, fn in measurements(
            fla, args.skip_torch or args.smoke, shapes, batches, decode_heads, args.smoke, variants
        ):
            timed += 1
            key = (kind, tuple(shape), impl, rule)
            times.setdefault(key, []).append(bench(fn))
            meta_of[key] = nbytes
            print(
                f"round {r}: {kind} {tuple(shape)} {impl} {rule} {times[key][-1]:.3f} ms",
                flush=True,
            )
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        # round 0 includes what was not warm (compiles, fla's tuning); later rounds only timing
        print(f"round {r}: {timed} timings in {time.perf_counter() - round_start:.1f} s")

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
        "settings": settings,  # --set's items
        "variants": variants,  # --variant's: impl deltaflow-triton+NAME
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
