"""Nsight Compute's CSV (issue32_call.sh's NCU step: ``ncu --csv --page details``) as one row a
kernel launch: where its time goes, read off the hardware counters.

    python benchmarks/ncu_table.py results/issue32/s22call1/ncu.csv [ncu_fla.csv ...]

Columns: duration, SM clock, DRAM and compute (SM) throughput as % of peak, issue slots busy,
achieved occupancy (warps an SM) against its theoretical bound and what bounds it (blocks an SM
by registers / shared memory), registers a thread, spill requests, cycles a warp waits between
two issued instructions, L1 / L2 hit rates, instructions executed and the tensor pipe's busy
share where the call collected them; below the table each launch's three largest stall reasons
(warps stalled on each, per issued instruction: ``smsp__average_warps_issue_stalled_*``).
"""

from __future__ import annotations

import argparse
import csv
from collections import OrderedDict

COLUMNS = [  # (header, section, metric)
    ("µs", "GPU Speed Of Light Throughput", "Duration"),
    ("MHz", "GPU Speed Of Light Throughput", "SM Frequency"),
    ("DRAM %", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("SM %", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("issue %", "Compute Workload Analysis", "Issue Slots Busy"),
    ("warps", "Occupancy", "Achieved Active Warps Per SM"),
    ("bound", "Occupancy", "Theoretical Active Warps per SM"),
    ("blk reg", "Occupancy", "Block Limit Registers"),
    ("blk smem", "Occupancy", "Block Limit Shared Mem"),
    ("regs", "Launch Statistics", "Registers Per Thread"),
    ("spills", "Memory Workload Analysis", "Local Memory Spilling Requests"),
    ("cyc/issue", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("L1 hit %", "Memory Workload Analysis", "L1/TEX Hit Rate"),
    ("L2 hit %", "Memory Workload Analysis", "L2 Hit Rate"),
    ("Minst", "Command line profiler metrics", "smsp__inst_executed.sum"),
    (
        "gmma %",
        "Command line profiler metrics",
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    ),
]
STALL = "smsp__average_warps_issue_stalled_"


def number(text: str) -> float:
    try:  # "" where the call did not collect it, "n/a" where ncu could not
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def launches(path: str) -> OrderedDict[str, dict]:
    """Launch ID → {"name", "grid", "block", (section, metric): value, "stalls": {reason: v}}."""
    with open(path) as f:
        reader = csv.reader(line for line in f if line.startswith('"'))
        header = next(reader)
        out: OrderedDict[str, dict] = OrderedDict()
        for row in reader:
            d = dict(zip(header, row))
            entry = out.setdefault(
                d["ID"],
                {"name": d["Kernel Name"], "grid": d["Grid Size"], "block": d["Block Size"]},
            )
            entry[(d["Section Name"], d["Metric Name"])] = d["Metric Value"]
            if d["Metric Name"].startswith(STALL):
                reason = d["Metric Name"][len(STALL) :].split("_per_issue")[0]
                entry.setdefault("stalls", {})[reason] = number(d["Metric Value"])
    return out


def table(path: str) -> str:
    rows = launches(path)
    lines = [
        f"#### {path}",
        "",
        "| kernel | grid | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    stalls = []
    for entry in rows.values():
        cells = []
        for header, section, metric in COLUMNS:
            value = number(entry.get((section, metric), ""))
            if header == "µs":
                value /= 1e3
            elif header == "Minst":
                value /= 1e6
            elif header == "MHz":
                value /= 1e6
            cells.append(f"{value:.0f}" if header in ("MHz", "regs", "spills") else f"{value:.3g}")
        lines.append(f"| {entry['name'][:40]} | {entry['grid']} | " + " | ".join(cells) + " |")
        if entry.get("stalls"):
            top = sorted(entry["stalls"].items(), key=lambda kv: -kv[1])[:3]
            stalls.append(f"- {entry['name'][:40]}: " + ", ".join(f"{r} {v:.2f}" for r, v in top))
    return "\n".join(lines + [""] + stalls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", nargs="+", help="ncu --csv --page details output files")
    args = parser.parse_args(argv)
    for path in args.csv:
        print(table(path))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
