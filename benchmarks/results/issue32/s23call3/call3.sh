#!/usr/bin/env bash
# Session 23 call 3: the split fused forward's stages / rows / warps at D = 256 (and variants
# handed in as NAME=ITEMS arguments), kernel_times each, the default first and last
set -u
O=${1:?out}; shift; mkdir -p $O; cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c3cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a $O/summary.txt; }
kt() { local name=$1 items=$2 shapes=$3
  timeout 90 python3 benchmarks/kernel_times.py --shapes $shapes --label $name ${items:+--set $items} > $O/kt_$name.log 2>&1; st kt_$name $?; }
S4=8x2048x32x256
ALL=8x4096x16x128,1x32768x16x128,16x2048x32x64,8x2048x32x256
kt default "" $ALL
kt sf1 states.SPLIT_FORWARD_STAGES=1 $S4
kt sf1k64 states.SPLIT_FORWARD_STAGES=1,states.SPLIT_FORWARD_K=64 $S4
kt sf1w8 states.SPLIT_FORWARD_STAGES=1,states.SPLIT_FORWARD_WARPS=8 $S4
kt sfk64 states.SPLIT_FORWARD_K=64 $S4
kt sfw8 states.SPLIT_FORWARD_WARPS=8 $S4
for arg in "$@"; do kt "${arg%%=*}" "${arg#*=}" $ALL; done
kt default2 "" $ALL
echo "call3: $((SECONDS - T0)) s" | tee -a $O/summary.txt
