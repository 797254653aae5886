#!/usr/bin/env bash
# Session 29 call 3 (issue 32): (1) which torch kernels the op's forward + backward launches
# (probe_small_ops.py: full names and stacks); (2) the rebuild's launch, kernel_times
# alternating: default (8 warps, Triton's 3 stages: 61 registers, 32 KB, 4 programs an SM at
# D = 128), st1 (1 stage: 54, 16 KB), st2 (58, 24 KB), mx48 (48 registers, 40 B of stack, 5 an
# SM), st1mx48 (48, no stack, 16 KB, 5 an SM). Writes into OUT.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s29c3cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 120 python3 benchmarks/results/issue32/s29call3/probe_small_ops.py > "$O/probe.log" 2>&1
st probe $?
S=8x4096x16x128,1x32768x16x128,8x2048x32x256
kt() {  # NAME ROUND SET
  timeout $([ "$2" = 1 ] && echo 120 || echo 70) python3 benchmarks/kernel_times.py --shapes $S \
    --label "$1$2" --set "$3" > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for r in 1 2; do
  kt default $r rebuild.REBUILD_STAGES=0
  kt st1 $r rebuild.REBUILD_STAGES=1
  kt st1mx48 $r rebuild.REBUILD_STAGES=1,rebuild.REBUILD_MAXNREG=48
  kt mx48 $r rebuild.REBUILD_MAXNREG=48
  kt st2 $r rebuild.REBUILD_STAGES=2
  [ $((SECONDS - T0)) -gt 330 ] && break
done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|rebuild" "$f" | grep -v JSON; done
echo "call3: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
