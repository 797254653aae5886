"""Issue 31, session 17 (helper h17): where float16 goes NaN on the GPU, in one call.

On an H100 (torch 2.11, Triton 3.6) tests/test_op_host_path.py's float16 cases gave all-NaN
gradients at (B, T, H, D) = (1, 70, 2, 16); float32 passed, and on the CPU interpreter float16
passes. The interpreter shows no value anywhere near float16's range there (every buffer below
11), and the sm_90 PTX of every kernel is the same for fp16 and bf16 but for the types
(Triton 3.6, compiled on a CPU): a range problem would show on the CPU, a float16-only one
would need a type-specific code path, and there is none. What no GPU run had done before is a
half-precision launch at D < 64: blocks of 16 columns, the width at which Triton 3.6 on Hopper
miscompiled the bf16 state pass before (benchmarks/NOTES.md; check_triton's smallest head is 64,
and the interpreter's bf16 dots are wrong, so the CPU tests use float16 as their half
precision). This probe tells the two apart and tries the fix:

- each case in float16, bfloat16 (same kernels, other type) and float32 (control), with and
  without decay; shapes: the failing test's (its own inputs), T = 1, (2, 256, 4, 64), D = 128,
  and D = 32 / Dk != Dv to see which block width matters;
- variant ``wide``: ``common.HALF_MIN_BLOCK = 64`` (heads narrower than 64 columns padded to the
  64-column kernels, masked: bit-identical on the interpreter, tests/test_half_blocks.py), the
  other runs 16 (each head's own width, as before session 17); both run the half-precision
  kernels at every head (``triton_ops.HALF_MIN_HEAD = 0``: the op itself has run narrower
  half-precision heads on the fp32 kernels since session 18);
- per case: non-finite entries, the largest magnitude and ‖Δ‖/‖ref‖ against the float64
  token-by-token reference (``backend="reference"``) on the same rounded inputs, of the output
  (as "auto" runs it, and the fused forward), the final state and every gradient (the output's
  gradient fixed and rounded to the dtype, the final state unused: the failing test's path);
  where one is not finite, every kernel's buffers in launch order: the first non-finite stage;
- a verdict line.

    timeout 60 python benchmarks/probe_fp16.py      # H100; ~35 s, lines as cases finish
    python benchmarks/probe_fp16.py --smoke          # CPU interpreter, seconds (CI)
    python benchmarks/probe_fp16.py --only fp16,wide  # cases whose label holds one of these

On the GPU the kernels compile first in parallel processes (launches traced on CPU tensors,
as check_triton does), cases in priority order; a case never starts after ``--budget``
seconds, so ``timeout 60`` always leaves the verdict line. Exit status 1 when a case is not
finite or over its tolerance (check_triton's: bf16 5e-3, fp16 1e-3, fp32 1e-4).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as CompileTimeout
from pathlib import Path
from typing import Any, NamedTuple

from _common import smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

import torch  # noqa: E402 - after the interpreter switch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test's inputs
from _check_cases import TOL  # noqa: E402
from _inputs import make_inputs  # noqa: E402

NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
# the report's names: the final state s, the gradients of q, k, v, beta, log_decay (dg) and of
# the initial state (ds0)
SHORT = dict(zip(NAMES, ["dq", "dk", "dv", "dbeta", "dg", "ds0"]))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
START = time.perf_counter()


class Run(NamedTuple):
    """One forward + backward: a shape, a dtype, decay or not, and the launch variant."""

    shape: str
    B: int
    T: int
    H: int
    Dk: int
    Dv: int
    dtype: str
    decay: bool
    wide: bool  # common.HALF_MIN_BLOCK = 64, else 16

    @property
    def label(self) -> str:
        return (
            f"{self.dtype} {self.shape} ({self.B},{self.T},{self.H},{self.Dk},{self.Dv}) "
            f"{'decay' if self.decay else 'nodecay'}{' wide' if self.wide else ''}"
        )


SHAPES = {  # name: (B, T, H, Dk, Dv)
    "failing": (1, 70, 2, 16, 16),  # tests/test_op_host_path.py, seed 3
    "T=1": (1, 1, 1, 16, 16),
    "D=64": (2, 256, 4, 64, 64),
    "D=128": (1, 130, 2, 128, 128),
    "D=32": (1, 70, 2, 32, 32),
    "Dk=16 Dv=64": (1, 70, 2, 16, 64),
    "Dk=64 Dv=16": (1, 70, 2, 64, 16),
}


def plan(smoke: bool) -> list[Run]:
    """The runs, most telling first (a timeout cuts the tail): the failing case in each dtype,
    the fix tried on it, the other shapes with decay, then without."""

    def runs(shape: str, dtypes: list[str], decay: bool = True, wide: bool = False) -> list:
        return [Run(shape, *SHAPES[shape], dt, decay, wide) for dt in dtypes]

    if smoke:  # the interpreter: no bf16 (its bf16 dots read the bits as integers)
        return [
            *runs("failing", ["fp16", "fp32"]),
            *runs("failing", ["fp16"], wide=True),
            *runs("T=1", ["fp16"], decay=False),
        ]
    every, half = ["fp16", "bf16", "fp32"], ["fp16", "bf16"]
    out = [*runs("failing", every), *runs("failing", half, wide=True)]
    out += runs("D=64", every) + runs("failing", every, decay=False)
    out += runs("T=1", every) + runs("D=128", every) + runs("D=32", half)
    out += runs("Dk=16 Dv=64", half) + runs("Dk=64 Dv=16", half)
    out += runs("T=1", half, wide=True) + runs("D=32", half, wide=True)
    for shape in ("D=64", "T=1", "D=128"):
        out += runs(shape, every, decay=False)
    return out


def inputs(run: Run, device: str) -> dict[str, torch.Tensor | None]:
    """The failing test's inputs (make_inputs, seed 3) at the run's shape: q, k, v and the
    initial state in the run's dtype, beta and log_decay in float32."""
    x = make_inputs(run.B, run.T, run.H, run.Dk, run.Dv, rule="delta", dtype=torch.float32, seed=3)
    if not run.decay:
        x["log_decay"] = None
    low = DTYPES[run.dtype]
    return {
        n: None
        if t is None
        else t.to(device=device, dtype=low if n in ("q", "k", "v", "initial_state") else t.dtype)
        for n, t in x.items()
    }


def grad_output(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """The output's gradient: seeded, rounded to the run's dtype (the kernels get it in that
    dtype; the reference gets the same values), as float64."""
    g = torch.Generator().manual_seed(123)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device).double()


class Stages:
    """Every kernel's output buffers, checked after its launch (the backend's launchers
    wrapped, in launch order)."""

    LAUNCHES = {
        "launch_prepare": ("w", "u", "t"),
        "launch_states": ("h", "v_new", "final_state"),
        "launch_outputs": ("o",),
        "launch_forward": ("o", "final_state"),
        "launch_dstates": ("dh", "du", "d_initial_state"),
        "launch_gradients": ("scratch_m", "scratch_r", "dq", "dk", "dv", "dbeta", "dlog_decay"),
    }

    def __init__(self) -> None:
        # (stage, buffer, non-finite entries, entries, largest finite magnitude, bytes/entry)
        self.rows: list[tuple[str, str, int, int, float, int]] = []

    def __enter__(self) -> Stages:
        from deltaflow.ops import triton_backend

        self.saved = {name: getattr(triton_backend, name) for name in self.LAUNCHES}
        for name, fn in self.saved.items():
            setattr(triton_backend, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        from deltaflow.ops import triton_backend

        for name, fn in self.saved.items():
            setattr(triton_backend, name, fn)

    def _wrap(self, name: str, fn: Any) -> Any:
        stage = name.removeprefix("launch_")

        def launch(*args: Any, **kw: Any) -> None:
            fn(*args, **kw)
            for buf in self.LAUNCHES[name]:
                x = kw.get(buf)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    self.rows.append((stage, buf, *finite_stats(x), x.element_size()))

        return launch

    def first_bad(self) -> str:
        bad = [r for r in self.rows if r[2]]
        if not bad:
            return "none"
        return f"{bad[0][0]}.{bad[0][1]} ({bad[0][2]}/{bad[0][3]})"

    def summary(self) -> str:
        return " ".join(
            f"{stage}.{buf}={'NaN' + str(nf) if nf else f'{mx:.1e}'}"
            for stage, buf, nf, _, mx, _ in self.rows
        )


def finite_stats(x: torch.Tensor) -> tuple[int, int, float]:
    """(non-finite entries, entries, largest finite magnitude) of ``x``."""
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    top = float(x.float().abs().where(finite, 0).max()) if x.numel() else 0.0
    return bad, x.numel(), top


def rel(x: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """‖x − ref‖/‖ref‖ (NaN where x is not finite)."""
    if x is None or ref is None:
        return 0.0
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def forward_backward(x: dict, do: torch.Tensor, backend: str, dtype: torch.dtype | None = None):
    """Output, final state and gradients of one call; the loss is ⟨o, do⟩ (the final state
    unused: its gradient reaches the backward as None)."""
    from deltaflow import delta_rule

    leaves = {
        n: None if t is None else t.detach().to(dtype or t.dtype).requires_grad_()
        for n, t in x.items()
    }
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend)
    (o.double() * do).sum().backward()
    grads = {n: leaves[n].grad for n in NAMES if leaves[n] is not None}
    return o.detach(), s.detach(), grads


def fused_output(x: dict) -> torch.Tensor:
    """The fused forward's output (on the GPU these shapes take the two-pass form)."""
    from deltaflow import delta_rule
    from deltaflow.ops import triton_backend

    triton_backend.FORWARD_MODE = "fused"
    try:
        with torch.no_grad():
            return delta_rule(**x, backend="triton")[0]
    finally:
        triton_backend.FORWARD_MODE = "auto"


@contextlib.contextmanager
def half_blocks(run: Run) -> Iterator[None]:
    """The half-precision kernels at every head size (``triton_ops.HALF_MIN_HEAD = 0``: the op
    would run narrower heads on the fp32 kernels), with 64-column (``wide``) or 16-column
    floors; the defaults restored after (a worker runs many tasks)."""
    from deltaflow.ops import triton_ops
    from deltaflow.ops.triton import common

    saved = triton_ops.HALF_MIN_HEAD, common.HALF_MIN_BLOCK
    triton_ops.HALF_MIN_HEAD, common.HALF_MIN_BLOCK = 0, 64 if run.wide else 16
    try:
        yield
    finally:
        triton_ops.HALF_MIN_HEAD, common.HALF_MIN_BLOCK = saved


def probe(run: Run, device: str) -> tuple[bool, bool, str]:
    """Run ``run``; (all finite, within tolerance, its report lines)."""
    x = inputs(run, device)
    do = grad_output((run.B, run.T, run.H, run.Dv), DTYPES[run.dtype], device)
    with half_blocks(run):
        with Stages() as stages:
            o, s, grads = forward_backward(x, do, "triton")
            if device == "cuda":
                torch.cuda.synchronize()
        o_fused = fused_output(x)
    o_ref, s_ref, g_ref = forward_backward(x, do, "reference", torch.float64)
    got = {"o": o, "o_fused": o_fused, "s": s, **{SHORT[n]: g for n, g in grads.items()}}
    ref = {"o": o_ref, "o_fused": o_ref, "s": s_ref, **{SHORT[n]: g for n, g in g_ref.items()}}
    errs = {n: rel(got[n], ref[n]) for n in got}
    stats = {n: finite_stats(t) for n, t in got.items()}
    finite = all(nf == 0 for nf, _, _ in stats.values())
    within = finite and max(errs.values()) <= TOL[run.dtype]
    cells = " ".join(
        f"{n}={'NaN' + str(stats[n][0]) + '/' + str(stats[n][1]) if stats[n][0] else f'{e:.1e}'}"
        for n, e in errs.items()
    )
    # the largest value a buffer of the run's dtype holds (float16's largest is 65504)
    size = DTYPES[run.dtype].itemsize
    largest = max(
        [(mx, f"{stage}.{buf}") for stage, buf, _, _, mx, b in stages.rows if b == size],
        default=(0.0, "-"),
    )
    lines = [
        f"{'ok  ' if within else 'FAIL'} {run.label}: {cells} | max|{run.dtype} buffer| "
        f"{largest[0]:.1e} ({largest[1]}) | first non-finite: {stages.first_bad()}"
    ]
    if not finite or stages.first_bad() != "none":
        lines.append(f"     stages: {stages.summary()}")
    return finite, within, "\n".join(lines)


def verdict(results: dict[Run, tuple[bool, bool]]) -> str:
    """What the pattern of non-finite runs says about the cause."""
    if not results:
        return "verdict: no run finished"
    bad = [r for r, (finite, _) in results.items() if not finite and not r.wide]
    wide = [finite for r, (finite, _) in results.items() if r.wide]
    if not bad:
        over = sum(not within for _, within in results.values())
        return f"verdict: every run finite ({over} over tolerance): the NaN did not reproduce"
    dtypes = sorted({r.dtype for r in bad})
    narrow = all(min(r.Dk, r.Dv) < 64 for r in bad) and "fp32" not in dtypes
    if narrow and wide and all(wide):
        return (
            f"verdict: narrow half-precision blocks: {'+'.join(dtypes)} non-finite only at heads "
            "under 64 columns, finite with 64-column blocks (wide): set "
            "deltaflow/ops/triton/common.py HALF_MIN_BLOCK = 64"
        )
    if dtypes == ["fp16"] and not narrow:
        return (
            "verdict: float16 only, at heads of 64+ columns too (bf16, fp32 finite): a value out "
            "of float16's range or a float16 code path; the stages lines name the first buffer"
        )
    return (
        f"verdict: no single pattern ({'+'.join(dtypes)} non-finite; wide finite: "
        f"{all(wide) if wide else '-'}): the stages lines name each run's first non-finite buffer"
    )


# ------------------------------------------------------------------------- parallel compiling


def _compile_worker_init() -> None:
    torch.set_num_threads(1)


def compile_run(run: Run, sms: int) -> float:
    """Compile (into Triton's disk cache, launching nothing) every kernel ``run`` launches:
    the op traced on CPU tensors (benchmarks/_launches.py) as the GPU run will call it."""
    from _launches import compile_launch, intercepted

    start = time.perf_counter()
    x = inputs(run, "cpu")
    do = grad_output((run.B, run.T, run.H, run.Dv), DTYPES[run.dtype], "cpu")
    with half_blocks(run), intercepted(compile_launch, sms):
        forward_backward(x, do, "triton")
        fused_output(x)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--only", default=None, help="comma-separated texts a label must hold")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument(
        "--budget", type=float, default=48.0, help="seconds after which no case starts"
    )
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: probe_fp16 needs a CUDA GPU; run it with --smoke on a CPU")
        return 2
    runs = plan(args.smoke)
    if args.only:
        runs = [r for r in runs if any(w in r.label for w in args.only.split(","))]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    import triton

    print(
        f"probe_fp16: {len(runs)} runs on {name}, torch {torch.__version__}, triton "
        f"{triton.__version__}; tolerances {TOL}",
        flush=True,
    )
    compiled: list[Future | None] = [None] * len(runs)
    pool = None
    if device == "cuda" and args.workers > 1:  # compile ahead in parallel, run in order
        import multiprocessing

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        pool = ProcessPoolExecutor(
            args.workers, multiprocessing.get_context("spawn"), _compile_worker_init
        )
        compiled = [pool.submit(compile_run, r, sms) for r in runs]
    results: dict[Run, tuple[bool, bool]] = {}
    try:
        for run, future in zip(runs, compiled):
            left = args.budget - (time.perf_counter() - START)
            note = ""
            if future is not None and left > 0:
                try:
                    note = f" [compiled in {future.result(timeout=left):.1f} s]"
                except CompileTimeout:
                    left = 0.0
                except Exception as e:  # noqa: BLE001 - the run compiles what the trace missed
                    note = f" [trace failed: {type(e).__name__}: {str(e)[:120]}]"
            if left <= 0:  # the verdict must print before the caller's timeout
                print(
                    f"budget: {args.budget:.0f} s spent, {len(runs) - len(results)} runs left out"
                )
                break
            try:
                finite, within, text = probe(run, device)
            except Exception as e:  # noqa: BLE001 - one broken run is a line, not a lost probe
                finite, within, text = False, False, f"FAIL {run.label}: {type(e).__name__}: {e}"
            results[run] = (finite, within)
            print(f"{text}{note} [{time.perf_counter() - START:.0f} s]", flush=True)
    finally:
        if pool is not None:  # a compile still running would hold the exit past the timeout
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
    print(verdict(results))
    bad = sum(not w for _, w in results.values())
    print(
        f"probe_fp16: done, {len(results)} runs, {bad} not ok, {time.perf_counter() - START:.0f} s"
    )
    if pool is not None:  # no wait at exit for the pool's manager thread and terminated workers
        sys.stdout.flush()
        os._exit(1 if bad else 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
