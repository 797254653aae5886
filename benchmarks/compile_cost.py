"""What every Triton kernel specialization of ``check_triton.py`` costs to compile, without a GPU:
compile seconds, registers, spill stack (local memory per thread) and shared memory, for a
target GPU architecture (default sm_90, the H100), on a CPU.

    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/compile_cost.py [--only TEXT,...]
        [--skip TEXT,...] [--dtype bf16|fp32|both] [--arch 90] [--workers 1] [--json FILE]
        [--set MODULE.NAME=VALUE,...]

Put the Triton of the GPU machine first on the path (its ptxas is what compiles). Each
specialization is found by tracing its check_triton case with the launches intercepted
(``_launches.py``) and compiled through Triton's own warm-up path into a fresh cache, one process
per specialization, so the seconds are a cold compile's. Wall seconds on a shared CPU: compare
them with each other, not with another machine's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="compile_cost_"))
os.environ.pop("TRITON_INTERPRET", None)  # compiling, not interpreting

ARCH = 90


def _fake_driver(arch: int) -> None:
    """A stand-in for the CUDA driver where there is none: the target is all a compile needs."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

    driver.set_active(Driver())


def _init(arch: int, settings: dict[str, Any] | None = None) -> None:
    """A worker's start: the stand-in driver, and the ``--set`` settings (each worker is a
    fresh process: what the parent set is not there)."""
    import torch

    if not torch.cuda.is_available():
        _fake_driver(arch)
    if settings:
        import _settings

        _settings.apply(settings)


def measure(kind: str, args: tuple, key: Any) -> dict[str, Any]:
    """Compile ``key`` (a Specialization of case ``(kind, args)``) and read its resources."""
    import check_triton
    from _launches import compile_launch, resource_usage, specialization

    found: dict[str, Any] = {}

    def handler(fn: Any, run: Any, kwargs: dict[str, Any]) -> None:
        if "kernel" not in found and specialization(fn, kwargs) == key:
            start = time.perf_counter()
            kernel = compile_launch(fn, run, kwargs)
            found.update(seconds=time.perf_counter() - start, kernel=kernel)

    check_triton.trace(kind, args, handler)
    kernel = found.pop("kernel")
    return {"label": key.label(), **found, **resource_usage(kernel)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated texts a label must hold")
    parser.add_argument("--skip", default=None, help="comma-separated texts: labels to leave out")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--arch", type=int, default=ARCH, help="compute capability, e.g. 90")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the rows here")
    import _settings

    _settings.add_settings_arg(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        settings = _settings.parse(args.set)
    except _settings.SettingError as e:
        parser.error(str(e))
    _settings.apply(settings)  # the plan's traces here, and each worker's (_init)
    import check_triton

    dtypes = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
    from _check_schedule import first_case_of

    cases = check_triton.plan(dtypes, False, "cuda")
    keys = first_case_of(cases, [check_triton.trace(*case) for case in cases])
    wanted = args.only.split(",") if args.only else None
    skip = args.skip.split(",") if args.skip else []
    todo = [
        (k, c)
        for k, c in keys.items()
        if (not wanted or all(w in k.label() for w in wanted))
        and not any(s in k.label() for s in skip)
    ]
    print(f"{len(todo)} of {len(keys)} specializations, sm_{args.arch}", flush=True)
    rows = []
    ctx = multiprocessing.get_context("spawn")  # torch's threads do not survive a fork
    with ProcessPoolExecutor(args.workers, ctx, _init, (args.arch, settings)) as pool:
        futures = [pool.submit(measure, *case, key) for key, case in todo]
        for future in futures:
            row = future.result()
            rows.append(row)
            print(
                f"{row['seconds']:6.1f} s  REG {row.get('REG', '?'):>3}  "
                f"STACK {row.get('STACK', '?'):>6}  SHARED {row.get('SHARED', '?'):>6}  "
                f"{row['label']}",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"compile_cost: {sum(r['seconds'] for r in rows):.0f} s of compiling in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
