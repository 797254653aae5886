#!/usr/bin/env bash
# Issue 11 on one device machine: run several `deltaflow compare` commands AT ONCE (small models
# leave the GPU mostly idle, so concurrent processes are where the throughput is), then pack their
# result folders into $OUT. Usage, from the repo root on the device:
#
#   bash experiments/device_batch.sh COMMANDS_FILE [SOLO_PROBE=1] [TIME_LIMIT]
#
# COMMANDS_FILE: one `deltaflow compare` argument list per line ('#' lines skipped); every line
# should carry --resume and a --time-limit that ends before the call's 10-minute kill.
# A line that starts with `then ` waits for the line above it to end (a chain: each line after
# the one before), and runs with what is left of the call's time: its --time-limit becomes the
# chain's first limit minus the minutes already spent, and it is skipped under 1.5 minutes. So
# a GPU whose first lines end early takes more work instead of idling (session 8's GPU 1 idled
# through its third call).
# TIME_LIMIT (minutes) replaces every line's --time-limit: for a short last call of a chain
# on the session's remaining device time, with the same file (finished grids skip at once).
# Carry ["runs/carry"] (written by `python3 experiments/collect_device.py --prepare-carry` and by
# every collect), NEVER ["runs/issue11"]: a carried path REPLACES that path on the machine, and
# a warm machine's runs/issue11 holds unfinished runs' checkpoints (up to 0.4 GB, never brought
# back) that carrying it wiped in session 31's call 2 (every unfinished run restarted from zero).
# This script first merges runs/carry/issue11 into runs/issue11 without overwriting anything
# (experiments/merge_carry.py): a fresh machine gets everything, a warm one keeps its newer files
# and gains what it lacks. Whether a call lands warm or fresh is not known, so always carry it.
# The CUDA MPS daemon is started first (kernels of different processes then share the GPU
# instead of time-slicing it); if a CUDA check fails under it, it is stopped and the runs go on
# without it. With SOLO_PROBE=1 a 200-step state-tracking run trains alone first: its tokens/s
# is the baseline for the concurrent runs' tokens/s (the overlap factor, see results/PLAN.md).
set -u
commands_file=$1
solo_probe=${2:-1}
time_limit=${3:-}
# two commands must not share an --out: each rewrites its folder's runs.jsonl and tables
outs=$(grep -v '^#' "$commands_file" | grep -o -- '--out [^ ]*' | sort)
if [ -n "$(echo "$outs" | uniq -d)" ]; then
    echo "error: $commands_file: two lines share an --out: $(echo "$outs" | uniq -d | tr '\n' ' ')" >&2
    exit 2
fi
# the local state arrives as runs/carry/issue11, never as runs/issue11 itself: a carried path
# replaces the machine's, and a warm machine's runs/issue11 holds newer checkpoints (session
# 31's call 2 lost them all that way). Add what the machine lacks, keep what it has. A merge
# that fails stops the call in seconds: better than retraining runs finished elsewhere.
if [ -d runs/carry/issue11 ]; then
    python3 experiments/merge_carry.py runs/carry/issue11 runs/issue11 || exit 1
fi

out=${OUT:-runs/issue11/out}
mkdir -p runs/issue11/logs "$out"
rm -f runs/issue11/logs/*  # a warm machine keeps the last call's logs: start clean
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# many processes share one GPU: grow each one's cache in place instead of in fixed blocks
# (session 6's 18 processes held ~1.3x their runs' peak memory: 142 of 143.8 GB)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
cli=${DEVICE_BATCH_CLI:-python3 -m deltaflow.cli compare}  # tests put a stand-in here
started=$(date +%s)

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if pgrep -f nvidia-cuda-mps-control > /dev/null; then
    echo "MPS: on (already running on this warm machine)"
elif nvidia-cuda-mps-control -d 2>/dev/null && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    echo "MPS: on"
else
    echo quit | nvidia-cuda-mps-control 2>/dev/null
    echo "MPS: off (daemon did not start or CUDA failed under it)"
fi

if [ "$solo_probe" = 1 ]; then
    $cli --preset state_tracking --device cuda --cells parity --variants deltanet --lrs 3e-3 \
        --seeds 1 --steps 200 --jobs 1 --no-progress --out runs/issue11/solo_probe \
        > runs/issue11/logs/solo_probe.log 2>&1
    python3 -c "import json; r=[json.loads(l) for l in open('runs/issue11/solo_probe/runs.jsonl')][-1]; print('solo probe tokens/s', r.get('tokens_per_s'), 'seconds', r.get('seconds'))"
fi

# GPU utilisation every 10 s while the commands run (is the GPU busy or waiting on launches?)
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 10 \
    > runs/issue11/logs/nvidia_smi.csv 2>&1 &
smi=$!

# every line gets a number (its log is cmdN.log); a chain is "N<TAB>line" rows, one per line
i=0
chains=()
while IFS= read -r line; do
    case "$line" in ''|'#'*) continue ;; esac
    i=$((i + 1))
    if [ -n "$time_limit" ]; then
        line=$(echo "$line" | sed -E "s/--time-limit [0-9.]+/--time-limit $time_limit/")
    fi
    case "$line" in
        'then '*)
            if [ ${#chains[@]} = 0 ]; then
                echo "error: $commands_file: the first line cannot start with 'then'" >&2
                exit 2
            fi
            chains[-1]+=$'\n'"$i"$'\t'"${line#then }" ;;
        *) chains+=("$i"$'\t'"$line") ;;
    esac
done < "$commands_file"

run_chain() {  # the chain's lines one after another; later ones on the time left
    local first=1 first_limit="" n line left
    while IFS=$'\t' read -r n line; do
        if [ "$first" = 1 ]; then
            first=0
            first_limit=$(echo "$line" | grep -oE -- '--time-limit [0-9.]+' | awk '{print $2}')
        elif [ -n "$first_limit" ]; then
            left=$(awk -v l="$first_limit" -v s="$started" -v now="$(date +%s)" \
                'BEGIN { printf "%.1f", l - (now - s) / 60 }')
            if awk -v x="$left" 'BEGIN { exit !(x < 1.5) }'; then
                echo "[$n] skipped: $left minutes left" | tee "runs/issue11/logs/cmd$n.log"
                continue
            fi
            line=$(echo "$line" | sed -E "s/--time-limit [0-9.]+/--time-limit $left/")
        fi
        echo "[$n] deltaflow compare $line"
        # shellcheck disable=SC2086  # the line is an argument list
        $cli $line --no-progress > "runs/issue11/logs/cmd$n.log" 2>&1
    done <<< "$1"
}

pids=()
for chain in "${chains[@]}"; do
    run_chain "$chain" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
kill "$smi" 2>/dev/null

for log in runs/issue11/logs/cmd*.log; do echo "== $log"; tail -n 4 "$log"; done
# finished runs live in runs.jsonl; the per-run checkpoint folders stay here (too big for $OUT)
tar czf "$out/issue11.tgz" -C runs --exclude='issue11/*/runs' --exclude='issue11/*/runs.prev' issue11
# except small unfinished runs' newest checkpoints: they fit $OUT and the next machine's carry
python3 experiments/pack_resume.py runs/issue11 "$out/resume.tgz"
ls -la "$out"
