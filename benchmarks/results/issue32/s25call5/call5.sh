#!/usr/bin/env bash
# Session 25 call 5: the folding state pass at 4 and 5 stages at D = 64, alternating in
# kernel_times (timing only; a setting that wins is checked in a later call).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c5cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
declare -A SET=(
  [base]="states.STATES_REBUILD_MAX_BK=64"
  [s4]="states.STATES_STAGES_NARROW=4"
  [s5]="states.STATES_STAGES_NARROW=5"
  [d4]="dstates.DSTATES_STAGES=4"
)
for r in 1 2; do for n in base s4 s5 d4; do
  timeout 100 python3 benchmarks/kernel_times.py --shapes 16x2048x32x64 --label "$n$r" \
    --set "${SET[$n]}" > "$O/kt_$n$r.log" 2>&1; st "kt_$n$r" $?
done; done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|states_kernel|dstates_kernel" "$f" | grep -v JSON; done
echo "call5: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
