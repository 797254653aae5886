#!/usr/bin/env bash
# Session 30, call 5 (issue 32): the reverse pass (chunk_dstates_kernel) in fla's dhu shape —
# 32 value columns a program, 2 pipeline stages at a 128-row key block (AOT sm_90 bf16 D = 128:
# 238 registers, no spill, 112 KB shared, two programs an SM; today 255 registers with a 296 B
# stack, 72 KB, one stage) — with kernel_times, alternating, two rounds (base, bv32: 32 columns
# at one stage, bv32s2), then check_triton --dtype all whole with bv32s2 (session 21 saw a
# 32-column miscompile of the reverse pass beside a 128-key head).
#   bash benchmarks/results/issue32/s30call5/call5.sh "$OUT"
set -u
OUT=${1:?out}; O=/tmp/s30c5; rm -rf "$O"; mkdir -p "$O"
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s30c5cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
S=8x4096x16x128,16x2048x32x64,1x32768x16x128,8x2048x32x256
B=dstates.DSTATES_BV=32 S2=dstates.DSTATES_STAGES_MAX_BK=128,dstates.DSTATES_STAGES=2
kt() {  # NAME ROUND [SET]
  timeout $([ "$2" = 1 ] && echo 150 || echo 80) python3 benchmarks/kernel_times.py --shapes $S \
    --label "$1$2" ${3:+--set "$3"} > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for r in 1 2; do kt base $r; kt bv32 $r "$B"; kt bv32s2 $r "$B,$S2"; done
timeout 230 python3 benchmarks/check_triton.py --dtype all --set "$B,$S2" \
  --out "$O/check_bv32s2.md" > "$O/check_bv32s2.log" 2>&1; st check_bv32s2 $?
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|dstates" "$f" | grep -v JSON; done
tail -3 "$O/check_bv32s2.log"
echo "call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
tar czf "$OUT/s30c5.tgz" -C /tmp s30c5
