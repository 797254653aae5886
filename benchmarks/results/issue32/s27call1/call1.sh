#!/usr/bin/env bash
# Session 27 call 1: L2 prefetch hints (common.PREFETCH; the reverse pass's next step, the key
# side's epilogue) on the GPU: their bitwise test, then kernel_times alternating against the
# hints off, each side alone; and the reverse pass / forward at one 128-column value block.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c1cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefetch.py \
  tests/test_grads_key_split.py > "$O/pytest.log" 2>&1; st pytest $?
declare -A SET=(
  [base]="common.PREFETCH=0"
  [pf]="common.PREFETCH=1"
  [pfd]="gradients_lean.K_PREFETCH=0"
  [pfk]="dstates.DSTATES_PREFETCH=0"
  [dbv]="common.PREFETCH=0,dstates.DSTATES_BV=128,dstates.DSTATES_WARPS=8"
  [dbvpf]="dstates.DSTATES_BV=128,dstates.DSTATES_WARPS=8"
  [dw8]="dstates.DSTATES_WARPS=8"
  [fbv]="states.FUSED_BV=128,states.FUSED_WARPS=8"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 70 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,16x2048x32x64,8x2048x32x256 \
    --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in base pf pfd pfk dbv dbvpf dw8 fbv; do kt $n 1; done
for n in base pf pfd pfk dbvpf dw8 fbv dbv; do
  [ $((SECONDS - T0)) -lt 480 ] && kt $n 2
done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|dstates|grads_k_lean|forward_kernel" "$f" | grep -v JSON; done
echo "call1: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
