#!/usr/bin/env bash
# Session 24 call 3: the prepare's T by row halves (six HALF^3 products where four CHUNK^3 were)
# timed against its parent (tree build/base, alternating, kernel_times at the four shapes); the
# split reverse pass's P from the rebuild (dstates.DSTATES_P, off) timed at D = 256; then
# check_triton --dtype all whole at the checkout, and its D = 256 cases with DSTATES_P on.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c3cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
kt() {  # NAME TREE SET SHAPES
  local name=$1 tree=$2 items=$3 shapes=$4
  (cd "$tree" && PYTHONPATH=$PWD timeout 150 python3 benchmarks/kernel_times.py --shapes "$shapes" \
    --label "$name" ${items:+--set "$items"} > "$O/kt_$name.log" 2>&1); st "kt_$name" $?
}
S=16x2048x32x64,8x4096x16x128,1x32768x16x128,8x2048x32x256
kt base1 build/base "" $S
kt halves1 . "" $S
kt base2 build/base "" $S
kt halves2 . "" $S
kt dsp_p1 . dstates.DSTATES_P=True 8x2048x32x256
kt dsp_off . "" 8x2048x32x256
kt dsp_p2 . dstates.DSTATES_P=True 8x2048x32x256
PYTHONPATH=$ROOT timeout 330 python3 benchmarks/check_triton.py --dtype all --compile-workers 15 \
  --gpu-memory 50 --out "$O/check_triton.md" > "$O/check_triton.log" 2>&1; st check_triton $?
PYTHONPATH=$ROOT timeout 150 python3 benchmarks/check_triton.py --dtype all --compile-workers 15 \
  --gpu-memory 50 --only Dk=Dv=256 --set dstates.DSTATES_P=True --out "$O/check_set.md" \
  > "$O/check_set.log" 2>&1; st check_set $?
grep -hE "wall time|ALL OK" "$O"/check_*.md
echo "call3: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
