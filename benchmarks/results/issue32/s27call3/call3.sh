#!/usr/bin/env bash
# Session 27 call 3: the lean kernels hinting the first tiles of the program one wave on
# (gradients_lean.K_AHEAD_PER_SM, V_AHEAD_PER_SM; off by default until measured), each side and
# both, kernel_times alternating; the hints' bitwise GPU test with them on.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c3cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
declare -A SET=(
  [base]="gradients_lean.K_AHEAD_PER_SM=0,gradients_lean.V_AHEAD_PER_SM=0"
  [kv2]="gradients_lean.K_AHEAD_PER_SM=2,gradients_lean.V_AHEAD_PER_SM=2"
  [k2]="gradients_lean.K_AHEAD_PER_SM=2"
  [v2]="gradients_lean.V_AHEAD_PER_SM=2"
  [kv4]="gradients_lean.K_AHEAD_PER_SM=4,gradients_lean.V_AHEAD_PER_SM=4"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 70 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,1x32768x16x128 --label "$1$2" --set "${SET[$1]}" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in base kv2 k2 v2 kv4; do kt $n 1; done
for n in kv2 base v2 k2 kv4; do kt $n 2; done
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_prefetch.py > "$O/pytest.log" 2>&1
st pytest $?
for f in "$O"/kt_*.log; do grep -E "forward\+backward|grads_._lean" "$f" | grep -v JSON; done
echo "call3: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
