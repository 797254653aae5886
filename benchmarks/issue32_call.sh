#!/usr/bin/env bash
# Issue 32 (the op's kernels against fla) in one GPU call: the check and the GPU tests first,
# then the timings alone on the machine. Everything under one folder: each step's log,
# summary.txt (each step's exit status, start and seconds), the reports, fla's autotune results.
#
#   bash benchmarks/issue32_call.sh OUT_DIR
#   bash benchmarks/issue32_call.sh --smoke OUT_DIR   # the same schedule at toy size, CPU (CI;
#                                                     # CHECK and SEQPAR default to 0 there)
#
# Environment (defaults in brackets):
#   CHECK [1]          check_triton.py --dtype all, whole (its cases wait for fla's tuning)
#   CHECK_SET [""]     --set items of a second check_triton.py --dtype all after it: a variant's
#                      kernels checked before it becomes a default (report check_set.md)
#   PYTEST [""]        test files run on the GPU beside the check's cases ("" = none)
#   PYTEST_WORKERS [6] pytest-xdist workers when its wheel is in .whl/ (GPU tests are bound by
#                      compiling kernels on the CPU: ~250 s for four files in one process)
#   FLA_AUTOTUNE [""]  .tgz files (space-separated) of fla's autotune results from earlier calls
#                      (this call writes its own, also from a cut warm-up, as fla_autotune.tgz)
#   FLA_WARM [1]       kernels.py --warm-fla (fla tunes at the timed shapes, alone on the GPU)
#   FLA_256 [0]        then fla's D = 256 backward tuned too, beside the check's cases (minutes;
#                      cut at PHASE_A_END, kept for the next call); timed when it finished
#   VARIANTS [""]      ";"-separated kernels.py --variant values, e.g.
#                      "sp:triton_backend.SEQUENCE_PARALLEL_STATES=auto;prep:..."
#   VARIANTS2 [""]     the same for untried kernels, timed in a second kernels.py process (with
#                      the default and fla again): a crash there keeps the first table
#   SEQPAR [1]         kernels.py --sequence-parallel (off/on at its shapes)
#   KTIMES [1]         kernel_times.py at the four shapes (each kernel's time)
#   KTIMES_SET [""]    --set items for a second kernel_times run (e.g. a variant's)
#   KTIMES_FLA [0]     kernel_times.py --impl fla: fla's kernels at the same shapes (D = 256
#                      only when its backward tuned in this call: FLA_256)
#   PROBE [0]          probe_narrow_fp32.py first, alone (narrow fp32 heads, a process each)
#   MODEL [""]         "B T" of a model_training.py run (compiled blocks, pure bf16, ours then
#                      fla's), MODEL_EXTRA its extra flags for ours
#   NCU [""]           BxTxHxD,... shapes for Nsight Compute, last: one forward + backward a
#                      shape (kernel_times.py --profile-once), ours then fla's (ncu_fla.csv),
#                      each kernel's speed of light, occupancy, warp stalls, memory and compute
#                      sections as CSV (ncu.csv); NCU_SET: --set items for ours there;
#                      NCU_FLA [1]: 0 leaves fla's out
#   PHASE_A_END [380]  seconds: fla's D = 256 tuning and the GPU tests stop here
#   DEADLINE [575]     seconds: every timed step stops here (the device allows 600)
# Exit status: 0 when every step exited 0 (check_triton and pytest exit 1 on a failure).
set -u
cd "$(dirname "$0")/.."
. benchmarks/_call_common.sh  # DELTAFLOW_CALL_TAG, kill_own_spawned
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; shift; fi
OUT_DIR="${1:?usage: issue32_call.sh [--smoke] OUT_DIR}"
if [ -n "$(ls -A "$OUT_DIR" 2> /dev/null)" ]; then  # an earlier call's files read as this one's
  echo "issue32_call: OUT_DIR $OUT_DIR is not empty; give a new or empty folder" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
# one Triton cache for every process of the call: fla's tunings land where the timed run reads
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/issue32_triton_cache}"
mkdir -p "$TRITON_CACHE_DIR"
for tgz in ${FLA_AUTOTUNE:-}; do  # several: the op's shapes' and the model's
  if [ -f "$tgz" ]; then
    tar xzf "$tgz" -C "$TRITON_CACHE_DIR" && echo "fla autotune: $(tar tzf "$tgz" | wc -l) results from $tgz" | tee -a "$SUMMARY"
  else
    echo "fla autotune: no file $tgz" | tee -a "$SUMMARY"
  fi
done
PHASE_A_END=${PHASE_A_END:-380} DEADLINE=${DEADLINE:-575}
CORES=$(nproc)
if [ "$CORES" -ge 4 ] && command -v taskset > /dev/null; then
  FLA_N=$(((CORES + 3) / 4))  # a quarter for fla's tuning (gpu_check.sh, session 13)
  FLA_CPUS="0-$((FLA_N - 1))" OTHER_CPUS="$FLA_N-$((CORES - 1))" OTHER_N=$((CORES - FLA_N))
else
  FLA_CPUS="" OTHER_CPUS="" OTHER_N=$CORES
fi
if [ -n "$SMOKE" ]; then
  # CI runs the check's smoke in gpu_check.sh's and --sequence-parallel's on its own: here the
  # schedule only
  CHECK=${CHECK:-0} SEQPAR=${SEQPAR:-0} NCU=${NCU:-smoke}  # ncu's step without ncu
  CHECK_ARGS=(--smoke --workers 2) PHASE_A_END=100000 DEADLINE=100000
  KTIMES_ARGS=(--smoke)
else
  CHECK_ARGS=(--dtype all --compile-workers "$OTHER_N" --gpu-memory 50)
  KTIMES_ARGS=(--shapes 8x4096x16x128,1x32768x16x128,16x2048x32x64,8x2048x32x256)
fi
START=$SECONDS
# step NAME LIMIT CPUS COMMAND...: COMMAND under `timeout` (never past its phase's end) pinned
# to CPUS ("" = any core), its log NAME.log; exit status, start and seconds in summary.txt
step() {
  local name=$1 limit=$2 cpus=$3; shift 3
  local t0=$SECONDS prefix=()
  [ "$limit" -lt 1 ] && limit=1
  [ -n "$cpus" ] && prefix=(taskset -c "$cpus")
  timeout -k 5 "$limit" ${prefix[@]+"${prefix[@]}"} "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (started at $((t0 - START)) s)" | tee -a "$SUMMARY"
  return $rc
}
until_() {  # LIMIT END: the smaller of LIMIT and the seconds left until END
  local left=$(($2 - (SECONDS - START)))
  echo $(($1 < left ? $1 : left))
}
if [ -z "$SMOKE" ] && command -v nvidia-smi > /dev/null; then  # a slow step on a slow clock
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 1000 > "$OUT_DIR/gpu_clocks.csv" 2>&1 &
  CLOCKS_PID=$!
else
  CLOCKS_PID=""
fi

if [ "${PROBE:-0}" != 0 ]; then  # first: a fault here must not be mistaken for a later step's
  step probe_narrow_fp32 150 "" python3 benchmarks/probe_narrow_fp32.py --out "$OUT_DIR" $SMOKE
fi

# ---- phase A: fla's tuning alone on the GPU, the check compiling beside it on the CPU; then
# the check's cases and the GPU tests (correctness only) beside fla's D = 256 tuning
GPU_FREE="$OUT_DIR/.gpu_free"
FLA_PATH=""
if [ -z "$SMOKE" ] && ls .whl/flash_linear_attention-*.whl > /dev/null 2>&1; then
  step fla_install 60 "$FLA_CPUS" python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/fla_core-*.whl \
    .whl/flash_linear_attention-*.whl $(ls .whl/liger_kernel-*.whl .whl/pytest_xdist-*.whl \
    .whl/execnet-*.whl 2> /dev/null) \
    && FLA_PATH=/tmp/site:  # liger: the model runs' LM loss, as issue31_call.sh
fi
{
  if [ -n "$FLA_PATH" ] && [ "${FLA_WARM:-1}" != 0 ]; then
    PYTHONPATH=$FLA_PATH$PYTHONPATH step fla_warm 270 "$FLA_CPUS" \
      python3 benchmarks/kernels.py --warm-fla
  fi
  touch "$GPU_FREE"
  if [ -n "$FLA_PATH" ] && [ "${FLA_256:-0}" != 0 ]; then
    PYTHONPATH=$FLA_PATH$PYTHONPATH step fla_warm_256 "$(until_ 600 "$PHASE_A_END")" \
      "$FLA_CPUS" python3 benchmarks/kernels.py --warm-fla --fla-backward-256
  fi
  if [ -n "$FLA_PATH" ]; then  # what fla's autotuner found, also from a cut warm-up
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT_DIR/fla_autotune.tgz" -T -)
    echo "fla autotune: $(tar tzf "$OUT_DIR/fla_autotune.tgz" | wc -l) results saved" \
      | tee -a "$SUMMARY"
  fi
} &
FLA_JOB=$!
step kernels_warm 300 "$OTHER_CPUS" nice -n 10 python3 benchmarks/kernels.py \
  --warm-only $((OTHER_N < 8 ? OTHER_N : 8)) $SMOKE &
WARM_JOB=$!
if [ -n "${PYTEST:-}" ]; then
  {
    while [ ! -e "$GPU_FREE" ]; do sleep 1; done
    read -r -a TESTS <<< "$PYTEST"
    XDIST=()
    [ -z "$SMOKE" ] && PYTHONPATH=$FLA_PATH$PYTHONPATH python3 -c "import xdist" 2> /dev/null \
      && XDIST=(-n "${PYTEST_WORKERS:-6}")
    PYTHONPATH=$FLA_PATH$PYTHONPATH step pytest "$(until_ 400 "$PHASE_A_END")" "$OTHER_CPUS" \
      python3 -m pytest -v -rf --maxfail=10 -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} "${TESTS[@]}"
  } &
  TEST_JOB=$!
else
  TEST_JOB=""
fi
if [ "${CHECK:-1}" != 0 ]; then
  step check_triton 420 "$OTHER_CPUS" python3 benchmarks/check_triton.py "${CHECK_ARGS[@]}" \
    --run-after "$GPU_FREE" --out "$OUT_DIR/check_triton.md"
fi
if [ -n "${CHECK_SET:-}" ]; then
  step check_set "$(until_ 420 "$PHASE_A_END")" "$OTHER_CPUS" python3 benchmarks/check_triton.py \
    "${CHECK_ARGS[@]}" --set "$CHECK_SET" --run-after "$GPU_FREE" --out "$OUT_DIR/check_set.md"
fi
wait "$FLA_JOB" "$WARM_JOB" ${TEST_JOB:+"$TEST_JOB"}
kill_own_spawned  # workers of a cut step (this call's alone)

# ---- phase B: timed, alone on the machine
FLA_ARGS=()
grep -q "^fla_warm_256: exit 0 " "$SUMMARY" && FLA_ARGS=(--fla-backward-256)
VARIANT_ARGS=()
IFS=';' read -r -a VARIANT_LIST <<< "${VARIANTS:-}"
for v in ${VARIANT_LIST[@]+"${VARIANT_LIST[@]}"}; do [ -n "$v" ] && VARIANT_ARGS+=(--variant "$v"); done
PYTHONPATH=$FLA_PATH$PYTHONPATH step kernels "$(until_ 200 "$DEADLINE")" "" python3 \
  benchmarks/kernels.py --skip-torch --rounds 3 --out "$OUT_DIR" \
  ${FLA_ARGS[@]+"${FLA_ARGS[@]}"} ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} $SMOKE
if [ "${SEQPAR:-1}" != 0 ]; then
  step kernels_seqpar "$(until_ 120 "$DEADLINE")" "" python3 benchmarks/kernels.py \
    --sequence-parallel --rounds 3 --out "$OUT_DIR" $SMOKE
fi
if [ -n "${VARIANTS2:-}" ]; then  # untried kernels in a process of their own: a crash there
  VARIANT_ARGS=()                    # loses their rows, not the table above
  IFS=';' read -r -a VARIANT_LIST <<< "$VARIANTS2"
  for v in "${VARIANT_LIST[@]}"; do [ -n "$v" ] && VARIANT_ARGS+=(--variant "$v"); done
  mkdir -p "$OUT_DIR/new"
  PYTHONPATH=$FLA_PATH$PYTHONPATH step kernels_new "$(until_ 200 "$DEADLINE")" "" python3 \
    benchmarks/kernels.py --skip-torch --rounds 3 --out "$OUT_DIR/new" \
    ${FLA_ARGS[@]+"${FLA_ARGS[@]}"} ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} $SMOKE
fi
if [ "${KTIMES:-1}" != 0 ]; then
  step kernel_times "$(until_ 120 "$DEADLINE")" "" python3 benchmarks/kernel_times.py \
    "${KTIMES_ARGS[@]}"
  if [ -n "${KTIMES_SET:-}" ]; then
    step kernel_times_set "$(until_ 120 "$DEADLINE")" "" python3 benchmarks/kernel_times.py \
      "${KTIMES_ARGS[@]}" --set "$KTIMES_SET"
  fi
fi
if [ "${KTIMES_FLA:-0}" != 0 ] && [ -n "$FLA_PATH" ]; then
  FLA_SHAPES=8x4096x16x128,1x32768x16x128,16x2048x32x64
  [ ${#FLA_ARGS[@]} -gt 0 ] && FLA_SHAPES=$FLA_SHAPES,8x2048x32x256
  PYTHONPATH=$FLA_PATH$PYTHONPATH step kernel_times_fla "$(until_ 120 "$DEADLINE")" "" python3 \
    benchmarks/kernel_times.py --impl fla --shapes "$FLA_SHAPES"
fi
if [ -n "${MODEL:-}" ]; then
  read -r B T <<< "$MODEL"
  read -r -a MODEL_EXTRA_ARGS <<< "${MODEL_EXTRA:-}"
  TRAIN=(--batch "$B" --seq "$T" --steps 10 --warmup 2)
  [ -n "$SMOKE" ] && TRAIN=(--smoke --steps 1 --warmup 1)
  PYTHONPATH=$FLA_PATH$PYTHONPATH step model "$(until_ 200 "$DEADLINE")" "" python3 \
    benchmarks/model_training.py \
    --compile blocks --skip-fla --top 0 "${TRAIN[@]}" \
    ${MODEL_EXTRA_ARGS[@]+"${MODEL_EXTRA_ARGS[@]}"} --out "$OUT_DIR/model"
  if [ -n "$FLA_PATH" ]; then
    PYTHONPATH=$FLA_PATH$PYTHONPATH step model_fla "$(until_ 150 "$DEADLINE")" "" python3 \
      benchmarks/model_training.py --skip-deltaflow "${TRAIN[@]}" --out "$OUT_DIR/model_fla"
  fi
fi
if [ -n "${NCU:-}" ]; then  # hardware counters (Firecracker machines; clocks left alone)
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  NCU_ARGS=(--profile-from-start off --clock-control none --csv --page details)
  for section in SpeedOfLight Occupancy LaunchStats WarpStateStats ComputeWorkloadAnalysis \
    MemoryWorkloadAnalysis; do NCU_ARGS+=(--section "$section"); done
  METRICS=smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  for stall in long_scoreboard short_scoreboard wait barrier mio_throttle math_pipe_throttle \
    lg_throttle not_selected selected dispatch_stall no_instruction branch_resolving membar \
    sleeping drain misc tex_throttle imc_miss; do  # why warps wait (ncu_table.py ranks them)
    METRICS+=,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
  done
  NCU_ARGS+=(--metrics "$METRICS")
  DRIVER=(python3 benchmarks/kernel_times.py --profile-once --shapes "$NCU")
  OURS=("$NCU_BIN" "${NCU_ARGS[@]}" --log-file "$OUT_DIR/ncu.csv" "${DRIVER[@]}")
  [ -n "$SMOKE" ] && OURS=(python3 benchmarks/kernel_times.py --smoke --profile-once)
  [ -n "${NCU_SET:-}" ] && OURS+=(--set "$NCU_SET")
  step ncu "$(until_ 150 "$DEADLINE")" "" "${OURS[@]}"
  if [ -n "$FLA_PATH" ] && [ -z "$SMOKE" ] && [ "${NCU_FLA:-1}" != 0 ]; then
    PYTHONPATH=$FLA_PATH$PYTHONPATH step ncu_fla "$(until_ 150 "$DEADLINE")" "" "$NCU_BIN" \
      "${NCU_ARGS[@]}" --log-file "$OUT_DIR/ncu_fla.csv" "${DRIVER[@]}" --impl fla
  fi
fi
[ -n "$CLOCKS_PID" ] && kill "$CLOCKS_PID" 2> /dev/null
FAILED=$(grep -c -v ": exit 0 in \|^fla autotune: " "$SUMMARY")
echo "issue32_call: $((SECONDS - START)) s in all, $FAILED step(s) failed; results in $OUT_DIR" \
  | tee -a "$SUMMARY"
grep -hE "wall time|ALL OK" "$OUT_DIR"/check_triton*.md 2> /dev/null
[ "$FAILED" -eq 0 ]
