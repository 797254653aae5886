#!/usr/bin/env bash
# Session 25 call 7: where the folding state pass's extra time goes at D = 64, by timing-only
# trees (wrong results): build/nostore (W not written), build/nostr (no strengths: a = b = 1),
# build/nou (Ũ = V: no T·Y product), against build/base and base with the fold off.
set -u
O=${1:?out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/c7cache
T0=$SECONDS
st() { echo "$1: exit $2 at $((SECONDS - T0)) s" | tee -a "$O/summary.txt"; }
kt() {  # LABEL TREE [SET]
  (cd "build/$2" && PYTHONPATH=$PWD timeout 100 python3 benchmarks/kernel_times.py \
    --shapes 16x2048x32x64 --label "$1" ${3:+--set "$3"} > "$O/kt_$1.log" 2>&1); st "kt_$1" $?
}
for r in 1 2; do
  kt base$r base; kt off$r base states.STATES_REBUILD_MAX_BK=0
  kt nostore$r nostore; kt nostr$r nostr; kt nou$r nou
done
for f in "$O"/kt_*.log; do grep -E "forward\+backward|states_kernel|rebuild" "$f" | grep -v JSON; done
echo "call7: $((SECONDS - T0)) s" | tee -a "$O/summary.txt"
