"""Per-instruction warp-stall samples of one kernel from a Nsight Compute source page (CSV, as
call1.sh exports it; the first kernel of the page): its total, the stall reasons, and the 40
heaviest SASS lines (``all``: every line in order). ``kernel=NAME``: the first kernel of that
name on the page instead (a page of several kernels, session 30's call 4).

    python stalls.py src_ours.csv.gz [all] [kernel=NAME]
"""

from __future__ import annotations

import csv
import gzip
import sys


def main(path: str, every: bool, kernel: str | None = None) -> None:
    rows = list(csv.reader(gzip.open(path, "rt")))
    if kernel is not None:  # the page from that kernel's "Kernel Name" line on
        start = next(i for i, r in enumerate(rows) if r[:2] == ["Kernel Name", kernel])
        rows = rows[start:]
    header, data = rows[1], rows[2:]
    end = next((i for i, r in enumerate(data) if r and r[0] == "Kernel Name"), len(data))
    data = data[:end]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = col["Warp Stall Sampling (All Samples)"]
    total = sum(int(r[samples] or 0) for r in data)
    print("total samples", total, "instructions", len(data))
    by_reason = {c: sum(int(r[col[c]] or 0) for r in data) for c in reasons}
    print(sorted(((v, k) for k, v in by_reason.items()), reverse=True)[:8])
    lines = []
    for n, r in enumerate(data):
        top = sorted(((int(r[col[c]] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        lines.append((n, int(r[samples] or 0), r[1].strip()[:60], top))
    for n, s, src, top in lines if every else sorted(lines, key=lambda x: -x[1])[:40]:
        print(f"{n:5d} {s:6d} {100 * s / total:5.1f}% {src:60s} {top}")


if __name__ == "__main__":
    names = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("kernel=")]
    main(sys.argv[1], "all" in sys.argv[2:], names[0] if names else None)
