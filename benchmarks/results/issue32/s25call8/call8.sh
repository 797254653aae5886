#!/usr/bin/env bash
# Session 25 call 8: the folding state pass at D = 64 capped at 168 registers (three programs an
# SM instead of two; AOT: 168 registers, 32 B of stack), build/r168; build/r168all caps the
# pass at key blocks ≤ 64 with or without the fold; against build/base, alternating.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c8cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
kt() {  # LABEL TREE [SET]
  (cd "build/$2" && PYTHONPATH=$PWD timeout 100 python3 benchmarks/kernel_times.py \
    --shapes 16x2048x32x64 --label "$1" ${3:+--set "$3"} > "$O/kt_$1.log" 2>&1); st "kt_$1" $?
}
for r in 1 2; do
  kt base$r base; kt r168$r r168; kt offcap$r r168all states.STATES_REBUILD_MAX_BK=0
done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|states_kernel|rebuild" "$f" | grep -v JSON; done
echo "call8: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
