#!/usr/bin/env bash
# Session 28 call 2 (issue 32): the recomputed state pass's trial forms — h and U stored through
# TMA descriptors, k/W/Ũ loaded through them, log α a chunk ahead — checked bitwise on the GPU
# (tests/test_states_tma.py), timed alternating at (8, 4096, 16, 128) and (16, 2048, 32, 64),
# then Nsight Compute's per-instruction samples of the all-forms pass.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s28c2cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_states_tma.py > "$O/pytest.log" 2>&1
st pytest $?
S=states
declare -A SET=(
  [base]="$S.STATES_TMA_STORE=0"
  [st]="$S.STATES_TMA_STORE=1"
  [ld]="$S.STATES_TMA_LOAD=1"
  [ga]="$S.STATES_G_AHEAD=1"
  [stga]="$S.STATES_TMA_STORE=1,$S.STATES_G_AHEAD=1"
  [all]="$S.STATES_TMA_STORE=1,$S.STATES_TMA_LOAD=1,$S.STATES_G_AHEAD=1"
  [all3]="$S.STATES_TMA_STORE=1,$S.STATES_TMA_LOAD=1,$S.STATES_G_AHEAD=1,$S.STATES_STAGES=3"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 60 || echo 150) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,16x2048x32x64 --label "$1$2" --set "${SET[$1]}" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in base st ld ga stga all all3; do kt $n 1; done
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
if [ $((SECONDS - T0)) -lt 330 ]; then
  timeout 90 "$NCU_BIN" --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats --section LaunchStats --section Occupancy -k "regex:chunk_states" \
    --export "$O/src_all" python3 benchmarks/kernel_times.py --profile-once \
    --shapes 8x4096x16x128 --set "${SET[all]}" > "$O/ncu_all.log" 2>&1; st ncu_all $?
  timeout 40 "$NCU_BIN" --import "$O/src_all.ncu-rep" --page source --csv --print-source sass \
    > "$O/src_all.csv" 2>&1; st src_all $? && gzip -f "$O/src_all.csv"
  timeout 20 "$NCU_BIN" --import "$O/src_all.ncu-rep" --csv --page details > "$O/details_all.csv" 2>&1
  rm -f "$O"/*.ncu-rep
fi
for n in all3 all stga ga ld st base; do
  [ $((SECONDS - T0)) -lt 500 ] && kt $n 2
done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|chunk_states" "$f" | grep -v JSON; done
echo "call2: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
