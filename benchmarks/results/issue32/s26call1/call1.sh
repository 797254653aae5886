#!/usr/bin/env bash
# Session 26 call 1: the lean key side split over key blocks (gradients_lean.K_SPLIT_BK), its
# tests on the GPU, then kernel_times of the unsplit side (base) against the split's settings.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c1cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_grads_key_split.py \
  tests/test_rule_table.py > "$O/pytest.log" 2>&1; st pytest $?
declare -A SET=(
  [base]="gradients_lean.K_SPLIT_BK=0"
  [s4]="gradients_lean.K_SPLIT_BK=64"
  [s4s2]="gradients_lean.K_SPLIT_STAGES=2"
  [s4r168]="gradients_lean.K_SPLIT_STAGES=2,gradients.GRADS_LEAN_K_MAXNREG=168"
  [s8]="gradients_lean.K_SPLIT_WARPS=8"
  [s8r128]="gradients_lean.K_SPLIT_WARPS=8,gradients.GRADS_LEAN_K_MAXNREG=128"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 80 || echo 170) python3 benchmarks/kernel_times.py --shapes 8x4096x16x128,8x2048x32x256,1x32768x16x128 \
    --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in base s4 s4s2 s4r168 s8 s8r128; do kt $n 1; done
for n in base s4 s8r128 s4s2; do
  [ $((SECONDS - T0)) -lt 470 ] && kt $n 2
done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|grads_k" "$f" | grep -v JSON; done
echo "call1: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
