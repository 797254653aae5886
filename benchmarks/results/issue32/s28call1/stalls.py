"""Per-instruction warp-stall samples of one kernel from a Nsight Compute source page (CSV, as
call1.sh exports it): total, the stall reasons, and the 40 heaviest SASS lines (or all, `all`).

    python stalls.py src_ours.csv.gz [all]
"""
import csv
import gzip
import sys
f = sys.argv[1]
rows = list(csv.reader(gzip.open(f, 'rt')))
hdr = rows[1]; data = rows[2:]
end = next((i for i, r in enumerate(data) if r and r[0] == "Kernel Name"), len(data)); data = data[:end]
ix = {h: i for i, h in enumerate(hdr)}
stall_cols = [h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
tot = sum(int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data)
print("total samples", tot, "instructions", len(data))
agg = {c: sum(int(r[ix[c]] or 0) for r in data) for c in stall_cols}
print(sorted(((v, k) for k, v in agg.items()), reverse=True)[:8])
out = []
for n, r in enumerate(data):
    s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
    top = sorted(((int(r[ix[c]] or 0), c[6:]) for c in stall_cols), reverse=True)[:2]
    out.append((n, s, r[1].strip()[:60], top))
if len(sys.argv) > 2 and sys.argv[2] == 'all':
    for n, s, src, top in out:
        print(f"{n:5d} {s:6d} {100*s/tot:5.1f}% {src:60s} {top}")
else:
    for n, s, src, top in sorted(out, key=lambda x: -x[1])[:40]:
        print(f"{n:5d} {s:6d} {100*s/tot:5.1f}% {src:60s} {top}")
