#!/usr/bin/env bash
# Ready for session 29's first call (issue 32). First, on the CPU, in this order:
#   git apply benchmarks/results/issue32/s28cpu/split_segments_log_alpha.patch
#   git apply benchmarks/results/issue32/s28cpu/whole_stores.patch
# (the split and segment passes' log α a step ahead under common.LOG_ALPHA_AHEAD, through the
# unsplit passes' common.gamma_and_next; states.STATES_WHOLE_STORES: the state pass's
# h and U, the reverse pass's dh and dU stored unmasked where the tile is whole; their tests in
# tests/test_log_alpha_ahead.py and tests/test_whole_stores.py). Then this script: the tests on
# the GPU, kernel_times alternating (the stores off/on at the first three shapes; log α ahead
# off/on at D = 256 and (1, 32768), where the split and segment kernels run). Writes into OUT.
#   bash benchmarks/results/issue32/s28cpu/next_whole_stores_call.sh "$OUT/s29c1"
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s29c1cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_whole_stores.py \
  tests/test_log_alpha_ahead.py > "$O/pytest.log" 2>&1; st pytest $?
kt() {  # NAME ROUND SET SHAPES
  timeout $([ -e "$O/kt_$1$(( $2 - 1 )).log" ] && echo 80 || echo 170) \
    python3 benchmarks/kernel_times.py --shapes "$4" --label "$1$2" --set "$3" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
S3=8x4096x16x128,16x2048x32x64,1x32768x16x128
L2=8x2048x32x256,1x32768x16x128
for r in 1 2; do
  kt wholeoff $r states.STATES_WHOLE_STORES=0 $S3; kt wholeon $r states.STATES_WHOLE_STORES=1 $S3
  kt aheadoff $r common.LOG_ALPHA_AHEAD=0 $L2; kt aheadon $r common.LOG_ALPHA_AHEAD=1 $L2
done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|states_kernel|dstates_kernel|split_forward" "$f" | grep -v JSON; done
echo "next call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
