#!/usr/bin/env bash
# Session 28 call 4 (issue 32): the lean gradient kernels' epilogue loads — the key side's log α
# read before its value loop (gradients_lean.K_LOG_ALPHA_EARLY), q's tile hinted to L2 as the
# value side starts (V_PREFETCH) — checked bitwise on the GPU, timed alternating.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s28c4cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_log_alpha_ahead.py \
  > "$O/pytest.log" 2>&1; st pytest $?
L=gradients_lean
declare -A SET=(
  [prev]="$L.K_LOG_ALPHA_EARLY=0,$L.V_PREFETCH=0"
  [kg]="$L.K_LOG_ALPHA_EARLY=1,$L.V_PREFETCH=0"
  [vp]="$L.K_LOG_ALPHA_EARLY=0,$L.V_PREFETCH=1"
  [both]="$L.K_LOG_ALPHA_EARLY=1,$L.V_PREFETCH=1"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_prev1.log" ] && echo 70 || echo 150) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,8x2048x32x256 --label "$1$2" --set "${SET[$1]}" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in prev kg vp both; do kt $n 1; done
for n in both vp kg prev; do [ $((SECONDS - T0)) -lt 300 ] && kt $n 2; done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|lean" "$f" | grep -v JSON; done
echo "call4: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
