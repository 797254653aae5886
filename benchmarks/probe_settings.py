"""Which kernel settings are right on the GPU, quickly: check_triton's op case (both forward
forms and every gradient against the float64 reference, at the dtype's tolerance) under each of
several ``--set`` variants, each variant in a process of its own with ``CUDA_LAUNCH_BLOCKING=1``
(a fault poisons its CUDA context and names the launcher), the variants side by side.

Issue 32, session 23: fla's state passes run 32 value columns at D = 256 (its autotuner's pick:
2048 programs of 2 warps where ours are 1024 of 4, one an SM), and ours miscompiled there
(session 21: 32 value columns beside a key head of 128 or more, bf16 and fp16, however the state
was blocked, in the reverse pass). This maps which passes, warps, stages and row blocks are
right at 32 columns before any of them is timed. One line per variant and shape:

    NAME SHAPE: ok (worst 3.1e-03) | over (worst ...) | FAULT in <launcher> | ERROR ...

    timeout 300 python benchmarks/probe_settings.py --out /tmp/probe \
        --variant "fbv32:states.TWO_PASS_BV=32" --variant "dbv32:dstates.DSTATES_BV=32"
    python benchmarks/probe_settings.py --smoke        # CPU interpreter, toy shape (CI)

Exit status 0 when every line is ok. ``--variant`` as kernels.py's (NAME:MODULE.NAME=VALUE,...);
none given: the default and the 32-column variants below.
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
# (label, B, T, Dk, Dv): the half-precision heads the 32-column blocks failed at, a partial last
# chunk, both key widths, Dk != Dv
SHAPES = [("T=200 D=128", 1, 200, 128, 128), ("T=130 D=256", 1, 130, 256, 256),
          ("T=70 Dk=128 Dv=64", 2, 70, 128, 64)]  # fmt: skip
SMOKE_SHAPES = [("T=65", 1, 65, 32, 16)]
RULES = ("delta", "kaczmarz")  # with and without β; the decay comes with delta's inputs
# The plain state kernels, not their segmented form (T here is a few chunks)
BASE = "triton_backend.SEQUENCE_PARALLEL_STATES=off"
S32 = "states.TWO_PASS_BV=32"  # the forward's two-pass state pass
VARIANTS = {
    "default": "",
    "fbv32": S32,
    "fbv32w2": f"{S32},states.STATES_WARPS=2,states.SPLIT_WARPS=2,states.SPLIT_WIDE_WARPS=2",
    "fbv32s64": f"{S32},states.STATES_SPLIT_K=64",
    "fbv32s64w2": f"{S32},states.STATES_SPLIT_K=64,states.SPLIT_WARPS=2,states.SPLIT_WIDE_WARPS=2",
    "fbv32st1": f"{S32},states.STATES_STAGES=1,states.STATES_STAGES_NARROW=1",
    "bbv32": "states.BWD_STATES_BV=32",
    "fusedbv32": "states.FUSED_BV=32",
    "dbv32": "dstates.DSTATES_BV=32",
    "dbv32s64w2": "dstates.DSTATES_BV=32,dstates.DSTATES_SPLIT_K=64,"
    "dstates.DSTATES_SPLIT_ABOVE_BK=0,states.SPLIT_WARPS=2,states.SPLIT_WIDE_WARPS=2",
}


def case(items: str, dtype: str, device: str, smoke: bool) -> list[str]:
    """One process's work: every shape and rule under ``items``; a verdict per shape."""
    import _check_cases
    import _settings

    _settings.apply(_settings.parse([f"{BASE},{items}" if items else BASE]))
    lines = []
    for label, B, T, Dk, Dv in SMOKE_SHAPES if smoke else SHAPES:
        worst = 0.0
        try:
            for seed, rule in enumerate(RULES):
                rows = _check_cases.case_op(label, B, T, Dk, Dv, None, rule, False, dtype,
                                            seed + 5, device)  # fmt: skip
                for row in rows:
                    worst = max(worst, _check_cases.worst(row[4]))
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the verdict names it
            lines.append(f"{label}: {failure_verdict(e)}")
            if lines[-1].startswith(f"{label}: FAULT"):
                break  # the context is gone
            continue
        bad = worst != worst or worst > _check_cases.TOL[dtype]  # NaN or over the tolerance
        lines.append(f"{label}: {'over' if bad else 'ok'} (worst {worst:.1e})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", default=[], help="NAME:MODULE.NAME=VALUE,...")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--out", default="", help="folder for probe.txt (the lines)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, toy shape")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one process's items
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.case is not None:
        for line in case(args.case, args.dtype, device, args.smoke):
            print("VERDICT " + line, flush=True)
        return 0
    variants = dict(VARIANTS)
    if args.variant:
        variants = {}
        for text in args.variant:
            name, colon, items = text.partition(":")
            if not colon or not name or name in variants:
                p.error(f"--variant {text!r}: expected NAME:MODULE.NAME=VALUE[,...], a new NAME")
            variants[name] = items
    if args.smoke:
        variants = dict(list(variants.items())[:2])  # the schedule, not the map
    import _settings

    for name, items in variants.items():  # a typo fails here, before any process starts
        try:
            _settings.parse([items])
        except _settings.SettingError as e:
            p.error(f"--variant {name}: {e}")

    def one(name: str) -> list[str]:
        cmd = [sys.executable, __file__, "--case", variants[name], "--dtype", args.dtype]
        cmd += ["--smoke"] if args.smoke else []
        verdicts, failure = probe_verdicts(cmd, timeout=280)
        lines = [f"{name}: {failure}"] if failure else [f"{name} {v}" for v in verdicts]
        print("\n".join(lines), flush=True)
        return lines

    with ThreadPoolExecutor(args.jobs) as pool:
        lines = [ln for lines in pool.map(one, variants) for ln in lines]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe.txt").write_text("\n".join(lines) + "\n")
    bad = [ln for ln in lines if ": ok " not in ln]
    print(f"probe_settings: {len(lines)} lines, {len(bad)} not ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
