#!/usr/bin/env bash
# Session 26 call 2: Nsight Compute at (8, 4096, 16, 128), one forward + backward each: ours
# with the key side split (the new default), ours unsplit (the key side only), fla's (its
# autotune results from earlier calls restored, so it does not tune under the profiler).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c2cache PYTHONPATH=$ROOT TRITON_CACHE_AUTOTUNING=1
mkdir -p $TRITON_CACHE_DIR
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
for tgz in benchmarks/results/issue32/s24call1/fla_autotune.tgz benchmarks/results/issue32/s20call3/fla_autotune.tgz; do
  tar xzf "$tgz" -C "$TRITON_CACHE_DIR"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl > "$O/fla_install.log" 2>&1
st fla_install $?
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
NCU_ARGS=(--profile-from-start off --clock-control none --csv --page details)
for section in SpeedOfLight Occupancy LaunchStats WarpStateStats ComputeWorkloadAnalysis \
  MemoryWorkloadAnalysis; do NCU_ARGS+=(--section "$section"); done
METRICS=smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
for stall in long_scoreboard short_scoreboard wait barrier mio_throttle math_pipe_throttle \
  lg_throttle not_selected selected dispatch_stall no_instruction branch_resolving membar \
  sleeping drain misc tex_throttle imc_miss; do
  METRICS+=,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
done
NCU_ARGS+=(--metrics "$METRICS")
DRIVER=(python3 benchmarks/kernel_times.py --profile-once --shapes 8x4096x16x128)
timeout 150 "$NCU_BIN" "${NCU_ARGS[@]}" --log-file "$O/ncu.csv" "${DRIVER[@]}" > "$O/ncu.log" 2>&1
st ncu $?
timeout 100 "$NCU_BIN" "${NCU_ARGS[@]}" -k regex:grads_k_lean --log-file "$O/ncu_base.csv" \
  "${DRIVER[@]}" --set gradients_lean.K_SPLIT_BK=0 > "$O/ncu_base.log" 2>&1
st ncu_base $?
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 240 "$NCU_BIN" "${NCU_ARGS[@]}" \
  --log-file "$O/ncu_fla.csv" "${DRIVER[@]}" --impl fla > "$O/ncu_fla.log" 2>&1
st ncu_fla $?
python3 benchmarks/ncu_table.py "$O/ncu.csv" "$O/ncu_base.csv" "$O/ncu_fla.csv" > "$O/ncu_table.md" 2>&1
cat "$O/ncu_table.md" | head -80
echo "call2: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
