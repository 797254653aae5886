#!/usr/bin/env bash
# Session 24 call 5: the prepare's diagonal inverses as 64-row products
# (prepare.PREPARE_WIDE_DIAGONAL) against the [4, 16, 16] batch, alternating in kernel_times;
# then check_triton --dtype all whole with it on.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c5cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
kt() {  # NAME SET
  timeout 100 python3 benchmarks/kernel_times.py --shapes 16x2048x32x64,8x4096x16x128 \
    --label "$1" ${2:+--set "$2"} > "$O/kt_$1.log" 2>&1; st "kt_$1" $?
}
W=prepare.PREPARE_WIDE_DIAGONAL=True
kt wide1 $W
kt stack1 ""
kt wide2 $W
kt stack2 ""
ms() { grep "(16, 2048, 32, 64) forward+backward" "$O/kt_$1.log" | awk '{print $(NF-1)}'; }
# the check only where the wide form is faster at D = 64 (forward + backward, both rounds)
if awk -v a="$(ms wide1)" -v b="$(ms stack1)" -v c="$(ms wide2)" -v d="$(ms stack2)" \
  'BEGIN { exit !(a + 0 > 0 && a < b - 0.01 && c < d - 0.01) }'; then
timeout 200 python3 benchmarks/check_triton.py --dtype all --compile-workers 15 --gpu-memory 50 \
  --set $W --out "$O/check_set.md" > "$O/check_set.log" 2>&1; st check_set $?
else
  echo "check_set: skipped (the wide form is not faster)" | tee -a "$O/summary.txt"
fi
grep -hE "wall time|ALL OK" "$O"/check_*.md
echo "call5: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
