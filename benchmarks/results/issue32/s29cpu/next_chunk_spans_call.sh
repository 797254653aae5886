#!/usr/bin/env bash
# Ready for session 30 (issue 32): chunk_spans.patch beside it — the per-chunk kernels (prepare,
# rebuild, outputs, the gradient kernels) read each chunk's (first token, end) from one table
# (ChunkTables.chunk_spans: one round trip) instead of (sequence, chunk) and then cu_seqlens
# (two dependent ones; call 5's source page: 1.5% of the prepare's samples wait on the first,
# and the first key tile's copy waits behind it). Same values: tests/test_op_host_path.py's new
# test and the whole suite on the interpreter with it applied (1411 passed, 30 skipped). AOT sm_90 bf16
# D = 128: the same registers; the value side's stack 72 → 80 B, the unsplit key side's 8 → 0.
# This script: the patch's GPU tests, then kernel_times with the patch off / on alternating (it
# applies and reverts the patch in the device's copy). Writes a tarball into OUT.
#   bash benchmarks/results/issue32/s29cpu/next_chunk_spans_call.sh "$OUT"
set -u
OUT=${1:?out}; O=/tmp/s30spans; rm -rf "$O"; mkdir -p "$O"
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
P=benchmarks/results/issue32/s29cpu/chunk_spans.patch
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s30spanscache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
S=8x4096x16x128,16x2048x32x64,1x32768x16x128,8x2048x32x256
kt() {  # NAME ROUND
  timeout $([ "$2" = 1 ] && echo 150 || echo 80) python3 benchmarks/kernel_times.py --shapes $S \
    --label "$1$2" > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
git apply "$P" && st apply 0
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_op_host_path.py \
  tests/test_save_t.py > "$O/pytest.log" 2>&1; st pytest $?
kt spans 1; git apply -R "$P"; kt base 1; git apply "$P"; kt spans 2; git apply -R "$P"; kt base 2
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|prepare|rebuild|grads|output" "$f" | grep -v JSON; done
echo "call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
tar czf "$OUT/s30spans.tgz" -C /tmp s30spans
