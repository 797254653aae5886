#!/usr/bin/env bash
# Session 24 call 2 (kernel_times only, trees alternating): helper h41's forward state pass
# (build/h41: main + branch h41c) against main, with and without STATES_PEEL; where the
# prepare's time goes (build/pskip1: T's four CHUNK^3 merge products skipped, build/pskip2: no
# inverse at all; TIMING ONLY, wrong results) and the training prepare's T at tf32 instead of
# "pair" (prepare.BACKWARD_T_PRECISION=tf32). Each tree runs its own scripts (PYTHONPATH=tree:
# its deltaflow wins; _common appends the root after it).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c2cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
kt() {  # NAME TREE SET SHAPES
  local name=$1 tree=$2 items=$3 shapes=$4
  (cd "$tree" && PYTHONPATH=$PWD timeout 150 python3 benchmarks/kernel_times.py --shapes "$shapes" \
    --label "$name" ${items:+--set "$items"} > "$O/kt_$name.log" 2>&1); st "kt_$name" $?
}
check() {  # NAME TREE LIMIT ARGS...
  local name=$1 tree=$2 limit=$3; shift 3
  (cd "$tree" && PYTHONPATH=$PWD timeout "$limit" python3 benchmarks/check_triton.py \
    --compile-workers 14 --gpu-memory 50 --out "$O/check_$name.md" "$@" > "$O/check_$name.log" 2>&1)
  st "check_$name" $?
}
S=8x4096x16x128,16x2048x32x64,1x32768x16x128
P=16x2048x32x64,8x4096x16x128
kt main1 . "" $S
kt h41_1 build/h41 "" $S
kt h41peel1 build/h41 states.STATES_PEEL=True $S
kt main2 . "" $S
kt h41_2 build/h41 "" $S
kt h41peel2 build/h41 states.STATES_PEEL=True $S
kt tpair_tf32 . prepare.BACKWARD_T_PRECISION=tf32 $P
kt pskip1 build/pskip1 "" $P
kt pskip2 build/pskip2 "" $P
kt main3 . "" $P
echo "call2: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
