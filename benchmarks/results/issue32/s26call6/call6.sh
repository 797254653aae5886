#!/usr/bin/env bash
# Session 26 call 6: the session's final kernels (the key side split, the value side at 4 warps
# in half precision) checked whole, the split's and the lean pair's tests on the GPU, and
# kernel_times at the four shapes (fla's numbers: call 4, the same machine kind, this session).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c6cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
timeout 330 python3 benchmarks/check_triton.py --dtype all --compile-workers 12 --gpu-memory 50 \
  --out "$O/check_triton.md" > "$O/check_triton.log" 2>&1 &
CHECK=$!
timeout 200 taskset -c 12-15 python3 -m pytest -q -p no:cacheprovider tests/test_grads_key_split.py \
  tests/test_grads_variants.py > "$O/pytest.log" 2>&1; st pytest $?
wait $CHECK; st check_triton $?
timeout 120 python3 benchmarks/kernel_times.py \
  --shapes 8x4096x16x128,1x32768x16x128,16x2048x32x64,8x2048x32x256 > "$O/kernel_times.log" 2>&1
st kernel_times $?
grep -hE "wall time|ALL OK" "$O/check_triton.md"
grep -E "forward\+backward|forward:" "$O/kernel_times.log" | grep -v JSON
echo "call6: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
