#!/usr/bin/env bash
# Ready for session 29's first call (issue 32): the state passes' stores without masks where the
# tile is whole. First, on the CPU: `git apply benchmarks/results/issue32/s28cpu/whole_stores.patch`
# (states.STATES_WHOLE_STORES, on; the state pass's h and U, the reverse pass's dh and dU;
# tests/test_whole_stores.py). Then this script: the test on the GPU, kernel_times with the switch
# off and on alternating at the four shapes. Writes straight into OUT.
#   bash benchmarks/results/issue32/s28cpu/next_whole_stores_call.sh "$OUT/s29c1"
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s29c1cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_whole_stores.py \
  > "$O/pytest.log" 2>&1; st pytest $?
kt() {  # ON ROUND
  timeout $([ -e "$O/kt_off1.log" ] && echo 80 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,16x2048x32x64,1x32768x16x128 --label "$1$2" \
    --set "states.STATES_WHOLE_STORES=$([ "$1" = on ] && echo 1 || echo 0)" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
kt off 1; kt on 1; kt on 2; kt off 2
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|chunk_states|chunk_dstates" "$f" | grep -v JSON; done
echo "next_whole_stores_call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
