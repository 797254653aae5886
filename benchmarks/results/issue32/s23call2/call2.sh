#!/usr/bin/env bash
# Session 23 call 2: where 32 value columns go wrong, and what the passes would gain
set -u
O=${1:?out}; mkdir -p $O; cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c2cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a $O/summary.txt; }
timeout 150 python3 benchmarks/probe_wgmma32.py --out $O > $O/probe_wgmma32.log 2>&1 & P1=$!
timeout 200 python3 benchmarks/probe_settings.py --jobs 12 --out $O > $O/probe_settings.log 2>&1; st probe_settings $?
wait $P1; st probe_wgmma32 $?
S=8x4096x16x128,8x2048x32x256
kt() { local name=$1 items=$2 shapes=$3
  timeout 90 python3 benchmarks/kernel_times.py --shapes $shapes --label $name ${items:+--set $items} > $O/kt_$name.log 2>&1; st kt_$name $?; }
kt default "" $S
kt tp triton_backend.FORWARD_MODE=two_pass 8x2048x32x256
kt fbv32w2 "triton_backend.FORWARD_MODE=two_pass,states.TWO_PASS_BV=32,states.STATES_WARPS=2,states.SPLIT_WARPS=2,states.SPLIT_WIDE_WARPS=2" $S
kt fbv32 "triton_backend.FORWARD_MODE=two_pass,states.TWO_PASS_BV=32" $S
kt bbv32 states.BWD_STATES_BV=32 $S
kt dbv32 states.DSTATES_BV=32 $S
kt default2 "" $S
echo "call2: $((SECONDS - T0)) s" | tee -a $O/summary.txt
