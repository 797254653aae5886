#!/usr/bin/env bash
# Session 30 call 4 (issue 32), for the next session's plan: Nsight Compute per-instruction
# samples (SourceCounters, WarpStateStats) and details of the kernels where fla is still close
# at (8, 4096, 16, 128), bf16, after session 30's prepare change: our reverse pass
# (chunk_dstates_kernel) against fla's dhu, our state pass (chunk_states_kernel, forward and the
# backward's) against fla's fwd_h, our training prepare against fla's kkt_solve. Source pages as
# gzipped CSV (read with results/issue32/s28call1/stalls.py; a page holds several kernels: the
# first of each name is read by stalls.py's KERNEL argument where given).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s30c4cache PYTHONPATH=$ROOT TRITON_CACHE_AUTOTUNING=1
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile .whl/fla_core-*.whl \
  .whl/flash_linear_attention-*.whl .whl/einops-*.whl > "$O/fla_install.log" 2>&1
st fla_install $?
mkdir -p "$TRITON_CACHE_DIR"
tar xzf benchmarks/results/issue32/s30call3/fla_autotune.tgz -C "$TRITON_CACHE_DIR" 2> /dev/null
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
for impl in ours fla; do
  if [ $impl = ours ]; then args=(); rx="chunk_dstates|chunk_states|chunk_prepare"
  else args=(--impl fla); rx="dhu|fwd_kernel_h|kkt_solve"; fi
  timeout 200 "$NCU_BIN" --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats -k "regex:$rx" --export "$O/src_$impl" \
    python3 benchmarks/kernel_times.py --profile-once --shapes 8x4096x16x128 "${args[@]}" \
    > "$O/ncu_$impl.log" 2>&1; st "ncu_$impl" $?
  timeout 60 "$NCU_BIN" --import "$O/src_$impl.ncu-rep" --page source --csv \
    --print-source sass > "$O/src_$impl.csv" 2>&1; st "src_$impl" $? && gzip -f "$O/src_$impl.csv"
  timeout 30 "$NCU_BIN" --import "$O/src_$impl.ncu-rep" --csv --page details \
    > "$O/details_$impl.csv" 2>&1; st "details_$impl" $?
done
rm -f "$O"/*.ncu-rep
echo "call4: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
