#!/usr/bin/env bash
# Session 27 call 2: the L2 hints beyond the key side: the prepare's and the rebuild's V at
# their start, the state pass and the fused forward two chunks ahead; each alone over the key
# side's (call 1's winner), all, none; kaczmarz (the unsplit key side) with and without.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c2cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_prefetch.py \
  tests/test_grads_key_split.py > "$O/pytest.log" 2>&1; st pytest $?
NOPR="prepare.PREPARE_PREFETCH=0,rebuild.REBUILD_PREFETCH=0"
NOAH="states.STATES_PREFETCH_AHEAD=0,states.FUSED_PREFETCH_AHEAD=0"
declare -A SET=(
  [off]="common.PREFETCH=0"
  [on]="common.PREFETCH=1"
  [k]="$NOPR,$NOAH"
  [kpr]="$NOAH"
  [kst]="$NOPR,states.FUSED_PREFETCH_AHEAD=0"
  [kfw]="$NOPR,states.STATES_PREFETCH_AHEAD=0"
)
kt() {  # NAME ROUND [RULE SHAPES]
  timeout $([ -e "$O/kt_off1.log" ] && echo 80 || echo 170) python3 benchmarks/kernel_times.py \
    --shapes "${4:-8x4096x16x128,16x2048x32x64,1x32768x16x128,8x2048x32x256}" \
    --rule "${3:-delta}" --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2${3:-}.log" 2>&1
  st "kt_$1$2${3:-}" $?
}
for n in off on k kpr kst kfw; do kt $n 1; done
kt off 1 kaczmarz 8x4096x16x128; kt k 1 kaczmarz 8x4096x16x128
for n in on off kfw kst kpr k; do
  [ $((SECONDS - T0)) -lt 470 ] && kt $n 2
done
[ $((SECONDS - T0)) -lt 500 ] && { kt k 2 kaczmarz 8x4096x16x128; kt off 2 kaczmarz 8x4096x16x128; }
echo "call2: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
