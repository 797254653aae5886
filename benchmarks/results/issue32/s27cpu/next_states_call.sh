#!/usr/bin/env bash
# Ready for session 28's first call (issue 32; carry .whl): where the backward's recomputed state
# pass waits against fla's h kernel at (8, 4096, 16, 128), bf16. kernel_times of the pass at
# 2 (default), 3 and 4 stages (AOT sm_90: 236 / 243 / 243 registers, 90 / 132 / 173 KB of shared
# memory: two programs an SM, then one, as fla's), alternating; then Nsight Compute's
# per-instruction samples (SourceCounters) of ours and of fla's h kernel, as CSV source pages.
#   bash benchmarks/results/issue32/s27cpu/next_states_call.sh OUT_DIR
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s28cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
for t in benchmarks/results/issue32/s24call1/fla_autotune.tgz benchmarks/results/issue32/s20call3/fla_autotune.tgz; do
  tar xzf "$t" -C "$TRITON_CACHE_DIR"
done
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; return "$2"; }
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl \
  > "$O/fla_install.log" 2>&1; st fla_install $?
export PYTHONPATH=$ROOT:/tmp/site
declare -A SET=(
  [base]="states.STATES_STAGES=2"
  [st3]="states.STATES_STAGES=3"
  [st4]="states.STATES_STAGES=4"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 60 || echo 150) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128,1x32768x16x128 --label "$1$2" --set "${SET[$1]}" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for r in 1 2; do kt base $r; kt st3 $r; kt st4 $r; done
timeout 150 python3 benchmarks/kernel_times.py --impl fla --shapes 8x4096x16x128 \
  > "$O/kt_fla.log" 2>&1; st kt_fla $?  # fla warm (its tuning from the tgz) and its kernels
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
for impl in ours fla; do
  if [ $impl = ours ]; then args=(); rx="chunk_states"; else args=(--impl fla); rx="fwd_kernel_h"; fi
  timeout 150 "$NCU_BIN" --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats -k "regex:$rx" --export "$O/src_$impl" \
    python3 benchmarks/kernel_times.py --profile-once --shapes 8x4096x16x128 "${args[@]}" \
    > "$O/ncu_$impl.log" 2>&1; st "ncu_$impl" $?
  timeout 60 "$NCU_BIN" --import "$O/src_$impl.ncu-rep" -k "regex:$rx" --page source --csv \
    --print-source sass > "$O/src_$impl.csv" 2>&1; st "src_$impl" $? && gzip -f "$O/src_$impl.csv"
done
rm -f "$O"/*.ncu-rep
for f in "$O"/kt_*.log; do grep -E "forward\+backward|chunk_states|fwd_kernel_h" "$f" | grep -v JSON; done
echo "next_states_call: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
