#!/usr/bin/env bash
# Session 25 call 2: the folded rebuild with look-ahead (rebuild.REBUILD_AHEAD: each step forms
# the next chunk's W, Ũ after its state update) against call 1's forms and "off", alternating in
# kernel_times; then check_triton --dtype all whole with the fastest fold on, where it wins at
# both short shapes.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c2cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
declare -A SET=(
  [off]="rebuild.REBUILD_IN_PASSES=off"
  [states]="rebuild.REBUILD_IN_PASSES=states,rebuild.REBUILD_AHEAD=1"
  [states0]="rebuild.REBUILD_IN_PASSES=states,rebuild.REBUILD_AHEAD=0"
  [both]="rebuild.REBUILD_IN_PASSES=both,rebuild.REBUILD_AHEAD=1"
)
NAMES="off states states0 both"
kt() {  # NAME
  timeout 120 python3 benchmarks/kernel_times.py --shapes 16x2048x32x64,8x4096x16x128 \
    --label "$1" --set "${SET[${1%[12]}]}" > "$O/kt_$1.log" 2>&1; st "kt_$1" $?
}
for r in 1 2; do for n in $NAMES; do kt $n$r; done; done
ms() { grep "$2 forward+backward" "$O/kt_$1.log" | awk '{print $(NF-1)}'; }
best=""; bestsum=0
for m in states states0 both; do
  s=$(awk -v a="$(ms ${m}1 '(16, 2048, 32, 64)')" -v b="$(ms ${m}2 '(16, 2048, 32, 64)')" \
          -v c="$(ms off1 '(16, 2048, 32, 64)')" -v d="$(ms off2 '(16, 2048, 32, 64)')" \
          -v e="$(ms ${m}1 '(8, 4096, 16, 128)')" -v f="$(ms ${m}2 '(8, 4096, 16, 128)')" \
          -v g="$(ms off1 '(8, 4096, 16, 128)')" -v h="$(ms off2 '(8, 4096, 16, 128)')" \
          'BEGIN { x = (c + d - a - b) / 2; y = (g + h - e - f) / 2;
                   printf "%.3f %.3f ", x, y;
                   if (a > 0 && e > 0 && x > 0.01 && y > -0.005) print x + y; else print 0 }')
  echo "$m: gain at D=64, D=128, summed if D=64 wins and D=128 does not lose: $s" | tee -a "$O/summary.txt"
  s=${s##* }
  if awk -v s="$s" -v b="$bestsum" 'BEGIN { exit !(s > b) }'; then best=$m; bestsum=$s; fi
done
if [ -n "$best" ]; then
  timeout 260 python3 benchmarks/check_triton.py --dtype all --compile-workers 15 --gpu-memory 50 \
    --set "${SET[$best]}" --out "$O/check_$best.md" > "$O/check_$best.log" 2>&1
  st "check_$best" $?
  grep -hE "wall time|ALL OK|FAIL" "$O/check_$best.md" | head -20
else
  echo "check: skipped (no fold wins)" | tee -a "$O/summary.txt"
fi
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|rebuild|states_kernel|dstates" "$f" | grep -v JSON; done
echo "call2: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
