#!/usr/bin/env bash
# Issue 31 in one GPU call: is compiled training right (items 1-2), and what does the trainer's
# own step give beside fla (item 3)? Everything under one folder: each step's log, summary.txt
# with each step's exit status, start and seconds, the reports.
#
#   bash benchmarks/issue31_call.sh [OUT_DIR]      # default: gpu_check_issue31_<date>/
#   bash benchmarks/issue31_call.sh --smoke [OUT_DIR]   # the same schedule at toy size, CPU (CI)
#
# fla: wheels in .whl/ (as for gpu_check.sh), installed into /tmp/site; without them the fla
# columns are left out. Loss curves: the corpus and GPT-2 tokenizer from shared/ (in the
# checkout, or ../shared); without them check_training runs the gradients only.
# Environment: SHAPES ("B T;B T", default "8 2048;2 8192"), TRAIN_EXTRA (more model_training
# flags for our timed runs, default "--triton-conv both --top 60"; e.g. --set
# triton_backend.SAVE_FOR_BACKWARD=states, beside the sweeps' --set), CHECK_EXTRA (more
# check_training flags), FLA_AUTOTUNE (a .tgz of fla's autotune results from an earlier call:
# its Triton autotuner reads them instead of timing every configuration again; this call writes
# its own as fla_autotune.tgz), CHECK=0 (no check_training), FLA_WARM=0 (no fla warm-up: with
# FLA_AUTOTUNE, fla's timed run compiles its tuned kernels in its own warm-up steps),
# SHORT_CONV_ARGS (default "time", "" = skip; "time --sweep" also sweeps the launch settings,
# and the fastest then go to our timed runs through --set), CONV_NORM_ARGS (the same for
# benchmarks/conv_norm.py, default "" = skip), TRAIN_VARIANTS (";"-separated sets of flags each
# timed as a run of its own after the first, e.g. ";--checkpoint mixer,mlp,mixer_inputs": the
# first set empty = TRAIN_EXTRA alone; variant i > 1 writes under vi/), STEPS (timed steps of
# every model, default 10), LM_LOSS=1
# (benchmarks/lm_loss.py, liger's wheel from .whl/). PACK=FILE: everything also packed into FILE (a device call brings
# back at most 8 files).
# Exit status: 0 when every step exited 0 (check_training exits 1 when an entry fails).
# If check_training passes, flip CUDA_BLOCKS_VERIFIED in deltaflow/models/compile.py.
#
# Schedule (C = nproc; seconds predicted for an H100 machine with 16 cores, benchmarks/NOTES.md
# "Issue 31, session 14"):
#
#   t = 0   fla_install   cores 0..C/4-1                                            ~5 s, limit 60
#   then    fla_warm      cores 0..C/4-1: fla's model at both shapes, one step each:
#                         fla compiles and autotunes (~250 s at B=8, T=2048: issue
#                         27) into Triton's disk cache for the timed runs            ~250 s, limit 270
#   t = 0   check_training  the other cores, 10 worker processes: gradients of
#                         every Triton rule (fp32 / autocast / bf16), delta's
#                         smallest cases, the 200-step loss curves; mostly compiling
#                         (the op's kernels per rule and dtype, inductor's graphs),
#                         its GPU launches are a small model's                       ~220 s, limit 270
#   then, alone on the machine, each shape: ours in one process (the trainer's step: autocast
#   over fp32 weights, compiled blocks; pure bf16 compiled), fla's (tuned) in the next:
#   ~270 s  train_B8_T2048  warm-ups compile inductor's graphs and the op's kernels  ~110 s, limit 150
#   ~380 s  fla_B8_T2048    its tunings read from Triton's disk cache               ~20 s, limit 60
#   ~400 s  train_B2_T8192  (new shapes: compiled again)                            ~100 s, limit 150
#   ~500 s  fla_B2_T8192                                                              ~20 s, limit 60
#   ~520 s  end; every timed step also stops at DEADLINE = 570 s (the device's limit is 600)
set -u
cd "$(dirname "$0")/.."
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; shift; fi
OUT_DIR="${1:-gpu_check_issue31_$(date +%Y%m%d_%H%M%S)}"
# an earlier call's files would be packed and read as this call's (seen: a device machine's /tmp
# kept another session's check_training report)
if [ -n "$(ls -A "$OUT_DIR" 2> /dev/null)" ]; then
  echo "issue31_call: OUT_DIR $OUT_DIR is not empty; give a new or empty folder" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
# liger-kernel (the [triton] extra: the LM loss's fused linear CE on CUDA) from its carried wheel,
# for every run of ours; without it the chunked torch loss runs (loss.FUSED_CE_BACKEND='auto')
if [ -z "$SMOKE" ] && ls .whl/liger_kernel-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/liger .whl/liger_kernel-*.whl \
    && export PYTHONPATH="/tmp/liger:$PYTHONPATH" && echo "liger: installed" >> "$SUMMARY"
fi
FLA_CACHE=/tmp/fla_triton_cache  # fla's own Triton cache: its autotune results travel from it
mkdir -p "$FLA_CACHE"
if [ -n "${FLA_AUTOTUNE:-}" ] && [ -f "$FLA_AUTOTUNE" ]; then
  tar xzf "$FLA_AUTOTUNE" -C "$FLA_CACHE" && echo "fla autotune: $(find "$FLA_CACHE" -name '*.autotune.json' | wc -l) results from $FLA_AUTOTUNE" | tee -a "$SUMMARY"
fi

CORES=$(nproc)
if [ "$CORES" -ge 2 ] && command -v taskset > /dev/null; then
  FLA_N=$(((CORES + 3) / 4))  # a quarter for fla's tuning, as gpu_check.sh (its call 5)
  FLA_CPUS="0-$((FLA_N - 1))" OTHER_CPUS="$FLA_N-$((CORES - 1))"
else
  FLA_CPUS="" OTHER_CPUS=""
  echo "issue31_call: $CORES core(s), taskset: $(command -v taskset || echo none): nothing pinned" \
    | tee -a "$SUMMARY"
fi
LM=()
for dir in shared ../shared; do
  if [ -d "$dir/corpus" ] && [ -f "$dir/tokenizers/gpt2.tiktoken" ]; then
    LM=(--lm-data "$dir/corpus" --lm-tokenizer "$dir/tokenizers/gpt2.tiktoken")
    break
  fi
done
if [ -n "$SMOKE" ]; then  # toy sizes; check_training's smoke makes its own corpus
  # CI runs check_training's smoke on its own (a superset of this one's layer/fp32 unit): here
  # the schedule only, unless CHECK=1
  CHECK=${CHECK:-0}
  L_INSTALL=60 L_FLA=600 L_CHECK=600 L_TRAIN=600 L_FLA_TIMED=600 DEADLINE=100000
  CHECK_ARGS=(--smoke --jobs 2 --cases layer --modes fp32)
  SHAPES=("2 64" "1 128")
  TRAIN_ARGS=(--smoke --steps 1 --warmup 1 --top 0)
else
  L_INSTALL=60 L_FLA=${L_FLA:-270} L_CHECK=270 L_TRAIN=${L_TRAIN:-150}
  L_FLA_TIMED=${L_FLA_TIMED:-150}  # session 17: 60 s cut fla off with its autotune restored
  DEADLINE=${DEADLINE:-570}
  CHECK_ARGS=(--jobs 10 ${LM[@]+"${LM[@]}"})
  [ ${#LM[@]} -eq 0 ] && echo "issue31_call: no shared/corpus: gradients only" | tee -a "$SUMMARY"
  IFS=';' read -r -a SHAPES <<< "${SHAPES:-8 2048;2 8192}"
  # timed steps of every model (ours and fla's): their medians are compared; one step's time
  # varies 10-20% on these machines (benchmarks/NOTES.md, session 16), so more than 10
  TRAIN_ARGS=(--steps "${STEPS:-10}" --warmup 2)
fi
DEFAULT_EXTRA="--triton-conv both --top 60"
[ -n "$SMOKE" ] && DEFAULT_EXTRA=""  # CI's minutes: one conv variant at toy size
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA-$DEFAULT_EXTRA}"
read -r -a CHECK_EXTRA <<< "${CHECK_EXTRA:-}"
CHECK_ARGS+=(${CHECK_EXTRA[@]+"${CHECK_EXTRA[@]}"})

START=$SECONDS
# the GPU's clocks, power and temperature every half second while the call runs (a slow step
# with a lower clock is the card, not the code); the smoke runs a stand-in sampler, so that a
# bare `wait` below (which would wait on it forever) fails CI instead of a GPU call
if [ -z "$SMOKE" ] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
    --format=csv -lms 500 > "$OUT_DIR/gpu_clocks.csv" 2>&1 &
else
  while sleep 0.5; do date +%s.%N; done > "$OUT_DIR/gpu_clocks.csv" &
fi
CLOCKS_PID=$!
# step NAME LIMIT CPUS COMMAND...: COMMAND under `timeout` pinned to CPUS ("" = any core), log in
# NAME.log, exit status, start and seconds in summary.txt. Returns the command's exit status.
step() {
  local name=$1 limit=$2 cpus=$3; shift 3
  local t0=$SECONDS prefix=()
  [ -n "$cpus" ] && prefix=(taskset -c "$cpus")
  timeout "$limit" ${prefix[@]+"${prefix[@]}"} "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (started at $((t0 - START)) s)" | tee -a "$SUMMARY"
  return $rc
}

# ---- beside each other: fla's tuning (a quarter of the cores) and the gradient check
{
  FLA_PATH=""
  if [ -z "$SMOKE" ] && ls .whl/*.whl > /dev/null 2>&1; then
    step fla_install $L_INSTALL "$FLA_CPUS" python3 -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && FLA_PATH=/tmp/site:
  fi
  if [ "${FLA_WARM:-1}" != 0 ] && { [ -n "$FLA_PATH" ] || [ -n "$SMOKE" ]; }; then  # smoke: the plumbing
    t_fla=$SECONDS
    for shape in "${SHAPES[@]}"; do
      read -r B T <<< "$shape"
      left=$((L_FLA - (SECONDS - t_fla)))
      [ "$left" -lt 1 ] && left=1
      PYTHONPATH=$FLA_PATH$PYTHONPATH TRITON_CACHE_DIR=$FLA_CACHE \
        step "fla_warm_B${B}_T${T}" "$left" "$FLA_CPUS" \
        python3 benchmarks/model_training.py --skip-deltaflow --batch "$B" --seq "$T" \
        --steps 1 --warmup 1 --top 0 --out "$OUT_DIR/fla_warm" $SMOKE
    done
    # what fla's autotuner found (also from a warm-up that was cut): for the next call
    (cd "$FLA_CACHE" && find . -name '*.autotune.json' | tar czf "$OUT_DIR/fla_autotune.tgz" -T -)
    echo "fla autotune: $(tar tzf "$OUT_DIR/fla_autotune.tgz" | wc -l) results saved" \
      | tee -a "$SUMMARY"
  fi
} &
FLA_JOB=$!
if [ "${CHECK:-1}" != 0 ]; then
  step check_training $L_CHECK "$OTHER_CPUS" python3 benchmarks/check_training.py \
    "${CHECK_ARGS[@]}" --out "$OUT_DIR"
fi
wait "$FLA_JOB"  # not a bare wait: the clock sampler runs until the end

# ---- timed, alone on the machine, each shape: ours (the trainer's step, pure bf16) in one
# process, then fla's (tuned above) in another, so that a cut fla never loses ours; every step
# also stops at the call's DEADLINE.
limit() {  # LIMIT: the smaller of LIMIT and what is left until DEADLINE (at least 1)
  local left=$((DEADLINE - (SECONDS - START)))
  [ "$left" -lt 1 ] && left=1
  echo $(($1 < left ? $1 : left))
}
FLA_OK=""
grep -q "^fla_install: exit 0 " "$SUMMARY" && FLA_OK=1
# the short conv's kernels alone against the compiled tap sum (seconds; a sweep ~2 minutes)
# and the conv + SiLU + norm op (conv_norm); the fastest launch settings of a sweep go on
LAUNCH=()
for bench in "short_conv:${SHORT_CONV_ARGS-time}" "conv_norm:${CONV_NORM_ARGS:-}"; do
  name=${bench%%:*}
  read -r -a BENCH_ARGS <<< "${bench#*:}"
  [ ${#BENCH_ARGS[@]} -eq 0 ] && continue
  step "$name" "$(limit 240)" "" python3 "benchmarks/$name.py" "${BENCH_ARGS[@]}" $SMOKE
  best=$(sed -n 's/^best launch: //p' "$OUT_DIR/$name.log")
  [ -n "$best" ] && LAUNCH+=("$best")
done
[ ${#LAUNCH[@]} -gt 0 ] && TRAIN_EXTRA+=(--set "$(IFS=,; echo "${LAUNCH[*]}")")
IFS=';' read -r -a VARIANTS <<< "${TRAIN_VARIANTS:-}"
[ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=("")
if [ "${LM_LOSS:-0}" != 0 ]; then  # the LM loss: ours against liger's fused linear CE
  step lm_loss "$(limit 120)" "" python3 benchmarks/lm_loss.py $SMOKE
fi
for shape in "${SHAPES[@]}"; do
  read -r B T <<< "$shape"
  for i in "${!VARIANTS[@]}"; do
    read -r -a VARIANT <<< "${VARIANTS[$i]}"
    suffix="" dir="$OUT_DIR"
    [ "$i" -gt 0 ] && suffix="_v$((i + 1))" dir="$OUT_DIR/v$((i + 1))"
    step "train_B${B}_T${T}$suffix" "$(limit $L_TRAIN)" "" python3 benchmarks/model_training.py \
      --compile blocks --trainer --skip-fla --batch "$B" --seq "$T" "${TRAIN_ARGS[@]}" \
      ${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"} ${VARIANT[@]+"${VARIANT[@]}"} --out "$dir"
  done
  if [ -n "$FLA_OK" ]; then
    PYTHONPATH=/tmp/site:$PYTHONPATH TRITON_CACHE_DIR=$FLA_CACHE \
      step "fla_B${B}_T${T}" "$(limit $L_FLA_TIMED)" "" \
      python3 benchmarks/model_training.py --skip-deltaflow --batch "$B" --seq "$T" \
      "${TRAIN_ARGS[@]}" --out "$OUT_DIR/fla"
  fi
done

kill "$CLOCKS_PID" 2> /dev/null
FAILED=$(grep -c -v ": exit 0 in \|nothing pinned\|gradients only\|^fla autotune: \|^liger: " "$SUMMARY")
echo "issue31_call: $((SECONDS - START)) s in all, $FAILED step(s) failed; results in $OUT_DIR" \
  | tee -a "$SUMMARY"
grep -h "check_training: \|FAILED" "$OUT_DIR/check_training.log" 2> /dev/null | tail -2
# each run's tokens/s and peak memory, and ours over fla's of the same shape
python3 - "$OUT_DIR" << 'PY' | tee -a "$SUMMARY"
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
ours = sorted(out.glob("model_training_*.json")) + sorted(out.glob("v*/model_training_*.json"))
for path in ours:
    fla_path = out / "fla" / path.name
    fla = json.loads(fla_path.read_text())["results"].get("fla", {}) if fla_path.exists() else {}
    runs = {**json.loads(path.read_text())["results"], "fla": fla}
    for name, r in runs.items():
        if "tokens_per_s" not in r:
            continue
        line = f"{path.relative_to(out).with_suffix('')} {name}: {r['tokens_per_s'] / 1e3:.1f}k tok/s, peak {r['peak_memory_gb']} GB"
        if name != "fla" and "tokens_per_s" in fla:
            line += f", {r['tokens_per_s'] / fla['tokens_per_s']:.2f}x fla's tokens/s"
            if r["peak_memory_gb"] is not None:
                line += f" at {r['peak_memory_gb'] / fla['peak_memory_gb']:.2f}x its memory"
        print(line)
PY
if [ -n "${PACK:-}" ]; then  # one file for the device call's return trip
  tar czf "$PACK" -C "$OUT_DIR" . && echo "packed $OUT_DIR into $PACK ($(du -h "$PACK" | cut -f1))"
fi
[ "$FAILED" -eq 0 ]
