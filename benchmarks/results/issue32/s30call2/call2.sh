#!/usr/bin/env bash
# Session 30, call 2 (issue 32): the prepare's two trials with kernel_times, alternating, two
# rounds — base, `pair` (the diagonal 16 × 16 inverses' six products as bf16 hi + lo pairs:
# prepare.PREPARE_DIAG_PRECISION=pair), `early` (β and log α loaded before the key loop:
# PREPARE_GATES_EARLY), both — then check_triton --dtype all whole with the pair diagonal.
#   bash benchmarks/results/issue32/s30call2/call2.sh "$OUT"
set -u
OUT=${1:?out}; O=/tmp/s30c2; rm -rf "$O"; mkdir -p "$O"
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s30c2cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
S=8x4096x16x128,16x2048x32x64,1x32768x16x128,8x2048x32x256
P=prepare.PREPARE_DIAG_PRECISION=pair E=prepare.PREPARE_GATES_EARLY=1
kt() {  # NAME ROUND [SET]
  timeout $([ "$2" = 1 ] && echo 150 || echo 80) python3 benchmarks/kernel_times.py --shapes $S \
    --label "$1$2" ${3:+--set "$3"} > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for r in 1 2; do kt base $r; kt pair $r "$P"; kt early $r "$E"; kt both $r "$P,$E"; done
timeout 240 python3 benchmarks/check_triton.py --dtype all --set "$P" --out "$O/check_pair.md" \
  > "$O/check_pair.log" 2>&1; st check_pair $?
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|forward:|prepare" "$f" | grep -v JSON; done
echo "call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
tar czf "$OUT/s30c2.tgz" -C /tmp s30c2
