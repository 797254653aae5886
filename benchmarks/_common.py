"""What the benchmark and GPU-check scripts share: the commit they measured, fla (optional),
copy bandwidth, the device they run on, and their CPU smoke mode.

Every GPU script takes ``--smoke``: tiny shapes on the CPU through the Triton interpreter
(``TRITON_INTERPRET=1``, set by :func:`smoke_env` before Triton is imported), seconds each, no
fla. ``tests/test_gpu_scripts.py`` runs each one that way in CI, so a script that rots fails
there instead of on the next GPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# A script runs as `python benchmarks/X.py` from a checkout where deltaflow may not be installed
# (the GPU machine): the checkout is then importable, after any PYTHONPATH entry (which wins,
# so an older tree can be timed by putting it first).
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def smoke_requested(argv: list[str] | None = None) -> bool:
    """Whether ``--smoke`` is on the command line (read before Triton is imported)."""
    return "--smoke" in (sys.argv[1:] if argv is None else argv)


def smoke_env() -> None:
    """Switch the Triton interpreter on for a ``--smoke`` run. Must run before ``import triton``
    (the interpreter flag is read at import): scripts call it at the top when smoke-requested."""
    os.environ["TRITON_INTERPRET"] = "1"


def failure_verdict(e: BaseException) -> str:
    """A probe's one line on an exception: ``FAULT`` (a CUDA error: the process's context is
    gone) or ``ERROR``, where (the last deltaflow frame) and the message's first line."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "deltaflow" in f.filename]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
    kind = "FAULT" if "illegal" in str(e) or "CUDA error" in str(e) else "ERROR"
    return f"{kind} in {where}: {str(e).splitlines()[0][:160]}"


def probe_verdicts(cmd: list[str], timeout: int) -> tuple[list[str], str | None]:
    """Run one probe process (``CUDA_LAUNCH_BLOCKING=1``: a fault is raised at its launch, which
    the traceback then names): the lines it printed after ``VERDICT ``, and None; or no lines
    and why there are none (``TIMEOUT``, or ``DIED`` and its last output line)."""
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], "TIMEOUT"
    out = r.stdout + r.stderr
    verdicts = [ln[8:] for ln in out.splitlines() if ln.startswith("VERDICT ")]
    tail = out.strip().splitlines()[-1:] if out.strip() else ["(no output)"]
    return verdicts, None if verdicts else f"DIED {tail[0][:160]}"


def device(smoke: bool) -> str:
    """'cpu' in smoke mode (Triton interpreter), else 'cuda' (refused with one line if absent)."""
    if smoke:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: this script needs a CUDA GPU; run it with --smoke on a CPU")
    return "cuda"


def device_name(dev: str) -> str:
    import torch

    return torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)"


def git_commit() -> str:
    """This checkout's commit, with '-dirty' when the files differ from it; 'unknown' without
    git. ``DELTAFLOW_COMMIT`` overrides it: a copy synced onto a device machine may carry an
    older .git than its working tree, so the sender names the commit it sent."""
    if os.environ.get("DELTAFLOW_COMMIT"):
        return os.environ["DELTAFLOW_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def load_fla(*names: str) -> Any:
    """fla's functions or classes by name (``"fla.ops.gated_delta_rule:chunk_gated_delta_rule"``),
    or None with one printed line when fla is not installed. Timing only: fla's output kernel
    takes its fast path on the Triton here (``TRITON_ABOVE_3_7_1``)."""
    import importlib

    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
        chunk_o.TRITON_ABOVE_3_7_1 = True
        found = []
        for name in names:
            module, attr = name.split(":")
            found.append(getattr(importlib.import_module(module), attr))
    except Exception as e:  # noqa: BLE001 - report and go on without fla
        print(f"fla not available: {e!r}")
        return None
    return found[0] if len(found) == 1 else tuple(found)


def copy_bandwidth(dev: str = "cuda") -> float:
    """Bytes/s of a 512 MiB device copy, read + written counted (median of do_bench): the
    memory floor's denominator. NaN off the GPU."""
    import torch

    if dev != "cuda":
        return float("nan")
    import triton.testing

    x = torch.empty(2**29, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def low_precision(smoke: bool) -> Any:
    """The low-precision dtype a script checks: bf16 on the GPU; fp16 in smoke mode, because the
    CPU interpreter's bf16 ``tl.dot`` is wrong (numpy has no bf16; tests/test_triton_interpret.py
    does the same)."""
    import torch

    return torch.float16 if smoke else torch.bfloat16


def bench_ms(fn: Any, dev: str, graph: bool = False, **do_bench_kw: Any) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on the GPU (CUDA events);
    off it (smoke mode) one ``perf_counter`` call, which checks the plumbing, not the speed.
    ``graph``: replays of ``fn`` captured in a CUDA graph (``do_bench_cudagraph``), the GPU's
    time alone: a function whose host work (autograd, allocations, launches) takes about as long
    as its kernels is otherwise timed at the host's pace, which varies by machine and moment."""
    if dev == "cuda":
        import triton.testing

        if graph:
            return triton.testing.do_bench_cudagraph(fn, return_mode="median", **do_bench_kw)
        return triton.testing.do_bench(fn, return_mode="median", **do_bench_kw)
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def output_dir(out: str | None, smoke: bool, default: str = "benchmarks/results") -> Path:
    """Where a script writes its report: ``--out`` when given; else, in smoke mode, a fresh
    temporary folder (a smoke report must never land in benchmarks/results/); else ``default``."""
    import tempfile

    if out:
        path = Path(out)
    elif smoke:
        path = Path(tempfile.mkdtemp(prefix="deltaflow_smoke_"))
    else:
        path = Path(default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def smoke_corpus(folder: Path) -> Path:
    """A tiny corpus for smoke runs of the LM-training scripts (byte tokenizer): 12 .txt
    documents, so the corpus loader's every-tenth-file validation split has one."""
    folder.mkdir(parents=True, exist_ok=True)
    words = "the delta rule writes keys to values and reads them back with a query".split()
    for i in range(12):
        text = " ".join(words[(i * j) % len(words)] for j in range(400))
        (folder / f"doc{i:02d}.txt").write_text(text + "\n")
    return folder
