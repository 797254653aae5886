#!/usr/bin/env bash
# The GPU truth in one command, on a fresh GPU machine (issue 30): the Triton check whole, the
# kernels against fla, the generation check and one compiled training shape, everything under
# one folder (each step's log, summary.txt with each step's exit status, start and seconds).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # default: gpu_check_<date>/ (git-ignored)
#   bash benchmarks/gpu_check.sh --smoke [OUT_DIR]   # the same schedule at toy size, CPU (CI)
#
# fla is optional: wheels in .whl/ (flash-linear-attention, fla-core, einops; README.md, "The
# GPU truth") are installed into /tmp/site; without them the fla columns are left out.
# Exit status: 0 when every step exited 0 (check_triton exits 1 when a case fails).
#
# Schedule and budget (target 540 s, goal 360 s; seconds on one H100 machine with 16 cores,
# benchmarks/NOTES.md "session 13, item 6"). C = nproc.
#
#   t = 0      fla_install      cores 0..C/4-1                                ~10 s, limit 60
#   then       fla_warm         cores 0..C/4-1, normal priority: fla compiles
#                               and autotunes in one process (niced beside
#                               the check it starved: session 12, 330 s cut;
#                               on one core it did half its shapes in 200 s:
#                               session 13; on 4 cores 228 s), on a GPU
#                               nothing else launches on until it ends        ~230 s, limit 250
#   t = 0      check_triton     the other cores: its compile phase on them
#                               (CPU only, ~60 s; session 13: 45 s on 12),
#                               then it waits for fla_warm (--run-after;
#                               not in its reported wall time), then its
#                               cases (~50 s; session 13: 92 s in all)        ~250 s, limit 330
#   t = 0      kernels_warm     the other cores, nice 10: our kernels compiled
#                               on the CPU on <= 8 processes (kernels.py
#                               --warm-only; no GPU launch; 31
#                               specializations; session 13: 77 s)            ~80 s, limit 300
#   t = 0      generation_warm  the same for the generation check's 6 kernels
#                               (generation.py --warm-only; session 13: 96 s)  ~100 s, limit 300
#   then       generation       after fla_warm and generation_warm, nice 10,
#                               any core: the decode checks, correctness only
#                               (beside the check's cases: nothing timed;
#                               session 13: 68 s)                              ~70 s, limit 150
#   wait for all of the above (~270 s; session 13: 281 s), then, alone on the machine:
#   ~270 s     kernels          timed against fla, 3 rounds, everything warm:
#                               fla's tunings read from Triton's cache
#                               (session 13: 29 s)                            ~30 s, limit 120
#   ~300 s     model_training   one compiled training shape, timed
#                               (session 13: 43 s)                            ~50 s, limit 90
#   ~350 s     end (session 13, call 5, fla on 4 cores: 353 s)
#
# Every background step also stops at BG_DEADLINE (330 s), and the check at its own 330 s, so
# that a hung one still leaves the two timed steps their limits: 330 + 120 + 90 = 540 s at
# worst.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_call_common.sh  # DELTAFLOW_CALL_TAG, kill_own_spawned
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; shift; fi
OUT_DIR="${1:-gpu_check_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1

CORES=$(nproc)  # the cores this process may use (affinity-aware)
if [ "$CORES" -ge 2 ] && command -v taskset > /dev/null; then
  # fla gets a quarter of the cores (session 13 on 16: one core did half its shapes in 200 s;
  # four all of them in 228 s, the whole script 353 s; eight took longer per shape, > 260 s, as
  # the other eight, oversubscribed, slowed everything: call 6), the rest the check and warm-ups
  FLA_N=$(((CORES + 3) / 4))
  FLA_CPUS="0-$((FLA_N - 1))" OTHER_CPUS="$FLA_N-$((CORES - 1))" OTHER_CORES=$((CORES - FLA_N))
else  # one core, or no taskset: nothing pinned, said in the summary
  FLA_CPUS="" OTHER_CPUS="" OTHER_CORES=$CORES
  echo "gpu_check: $CORES core(s), taskset: $(command -v taskset || echo none): nothing pinned" \
    | tee -a "$SUMMARY"
fi
if [ -n "$SMOKE" ]; then  # the CPU is slow and the check's smoke mode is its own
  BG_DEADLINE=100000 L_CHECK=900 L_WARM=900 L_INSTALL=60 L_FLA=300 L_GEN=600 L_KERNELS=300
  L_TRAIN=600
  CHECK_ARGS=(--smoke --workers 2)
  TRAIN_ARGS=(--steps 1 --warmup 1)
else
  BG_DEADLINE=330 L_CHECK=330 L_WARM=300 L_INSTALL=60 L_FLA=250 L_GEN=150 L_KERNELS=120 L_TRAIN=90
  CHECK_ARGS=(--gpu-memory 50)  # the rest of the GPU's memory for fla's warm-up and generation
  TRAIN_ARGS=(--steps 5 --warmup 2)
fi

START=$SECONDS
GPU_FREE="$OUT_DIR/.gpu_free"  # written when fla's warm-up is over
rm -f "$GPU_FREE"
# step NAME LIMIT CPUS NICE COMMAND...: run COMMAND under `timeout` (a background step: also
# BG_DEADLINE), pinned to CPUS ("" = any core) at priority NICE, log to NAME.log, and write its
# exit status, start and seconds to summary.txt. Returns the command's exit status.
step() {
  local name=$1 limit=$2 cpus=$3 niceness=$4; shift 4
  local t0=$SECONDS prefix=()
  [ -n "$cpus" ] && prefix=(taskset -c "$cpus")
  timeout "$limit" ${prefix[@]+"${prefix[@]}"} nice -n "$niceness" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (started at $((t0 - START)) s)" | tee -a "$SUMMARY"
  return $rc
}
bg_limit() {  # LIMIT: the smaller of LIMIT and what is left until BG_DEADLINE (at least 1)
  local left=$((BG_DEADLINE - (SECONDS - START)))
  [ "$left" -lt 1 ] && left=1
  echo $(($1 < left ? $1 : left))
}

# ---- beside the check (background): nothing here is timed
FLA_PATH=""
{
  if [ -z "$SMOKE" ] && ls .whl/*.whl > /dev/null 2>&1; then
    step fla_install "$(bg_limit $L_INSTALL)" "$FLA_CPUS" 0 python3 -m pip install -q \
      --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && FLA_PATH=/tmp/site:
  fi
  if [ -n "$FLA_PATH" ] || [ -n "$SMOKE" ]; then
    PYTHONPATH=$FLA_PATH$PYTHONPATH step fla_warm "$(bg_limit $L_FLA)" "$FLA_CPUS" 0 \
      python3 benchmarks/kernels.py --warm-fla $SMOKE
  fi
  touch "$GPU_FREE"  # fla's tuning is over (or there is none): the check may use the GPU
} &
FLA_PID=$!
# 31 kernels, ~80 s of compiling, the longest ~9 s: 8 processes finish within ~15 s of getting
# the cores (each process a CUDA context's worth of GPU memory beside the check's 50 GB)
step kernels_warm "$(bg_limit $L_WARM)" "$OTHER_CPUS" 10 python3 benchmarks/kernels.py \
  --warm-only $((OTHER_CORES < 8 ? OTHER_CORES : 8)) $SMOKE &
{
  # 6 kernels, one of them half the work: more than 3 processes would not finish sooner
  step generation_warm "$(bg_limit $L_WARM)" "$OTHER_CPUS" 10 python3 benchmarks/generation.py \
    --warm-only $((OTHER_CORES < 3 ? OTHER_CORES : 3)) $SMOKE
  # the check's decode runs launch on the GPU: only once fla's tuning is over
  while kill -0 "$FLA_PID" 2> /dev/null; do sleep 1; done
  step generation "$(bg_limit $L_GEN)" "" 10 python3 benchmarks/generation.py --check-only \
    --out "$OUT_DIR" $SMOKE
} &
# The check compiles on the CPU at once and runs its cases on the GPU once fla has tuned on a
# quiet GPU (--run-after): fla's autotuner picks its configs by timing them, and 16 case
# processes beside it would make it pick on noise, and the comparison unfair to it.
step check_triton $L_CHECK "$OTHER_CPUS" 0 python3 benchmarks/check_triton.py \
  --compile-workers "$OTHER_CORES" "${CHECK_ARGS[@]}" --run-after "$GPU_FREE" \
  --out "$OUT_DIR/check_triton.md"
wait
# a step cut by its timeout leaves its worker processes behind: none may run beside the timings
kill_own_spawned  # workers of a cut step (this call's alone)

# ---- timed, alone on the machine
grep -q "^fla_install: exit 0 " "$SUMMARY" && FLA_PATH=/tmp/site:  # (set in a subshell above)
PYTHONPATH=$FLA_PATH$PYTHONPATH step kernels $L_KERNELS "" 0 python3 benchmarks/kernels.py \
  --skip-torch --rounds 3 --out "$OUT_DIR" $SMOKE
step model_training $L_TRAIN "" 0 python3 benchmarks/model_training.py --compile blocks \
  --skip-fla "${TRAIN_ARGS[@]}" --top 0 --out "$OUT_DIR" $SMOKE

FAILED=$(grep -c -v ": exit 0 in \|nothing pinned" "$SUMMARY")
echo "gpu_check: $((SECONDS - START)) s in all, $FAILED step(s) failed; results in $OUT_DIR" \
  | tee -a "$SUMMARY"
grep -hE "wall time|ALL OK" "$OUT_DIR"/check_triton*.md 2> /dev/null
[ "$FAILED" -eq 0 ]
