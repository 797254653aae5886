#!/usr/bin/env bash
# Session 28 call 1 (issue 32; carry .whl): where the backward's recomputed state pass
# (chunk_states_kernel) loses to fla's h kernel at (8, 4096, 16, 128), bf16. kernel_times
# alternating: stages 2 (default) / 3 / 4, 8 warps, and timing-only what-ifs
# (states.STATES_EXPERIMENT: the first_bad load at the step's top; γ loaded with no cumsum; no h
# store; no U store); fla's kernels; Nsight Compute's per-instruction samples of ours and fla's.
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
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$O/gpu.csv" 2>&1
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl \
  > "$O/fla_install.log" 2>&1; st fla_install $?
export PYTHONPATH=$ROOT:/tmp/site
X=states.STATES_EXPERIMENT
declare -A SET=(
  [base]="states.STATES_STAGES=2"
  [st3]="states.STATES_STAGES=3"
  [st4]="states.STATES_STAGES=4"
  [w8]="states.STATES_WARPS=8"
  [early]="$X=early_bad"
  [nocs]="$X=no_cumsum"
  [noh]="$X=no_h"
  [novn]="$X=no_vnew"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_base1.log" ] && echo 60 || echo 150) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128 --label "$1$2" --set "${SET[$1]}" \
    > "$O/kt_$1$2.log" 2>&1; st "kt_$1$2" $?
}
for n in base st3 st4 w8 early nocs noh novn; do kt $n 1; done
timeout 150 python3 benchmarks/kernel_times.py --impl fla --shapes 8x4096x16x128 \
  > "$O/kt_fla.log" 2>&1; st kt_fla $?
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
for impl in ours fla; do
  [ $((SECONDS - T0)) -lt 430 ] || break
  if [ $impl = ours ]; then args=(); rx="chunk_states"; else args=(--impl fla); rx="fwd_kernel_h"; fi
  timeout 100 "$NCU_BIN" --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats -k "regex:$rx" --export "$O/src_$impl" \
    python3 benchmarks/kernel_times.py --profile-once --shapes 8x4096x16x128 "${args[@]}" \
    > "$O/ncu_$impl.log" 2>&1; st "ncu_$impl" $?
  timeout 40 "$NCU_BIN" --import "$O/src_$impl.ncu-rep" -k "regex:$rx" --page source --csv \
    --print-source sass > "$O/src_$impl.csv" 2>&1; st "src_$impl" $? && gzip -f "$O/src_$impl.csv"
  timeout 20 "$NCU_BIN" --import "$O/src_$impl.ncu-rep" --csv --page details \
    > "$O/details_$impl.csv" 2>&1
done
rm -f "$O"/*.ncu-rep
for n in novn noh nocs early w8 st4 st3 base; do
  [ $((SECONDS - T0)) -lt 510 ] && kt $n 2
done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|chunk_states|fwd_kernel_h" "$f" | grep -v JSON; done
echo "call1: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
