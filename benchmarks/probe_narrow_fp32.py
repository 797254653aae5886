"""Issue 32, session 20: which narrow fp32 heads fault on the GPU, and which key-block floor
fixes them, in one call.

The H200 gave an illegal memory access at fp32 (B, T, H) = (1, 65, 2), Dk = 20, Dv = 12 (key
and value blocks 32 and 16; tests/test_save_t.py's ``kaczmarz-T65-nobeta``, session 19 call 3),
raised at the first sync after the default backward. The bounds-checking interpreter finds no
access outside any tensor there (tests/test_kernel_bounds.py), so it is GPU-only, like session
17's Dk = 16 / Dv = 64 fault that ``common.FP32_WIDE_VALUE_MIN_KEY_BLOCK`` fixed by running
such heads on 64-column key blocks. This probe runs every (Dk, Dv) of ``--heads`` in its own
process (a fault poisons the CUDA context) with ``CUDA_LAUNCH_BLOCKING=1`` (the error is raised
at the faulting launch, so the traceback names the launcher), under each
``common.FP32_MIN_KEY_BLOCK_WHEN`` of ``--when``, and each save mode of ``--save``: the check's
own case (benchmarks/_check_cases.case_op: both forward forms, the gradients, against the
float64 reference at fp32's 1e-4) for delta and kaczmarz. One line per process:

    HEADS WHEN SAVE: ok (worst 3.1e-06) | over (worst ...) | FAULT in <launcher> | ERROR ...

    timeout 300 python benchmarks/probe_narrow_fp32.py --out /tmp/probe   # GPU: ~1-2 min
    python benchmarks/probe_narrow_fp32.py --smoke                        # CPU interpreter (CI)

Exit status 0 when every case of the last ``--when`` passed.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import failure_verdict, probe_verdicts, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

HERE = Path(__file__).resolve().parent
# Key and value heads: the fault, its neighbours in block width (key block 32 / value 16 and the
# other way), equal narrow blocks, and the shapes the floor already covers or the GPU passed.
HEADS = "20x12,32x16,24x12,16x12,20x20,32x32,12x20,48x16,48x32,64x12,16x16,16x64,64x16"
SMOKE_HEADS = "20x12"
RULES = ("kaczmarz", "delta")  # the faulting case's rule first


def case(Dk: int, Dv: int, when: str, save: str, device: str) -> str:
    """One process's work: both rules at (1, 65, 2, Dk, Dv) fp32; a verdict line."""
    import _check_cases

    from deltaflow.ops import triton_backend
    from deltaflow.ops.triton import common

    common.FP32_MIN_KEY_BLOCK_WHEN = when
    triton_backend.SAVE_FOR_BACKWARD = save
    worst = 0.0
    try:
        for seed, rule in enumerate(RULES):
            for row in _check_cases.case_op("probe", 1, 65, Dk, Dv, None, rule, False, "fp32",
                                            seed + 3, device):  # fmt: skip
                worst = max(worst, _check_cases.worst(row[4]))
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the verdict names it
        return failure_verdict(e)
    if worst != worst or worst > _check_cases.TOL["fp32"]:  # NaN or over fp32's tolerance
        return f"over (worst {worst:.1e})"
    return f"ok (worst {worst:.1e})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", default=None, help=f"DkxDv,... (default {HEADS})")
    p.add_argument("--when", default="wider_value,unequal", help="FP32_MIN_KEY_BLOCK_WHEN values")
    p.add_argument("--save", default="none,t", help="SAVE_FOR_BACKWARD values")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--out", default="", help="folder for probe.txt (the lines)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, one head pair")
    p.add_argument("--case", default="", help=argparse.SUPPRESS)  # Dk,Dv,when,save: one process
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.case:
        Dk, Dv, when, save = args.case.split(",")
        print("VERDICT " + case(int(Dk), int(Dv), when, save, device), flush=True)
        return 0
    heads = [tuple(int(x) for x in h.split("x")) for h in (args.heads or (
        SMOKE_HEADS if args.smoke else HEADS)).split(",")]  # fmt: skip
    whens, saves = args.when.split(","), args.save.split(",")
    jobs = [(dk, dv, w, s) for w in whens for s in saves for dk, dv in heads]

    def one(job) -> str:
        dk, dv, w, s = job
        cmd = [sys.executable, __file__, "--case", f"{dk},{dv},{w},{s}"]
        cmd += ["--smoke"] if args.smoke else []
        verdicts, failure = probe_verdicts(cmd, timeout=240)
        line = f"{dk}x{dv} {w} {s}: {failure or verdicts[0]}"
        print(line, flush=True)
        return line

    with ThreadPoolExecutor(args.jobs) as pool:
        lines = list(pool.map(one, jobs))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe.txt").write_text("\n".join(lines) + "\n")
    last = [ln for ln, j in zip(lines, jobs) if j[2] == whens[-1]]
    bad = [ln for ln in last if ": ok " not in ln]
    print(f"probe: {len(lines)} cases, {len(bad)} not ok under {whens[-1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
