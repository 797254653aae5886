#!/usr/bin/env bash
# Session 25 call 9: the unsplit reverse pass at D = 128 reading scale·P from the backward's
# rebuild (dstates.DSTATES_P_UNSPLIT_MIN_BK = 128; AOT: 255 registers, 112 B of stack against
# 272), with 1 and 2 stages, against the default, alternating in kernel_times; timing only
# (the check runs in a later call where it wins).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c9cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
declare -A SET=(
  [base]="dstates.DSTATES_P_UNSPLIT_MIN_BK=0"
  [p]="dstates.DSTATES_P_UNSPLIT_MIN_BK=128"
  [ps2]="dstates.DSTATES_P_UNSPLIT_MIN_BK=128,dstates.DSTATES_STAGES=2,dstates.DSTATES_STAGES_MAX_BK=128"
)
for r in 1 2; do for n in base p ps2; do
  timeout 90 python3 benchmarks/kernel_times.py --shapes 8x4096x16x128 --label "$n$r" \
    --set "${SET[$n]}" > "$O/kt_$n$r.log" 2>&1; st "kt_$n$r" $?
done; done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|dstates|rebuild" "$f" | grep -v JSON; done
echo "call9: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
