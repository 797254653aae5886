#!/usr/bin/env bash
# Session 25 call 6: the folding state pass at D = 128 in one 128-column value block (8 warps,
# W formed once a chunk instead of by two programs), against the default (the rebuild), call
# 1's fold (two 64-column blocks) and the 128-column block without the fold; timing only.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c6cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
WIDE="states.BWD_STATES_BV=128,states.STATES_WARPS=8,triton_backend.SEQUENCE_PARALLEL_STATES=off"
declare -A SET=(
  [base]="states.STATES_REBUILD_MAX_BK=64"
  [fold]="states.STATES_REBUILD_MAX_BK=128"
  [foldwide]="states.STATES_REBUILD_MAX_BK=128,$WIDE"
  [wide]="$WIDE"
)
for r in 1 2; do for n in base fold foldwide wide; do
  timeout 100 python3 benchmarks/kernel_times.py --shapes 8x4096x16x128 --label "$n$r" \
    --set "${SET[$n]}" > "$O/kt_$n$r.log" 2>&1; st "kt_$n$r" $?
done; done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|states_kernel|rebuild" "$f" | grep -v JSON; done
echo "call6: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
