#!/usr/bin/env bash
# Session 26 call 3: the split key side's blocks and warps (32-column blocks), and at D = 64 the
# lean pair (split in two 32-column blocks) instead of the fused kernel; kernel_times
# alternating, the split's tests on the GPU at 64 and 32 columns first.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c3cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_grads_key_split.py > "$O/pytest.log" 2>&1
st pytest $?
declare -A SET=(
  [base]="gradients_lean.K_SPLIT_BK=64"
  [b32w4]="gradients_lean.K_SPLIT_BK=32"
  [b32w8]="gradients_lean.K_SPLIT_BK=32,gradients_lean.K_SPLIT_WARPS=8"
  [b32r168]="gradients_lean.K_SPLIT_BK=32,gradients_lean.K_SPLIT_STAGES=2,gradients.GRADS_LEAN_K_MAXNREG=168"
  [lean64]="gradients.GRADS_FUSED=off,gradients.GRADS_LEAN=on"
  [lean64s]="gradients.GRADS_FUSED=off,gradients.GRADS_LEAN=on,gradients_lean.K_SPLIT_BK=32"
)
declare -A SHAPES=(
  [base]=8x4096x16x128,16x2048x32x64,8x2048x32x256 [b32w4]=8x4096x16x128,8x2048x32x256
  [b32w8]=8x4096x16x128,8x2048x32x256 [b32r168]=8x4096x16x128,8x2048x32x256
  [lean64]=16x2048x32x64 [lean64s]=16x2048x32x64
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 80 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes "${SHAPES[$1]}" --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2.log" 2>&1
  st "kt_$1$2" $?
}
for n in base b32w4 b32w8 b32r168 lean64 lean64s; do kt $n 1; done
for n in base b32w4 b32w8 lean64 lean64s; do [ $((SECONDS - T0)) -lt 480 ] && kt $n 2; done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|grads" "$f" | grep -v JSON; done
echo "call3: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
