#!/usr/bin/env bash
# Session 29 call 6 (issue 32): the rebuild holding its key tiles from λ to W
# (rebuild.REBUILD_KEEP_K) — its bitwise test on the GPU, then kernel_times alternating:
# base (KEEP_K off: 8 warps, 61 registers, 4 programs an SM), keep (72 registers: 3 an SM),
# keep64 (with REBUILD_MAXNREG 64: 63, no stack, 4 an SM), keepw4 (4 warps: 112 registers, 4 an
# SM, fla's w_u's shape of launch), w4 (4 warps without KEEP_K). Writes into OUT.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s29c6cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_save_t.py -k rebuild_gives \
  > "$O/pytest.log" 2>&1; st pytest $?
S=8x4096x16x128,1x32768x16x128,8x2048x32x256
kt() {  # NAME ROUND SET
  timeout $([ "$2" = 1 ] && echo 100 || echo 60) python3 benchmarks/kernel_times.py --shapes $S \
    --label "$1$2" --set "$3" > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for r in 1 2; do
  kt base $r rebuild.REBUILD_KEEP_K=0
  kt keep $r rebuild.REBUILD_KEEP_K=1
  kt keep64 $r rebuild.REBUILD_KEEP_K=1,rebuild.REBUILD_MAXNREG=64
  kt keepw4 $r rebuild.REBUILD_KEEP_K=1,rebuild.REBUILD_WARPS=4
  kt w4 $r rebuild.REBUILD_KEEP_K=0,rebuild.REBUILD_WARPS=4
  [ $((SECONDS - T0)) -gt 230 ] && break
done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|rebuild" "$f" | grep -v JSON; done
echo "call6: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
