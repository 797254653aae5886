#!/usr/bin/env bash
# Session 25 call 4: the folding state pass's stages and warps at D = 64, alternating in
# kernel_times (timing only; a setting that wins is checked in a later call).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c4cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
declare -A SET=(
  [base]="states.STATES_REBUILD_MAX_BK=64"
  [s2]="states.STATES_STAGES_NARROW=2"
  [s1]="states.STATES_STAGES_NARROW=1"
  [w8]="states.STATES_WARPS=8"
)
for r in 1 2; do for n in base s2 s1 w8; do
  timeout 100 python3 benchmarks/kernel_times.py --shapes 16x2048x32x64 --label "$n$r" \
    --set "${SET[$n]}" > "$O/kt_$n$r.log" 2>&1; st "kt_$n$r" $?
done; done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|states_kernel" "$f" | grep -v JSON; done
echo "call4: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
