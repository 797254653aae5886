"""Training speed on CPU at 1 vs N torch threads, for the default of ``deltaflow train --threads``.

Each measurement is a fresh process (``torch.set_num_threads`` as ``--threads`` does it) that
trains a few warm-up steps, then times ``--steps`` optimizer steps; settings are interleaved
(1, 2, 1, 2, ...) and repeated so that load from other processes hits both alike, and the
median seconds per step over the repeats is reported with the load average around it.

    python benchmarks/cpu_threads.py                       # parity and mqar, tiny and small
    python benchmarks/cpu_threads.py --repeats 7 --threads 1,2 --json out.json
    python benchmarks/cpu_threads.py --smoke   # one tiny case, one step per process, temp JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import output_dir, smoke_requested

# name -> TrainConfig fields. "tiny": the quick preset's models (1 layer, width 64); "small":
# the shipped configs' models (2 layers, width 128).
CASES: dict[str, dict] = {
    "parity/tiny": dict(
        task="parity",
        model=dict(hidden_size=64, num_layers=1, num_heads=2, negative_eigenvalues=True),
        batch_size=64,
    ),
    "parity/small": dict(
        task="parity",
        model=dict(hidden_size=128, num_layers=2, num_heads=2, negative_eigenvalues=True),
        batch_size=128,
    ),
    "mqar/tiny": dict(
        task="mqar",
        task_kwargs=dict(seq_len=64, num_kv_pairs=8, vocab_size=256),
        model=dict(hidden_size=64, num_layers=1, num_heads=2),
        batch_size=64,
    ),
    "mqar/small": dict(
        task="mqar",
        task_kwargs=dict(seq_len=256, num_kv_pairs=16, vocab_size=8192),
        model=dict(rule="efla", use_decay=True, hidden_size=128, num_layers=2, num_heads=2),
        batch_size=64,
    ),
    # the README's GPU command: the default model (32M parameters), at a batch of 8 to keep
    # memory down; run alone: --cases mqar/default --warmup 1 --steps 2 --repeats 3
    "mqar/default": dict(task="mqar", model=dict(rule="efla", use_decay=True), batch_size=8),
}
DEFAULT_CASES = ["parity/tiny", "parity/small", "mqar/tiny", "mqar/small"]
# --smoke's defaults (flags still override): one tiny case, one thread, one timed step
SMOKE = dict(cases="parity/tiny", threads="1", repeats=1, warmup=1, steps=1)

_CHILD = """
import json, sys, time, torch
from deltaflow.train import Trainer, TrainConfig
fields, threads, warmup, steps = json.loads(sys.argv[1]), *map(int, sys.argv[2:5])
torch.set_num_threads(threads)
trainer = Trainer(TrainConfig(device="cpu", progress=False, steps=warmup + steps, **fields))
for i in range(warmup):
    trainer.train_step(i)
start = time.perf_counter()
for i in range(warmup, warmup + steps):
    trainer.train_step(i)
print(json.dumps({"s_per_step": (time.perf_counter() - start) / steps,
                  "params": trainer.num_params}))
"""


def measure(fields: dict, threads: int, warmup: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(fields), str(threads), str(warmup), str(steps)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {list(CASES)}"
    )
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per process")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--smoke", action="store_true", help="tiny; the JSON in a temp folder")
    if smoke_requested():
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    if args.smoke and not args.json:
        args.json = str(output_dir(None, smoke=True) / "cpu_threads.json")
    threads = [int(t) for t in args.threads.split(",")]
    results = []
    for case in args.cases.split(","):
        times: dict[int, list[float]] = {t: [] for t in threads}
        loads = []
        params = 0
        for _ in range(args.repeats):
            for t in threads:
                loads.append(os.getloadavg()[0])
                r = measure(CASES[case], t, args.warmup, args.steps)
                times[t].append(r["s_per_step"])
                params = r["params"]
        medians = {t: statistics.median(v) for t, v in times.items()}
        row = {
            "case": case,
            "params": params,
            "median_ms_per_step": {t: round(1e3 * m, 2) for t, m in medians.items()},
            "all_ms_per_step": {t: [round(1e3 * x, 2) for x in v] for t, v in times.items()},
            "load_avg_range": [round(min(loads), 2), round(max(loads), 2)],
        }
        results.append(row)
        base = medians[threads[0]]
        ratios = ", ".join(f"{t} threads {base / m:.2f}x" for t, m in medians.items())
        print(
            f"{case:13s} {params / 1e6:5.2f}M params  "
            + "  ".join(f"{t}T {1e3 * m:7.1f} ms/step" for t, m in medians.items())
            + f"  (speed vs {threads[0]}T: {ratios}; load {row['load_avg_range']})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"time": time.ctime(), "cpus": os.cpu_count(), "results": results}, f, indent=2
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
