#!/usr/bin/env bash
# Session 28 call 6 (issue 32; carry .whl): the prepare's and the rebuild's β and log α loaded
# before their λ loops — checked bitwise on the GPU, timed alternating at (8, 4096, 16, 128)
# beside fla's op in the same call (kernel_times: do_bench medians of the whole op).
# Writes straight into OUT (a call cut short keeps what ran).
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/s28c6cache TRITON_CACHE_AUTOTUNING=1
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
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_log_alpha_ahead.py \
  > "$O/pytest.log" 2>&1; st pytest $?
P=prepare
declare -A SET=(
  [off]="$P.PREPARE_GATES_EARLY=0,$P.REBUILD_GATES_EARLY=0"
  [on]="$P.PREPARE_GATES_EARLY=1,$P.REBUILD_GATES_EARLY=1"
  [reb]="$P.PREPARE_GATES_EARLY=0,$P.REBUILD_GATES_EARLY=1"
)
kt() {  # NAME ROUND
  timeout $([ -e "$O/kt_off1.log" ] && echo 40 || echo 100) python3 benchmarks/kernel_times.py \
    --shapes 8x4096x16x128 --label "$1$2" --set "${SET[$1]}" > "$O/kt_$1$2.log" 2>&1
  st "kt_$1$2" $?
}
kt off 1; kt on 1; kt reb 1
timeout 70 python3 benchmarks/kernel_times.py --impl fla --shapes 8x4096x16x128 \
  > "$O/kt_fla.log" 2>&1; st kt_fla $?
for n in reb on off; do [ $((SECONDS - T0)) -lt 200 ] && kt $n 2; done
for f in "$O"/kt_*.log; do echo "== $f"; grep -E "forward\+backward|prepare|rebuild" "$f" | grep -v JSON; done
echo "call6: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
