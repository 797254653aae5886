#!/usr/bin/env bash
# Session 28 call 3 (issue 32): log α a step ahead in the three sequential passes — checked
# bitwise on the GPU (tests/test_log_alpha_ahead.py, fp32 and bf16), then kernel_times with the
# switch off and on, alternating, at the four shapes.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s28c3cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_log_alpha_ahead.py \
  > "$O/pytest.log" 2>&1; st pytest $?
kt() {  # ON ROUND
  timeout $([ -e "$O/kt_off1.log" ] && echo 80 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,16x2048x32x64,1x32768x16x128,8x2048x32x256 --label "$1$2" \
    --set "common.LOG_ALPHA_AHEAD=$([ "$1" = on ] && echo 1 || echo 0)" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
kt off 1; kt on 1; kt on 2; kt off 2
[ $((SECONDS - T0)) -lt 440 ] && { kt off 3; kt on 3; }
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|forward:|chunk_states|chunk_dstates|chunk_forward" "$f" | grep -v JSON; done
echo "call3: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
