#!/usr/bin/env bash
# Session 23 call 5: SPLIT_FORWARD_P timed against the default (alternating), then checked whole
set -u
O=${1:?out}; mkdir -p $O; cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c5cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a $O/summary.txt; }
kt() { local name=$1 items=$2 shapes=$3
  timeout 90 python3 benchmarks/kernel_times.py --shapes $shapes --label $name ${items:+--set $items} > $O/kt_$name.log 2>&1; st kt_$name $?; }
S=8x2048x32x256,8x4096x16x128
kt default1 "" $S
kt p1 states.SPLIT_FORWARD_P=True $S
kt default2 "" $S
kt p2 states.SPLIT_FORWARD_P=True $S
timeout 300 python3 benchmarks/check_triton.py --dtype all --compile-workers 14 --gpu-memory 50 \
  --set states.SPLIT_FORWARD_P=True --out $O/check_set.md > $O/check_set.log 2>&1; st check_set $?
grep -hE "wall time|ALL OK" $O/check_set.md
echo "call5: $((SECONDS - T0)) s" | tee -a $O/summary.txt
