#!/usr/bin/env bash
# Session 26 call 5: the lean value side at 4 warps uncapped (GRADS_LEAN_V_WARPS, AOT 255
# registers, 72 B of stack, two programs an SM) against the default (8 warps, 128 registers),
# kernel_times alternating; then Nsight Compute's per-instruction stall samples (SourceCounters)
# of the key side and the reverse pass at (8, 4096, 16, 128), for where their time waits.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c5cache PYTHONPATH=$ROOT
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
declare -A SET=(
  [base]="gradients.GRADS_LEAN_V_WARPS=0"
  [v4]="gradients.GRADS_LEAN_V_WARPS=4,gradients.GRADS_LEAN_V_MAXNREG=0"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 60 || echo 150) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,8x2048x32x256 --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2.log" 2>&1
  st "kt_$1$2" $?
}
for r in 1 2; do kt base $r; kt v4 $r; done
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
timeout 200 "$NCU_BIN" --profile-from-start off --clock-control none --section SourceCounters \
  --section WarpStateStats -k "regex:grads_k_lean|chunk_dstates" --export "$O/src" \
  python3 benchmarks/kernel_times.py --profile-once --shapes 8x4096x16x128 > "$O/ncu_src.log" 2>&1
st ncu_src $?
for k in grads_k_lean chunk_dstates; do
  timeout 60 "$NCU_BIN" --import "$O/src.ncu-rep" -k "regex:$k" --page source --csv \
    --print-source sass > "$O/src_$k.csv" 2>&1
  st "src_$k" $? || { timeout 60 "$NCU_BIN" --import "$O/src.ncu-rep" -k "regex:$k" \
    --page source --csv > "$O/src2_$k.csv" 2>&1; st "src2_$k" $?; }
done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|grads_v" "$f" | grep -v JSON; done
ls -la "$O"
echo "call5: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
