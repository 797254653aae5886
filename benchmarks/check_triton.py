"""GPU correctness check of the Triton backend against float64, whole, in parallel workers.

    python benchmarks/check_triton.py [--workers N] [--compile-workers N] [--gpu-memory GB]
        [--dtype bf16|fp16|fp32|both|all] [--only TEXT,...] [--set MODULE.NAME=VALUE] [--out FILE]
    python benchmarks/check_triton.py --plan       # the cases and their kernels, no GPU needed
    python benchmarks/check_triton.py --smoke      # CPU, Triton interpreter, tiny shapes (CI)

Forward output (as "auto" runs it, and the fused forward), final state and the gradients of q,
k, v, beta, log_decay and initial_state are compared by ‖Δ‖/‖ref‖ with the float64 chunked
torch backend, which the CPU test suite pins to the token-by-token reference at 1e-10 (the
reference itself is used for the forward at T ≤ 1000). Inputs of low precision are rounded
first and the reference gets the rounded values, so only the kernels' arithmetic is measured.
Every kernel output is poisoned (NaN, or the most negative integer) before each launch. Also:
the decode kernel (in place, and under CUDA-graph capture), causality with a NaN/inf planted in
k, v or beta (earlier outputs bit-identical, every rule), and torch.compile(fullgraph=True).

Compiling (each dtype × head size × flags compiles its own kernels; the rule is a runtime
argument) runs first and alone (_check_schedule.py): every kernel specialization of the plan,
found by tracing each case's launches on CPU tensors (``--plan`` prints them), compiled once on
``--compile-workers`` processes into Triton's disk cache. Then the cases run in batches of one
shape and dtype (``--batch``), each batch in a fresh process, as many at once as ``--workers``
and the GPU-memory budget allow. Each case uses H = 2 so that shapes differing only in T reuse
a compiled kernel. Each case's log line says where its time went. The cases themselves (inputs,
references, comparisons) are in _check_cases.py.
Where a bf16 case is over tolerance, its gradients are recomputed in float64 with the roundings
any bf16 implementation does (``benchmarks/bf16_floor.py``'s FLOOR: bf16 storage of what fla
stores in bf16 too) on the same inputs, and its output and final state likewise
(``benchmarks/forward_floor.py``): the ``bf16 floor`` column, that recompute's error of the
worst entry over tolerance. Such a case passes only where every entry over tolerance is within
FLOOR_MARGIN (1.1) times its floor: bf16 itself reaches that error there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import _settings
from _check_schedule import (
    BASE_GB,
    batches,
    case_memory_gb,
    compile_phase,
    describe,
    first_case_of,
    print_plan,
    run_phase,
)
from _common import git_commit, smoke_env, smoke_requested

if "--plan" in sys.argv[1:]:  # traced, not interpreted: Triton's launches are intercepted
    os.environ.pop("TRITON_INTERPRET", None)
elif smoke_requested():
    smoke_env()

import _check_cases  # noqa: E402 - after the environment above: it imports torch
import torch  # noqa: E402
from _check_cases import (  # noqa: E402
    CASES,
    COMPILED,
    FLOOR_MARGIN,
    NAMES,
    SHAPES,
    SMOKE_RULES,
    SMOKE_SHAPES,
    TIMES,
    _on_compile,
    process_age,
)


def trace(kind: str, args: tuple, handler=None) -> list:
    """Run case ``(kind, args)`` on CPU tensors with its Triton launches intercepted: the
    specializations it launches, in order, each once (``handler``, if given, also sees every
    launch: compiling one, say). Nothing runs on a GPU; seconds on a CPU."""
    from _launches import H100_SMS, intercepted, specialization

    seen: dict = {}

    def on_launch(fn, run, kwargs):
        seen.setdefault(specialization(fn, kwargs), None)
        return handler(fn, run, kwargs) if handler else None

    _check_cases.TRACING = True
    try:
        gpu = torch.cuda.is_available()  # the two-pass choice as this GPU makes it
        sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else H100_SMS
        with intercepted(on_launch, sms):
            CASES[kind](*args)
    finally:
        _check_cases.TRACING = False
    return list(seen)


def traced(case: tuple[str, tuple]) -> list:
    """:func:`trace`, or nothing where tracing fails (said in one line): that case then compiles
    its kernels in its own run, and its own run reports what is wrong."""
    try:
        return trace(*case)
    except Exception as e:  # noqa: BLE001 - a case the trace cannot follow still runs
        print(f"trace failed for {describe(*case)}: {type(e).__name__}: {str(e)[:200]}")
        return []


def compile_one(kind: str, args: tuple, key) -> tuple[float, dict]:
    """A compile-phase task: specialization ``key`` compiled into Triton's disk cache by tracing
    its case, nothing launched or loaded (so no GPU local memory is reserved). Returns the
    seconds and the kernel's registers, spill stack and shared memory."""
    from _launches import compile_task

    return compile_task(key, lambda handler: trace(kind, args, handler))


def _init_worker(smoke: bool, settings: dict | None = None) -> None:
    if smoke:
        smoke_env()
    # --set's (and --bwd-states') settings, in every process (the trace, the compile and the
    # case workers)
    _settings.apply(settings or {})
    # a dozen processes share one GPU: allocate in growable segments, hold no spare blocks
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # as many processes as cores: one CPU thread each (spinning thread pools oversubscribe)
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    from deltaflow.ops import triton_backend

    triton_backend.POISON_OUTPUTS = True
    import triton

    triton.knobs.compilation.listener = _on_compile


def run_case(kind: str, args: tuple):
    TIMES.clear()
    COMPILED.clear()
    start = time.perf_counter()
    try:
        rows = CASES[kind](*args)
    except Exception as e:  # noqa: BLE001 - one broken case is a failed row, not a lost report
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows = [(f"{kind} {args[:1]}", "-", False, "-", {}, False, error)]
    if torch.cuda.is_available():  # many workers share one GPU: keep no cached blocks
        torch.cuda.empty_cache()
    if COMPILED:
        TIMES["compiled"] = ",".join(COMPILED)
    return rows, time.perf_counter() - start, dict(TIMES)


def run_batch(*cases: tuple[str, tuple]) -> list:
    """:func:`run_case` for each case, in this one process; the first result also says how
    long the process took to start."""
    age = process_age()
    results = [run_case(*case) for case in cases]
    results[0][2]["start-up"] = age
    return results


def batch_group(case: tuple[str, tuple]):
    """Cases that launch the same kernels (the rule is a runtime argument): an op shape in one
    dtype; each other kind."""
    kind, args = case
    return (kind, args[0], args[8]) if kind == "op" else kind


def plan(dtypes: list[str], smoke: bool, device: str) -> list[tuple[str, tuple]]:
    """Every case. bf16: each shape × each Triton rule. fp32 tests its own code path (fp32
    operands, tf32x3 dots, narrower value blocks), not the rule table again: each shape with
    delta, and every rule at T=65 (the rule's code is elementwise, the same at every head size:
    efla at every shape as well cost 5 prepare and 5 gradient specializations, ~20 s of the
    compile phase on an H100, and tested no new code). fp16 likewise: bf16's kernels with
    another operand type (the same PTX but the types), so its own range and rounding.
    bf16/fp16 at heads under 64 columns (the three 16-column shapes) run the fp32 kernels
    (triton_ops.HALF_MIN_HEAD): their errors are bf16's storage of the outputs and gradients
    (~1.7e-3 in bf16), and they share the fp32 cases' compiled kernels (``--plan --dtype all``:
    173 specializations, 209 with those cases on the half-precision kernels).
    Negative eigenvalues alternate with the rule and the head sizes, not with T, so that
    shapes sharing head sizes share compiled kernels (compilation is most of the wall time).
    Then decode, causality and compile."""
    from deltaflow.rules import triton_rules

    rules = SMOKE_RULES if smoke else triton_rules()
    shapes = SMOKE_SHAPES if smoke else SHAPES
    heads = sorted({(Dk, Dv) for _, _, _, Dk, Dv, _ in shapes})
    cases = []
    for dt in dtypes:
        for i, (label, B, T, Dk, Dv, lengths) in enumerate(shapes):
            for j, rule in enumerate(rules):
                if dt != "bf16" and not smoke and rule != "delta" and label != "T=65":
                    continue
                # trapezoid + negative eigenvalues maps μ into (−3, 1]: unstable by design
                # (results/stability), so its error grows with the state; check it without.
                ne = (heads.index((Dk, Dv)) + j) % 2 == 1 and rule != "trapezoid"
                case = (label, B, T, Dk, Dv, lengths, rule, ne, dt, i * 10 + j, device)
                cases.append(("op", case))
    # The slow cases (wide heads, long sequences) first, so that no worker starts one last.
    # (How many run at once is the run phase's memory budget: _check_schedule.py.)
    cases.sort(key=lambda c: -(c[1][3] + c[1][4]) * (c[1][2] or 2000) ** 0.5)
    for rule in rules if not smoke else ["delta"]:
        cases.append(("causal", (rule, device)))
        if not smoke:
            cases.append(("decode", (rule, device)))
    if not smoke:
        cases.insert(0, ("compile", (device,)))
        cases.append(("decode_graph", (device,)))
    return cases


def report(rows, device_name, wall, waited, workers, smoke, settings=None) -> tuple[str, bool]:
    cols = ["o", "o fused", "state"] + [f"d{n}" for n in NAMES] + ["bf16 floor"]
    all_ok = all(r[5] for r in rows)
    lines = [
        f"# Triton backend check: {device_name}, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}, commit {git_commit()}",
        "",
        f"wall time: {wall:.0f} s ({workers} worker processes{', smoke mode' if smoke else ''}"
        + (f"; not counted: {waited:.0f} s waiting for the GPU, --run-after)" if waited else ")"),
        "",
        "settings (--set, --bwd-states): "
        + (", ".join(f"{k}={v}" for k, v in settings.items()) if settings else "the defaults"),
        "",
        "‖Δ‖/‖ref‖ vs float64; tolerance bf16 5e-3, fp16 1e-3, fp32 1e-4; outputs poisoned "
        "before every launch. bf16 floor (cases over tolerance): the float64 result recomputed "
        "with bf16 storage (fp16 storage for fp16 cases; gradients benchmarks/bf16_floor.py, "
        "output and final state benchmarks/forward_floor.py), its error of the worst entry over "
        "tolerance; "
        f"such a case passes where every entry over tolerance (output, state or gradient) is "
        f"within {FLOOR_MARGIN}x its floor.",
        "",
        "| case | rule | neg. eig. | dtype | " + " | ".join(cols) + " | ok | note |",
        "|" + " --- |" * (len(cols) + 6),
    ]
    order = {"bf16": 0, "fp16": 1, "fp32": 2, "-": 3}
    for label, rule, ne, dt, errs, ok, note in sorted(
        rows, key=lambda r: (order.get(r[3], 3), r[0], r[1])
    ):
        vals = " | ".join(f"{errs[c]:.1e}" if c in errs else "" for c in cols)
        lines.append(
            f"| {label} | {rule} | {ne} | {dt} | {vals} | {'yes' if ok else 'NO'} | {note} |"
        )
    lines += ["", f"ALL OK: {all_ok} ({sum(r[5] for r in rows)}/{len(rows)} cases)"]
    return "\n".join(lines), all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32", "both", "all"],
        default="both",
        help="both: bf16 and fp32 (the GPU truth's default); all: bf16, fp16 and fp32",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="case processes at once (also bounded by --gpu-memory); default: the CPU cores",
    )
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes of the compile phase (CPU only); default: the CPU cores",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        help="GB the case processes may hold at once (default: 85%% of the GPU's memory)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=4,
        help="cases per process, of one shape and dtype (their kernels load once)",
    )
    parser.add_argument(
        "--run-after",
        default=None,
        metavar="FILE",
        help="start the run phase (the GPU part) only once FILE exists; the compile phase "
        "(CPU only) does not wait (gpu_check.sh: fla autotunes on a quiet GPU meanwhile)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the cases and the kernel specializations each launches, run nothing "
        "(CPU: the launches are traced on CPU tensors)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="report file (default: "
        "benchmarks/results/check_triton_<device>.md; smoke: not written)",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="run only the cases whose description (as --plan prints it: 'op T=65 delta "
        "ne=False bf16', 'decode efla', 'compile') contains one of these comma-separated texts",
    )
    parser.add_argument(
        "--bwd-states",
        choices=["fp32", "bf16"],
        default=None,
        help="dtype of the backward's stored states: --set triton_backend.BACKWARD_STATES_FP32 "
        "by name (default: the module's, bf16)",
    )
    _settings.add_settings_arg(parser)
    args = parser.parse_args(argv)
    try:
        settings = _settings.parse(args.set)
    except _settings.SettingError as e:
        parser.error(f"--set {e}")
    if args.bwd_states is not None:  # one of the settings, under its own name
        fp32, key = args.bwd_states == "fp32", "triton_backend.BACKWARD_STATES_FP32"
        if settings.get(key, fp32) != fp32:
            parser.error(f"--bwd-states {args.bwd_states} contradicts --set {key}={settings[key]}")
        settings[key] = fp32
    for flag in ("workers", "compile_workers", "batch"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        parser.error(f"--gpu-memory must be a positive number of GB, got {args.gpu_memory}")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not args.plan and not torch.cuda.is_available():
        print("error: check_triton needs a CUDA GPU; run it with --smoke (or --plan) on a CPU")
        return 2
    dtypes = {"both": ["bf16", "fp32"], "all": ["bf16", "fp16", "fp32"]}.get(
        args.dtype, [args.dtype]
    )
    if args.smoke and "bf16" in dtypes:  # the interpreter's bf16 dots read bits as integers
        dtypes = [dt for dt in dtypes if dt != "bf16"] or ["fp32"]
        print(f"smoke: bf16 left out (the interpreter's bf16 dots are wrong): {dtypes}")
    cases = plan(dtypes, args.smoke, device)
    if args.only:  # comma-separated alternatives
        wanted = args.only.split(",")
        cases = [c for c in cases if any(w in describe(*c) for w in wanted)]
        if not cases:  # a check of nothing would report ALL OK
            parser.error(f"--only {args.only!r} matches no case (--plan lists them)")
    init_args = (args.smoke, settings)
    if args.plan:
        _init_worker(*init_args)
        print_plan(cases, [trace(*case) for case in cases])
        return 0
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(f"{len(cases)} cases on {name}, {args.workers} workers", flush=True)
    start = time.perf_counter()
    rows = []
    ctx = torch.multiprocessing.get_context("spawn")
    budget, memory = float("inf"), [0.0] * len(cases)
    if not args.smoke:  # the interpreter compiles nothing: no compile phase, no budget
        _init_worker(*init_args)  # the trace launches what the workers will
        keys = [traced(case) for case in cases]
        usage = compile_phase(
            first_case_of(cases, keys),
            compile_one,
            args.compile_workers,
            ctx,
            _init_worker,
            init_args,
        )
        props = torch.cuda.get_device_properties(0)
        threads = props.multi_processor_count * props.max_threads_per_multi_processor
        memory = [case_memory_gb(case_keys, usage, threads) for case_keys in keys]
        budget = args.gpu_memory or 0.85 * props.total_memory / 1e9
        heavy = sum(m > BASE_GB + 1 for m in memory)
        print(
            f"run phase: {heavy} cases predicted over {BASE_GB + 1:.0f} GB; budget {budget:.0f} GB"
        )

    def on_result(results) -> None:
        for case_rows, seconds, times in results:
            rows.extend(case_rows)
            spent = ", ".join(
                f"{k} {v:.1f}s" if isinstance(v, float) else f"{k} {v}" for k, v in times.items()
            )
            for label, rule, ne, dt, errs, ok, note in case_rows:
                errors = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
                print(
                    f"{'ok  ' if ok else 'FAIL'} {seconds:5.1f}s {label} {rule} ne={ne} {dt} "
                    f"{errors} {note} [{spent}]",
                    flush=True,
                )

    waited = 0.0  # not the check's own time: the report's wall time leaves it out, and says so
    if args.run_after:  # the GPU is someone else's until then (gpu_check.sh: fla's tuning)
        since = time.perf_counter()
        while not Path(args.run_after).exists():
            time.sleep(1)
        waited = time.perf_counter() - since
        print(f"run phase: waited {waited:.0f} s for {args.run_after}")
    # A fresh process per batch (cases sharing their kernels): the driver keeps each process's
    # local-memory reservation at its largest kernel's until the process ends
    # (_check_schedule.py); a batch is charged its largest case's memory.
    groups = batches(cases, batch_group, args.batch)
    run_phase(
        [tuple(cases[i] for i in g) for g in groups],
        [max(memory[i] for i in g) for g in groups],
        budget,
        run_batch,
        args.workers,
        ctx,
        _init_worker,
        init_args,
        on_result,
    )
    wall = time.perf_counter() - start - waited
    text, all_ok = report(rows, name, wall, waited, args.workers, args.smoke, settings)
    print(text)
    out = args.out
    if out is None and not args.smoke:
        out = f"benchmarks/results/check_triton_{name.replace(' ', '_')}.md"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
