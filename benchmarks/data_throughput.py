"""Documents per second and peak memory of the LM data paths: the token cache vs streaming,
1 vs 2 tokenizer worker processes (`docs/tasks.md` holds the numbers).

    python benchmarks/data_throughput.py                      # the shared corpus, GPT-2 BPE
    python benchmarks/data_throughput.py --workers 1 2 4 --repeats 3

Data: the shared corpus (`../shared/corpus`, 24 MB) as its paragraphs of more than 300
characters in one JSONL file (the README's bring-your-own-data step 2), so there are enough
documents to spread over workers. Each measurement runs in a fresh process:

- cached: ``tokenize_corpus`` into an empty cache folder (both splits, one pass);
- streaming: one epoch of the streamed training documents (read, tokenized, shuffle buffer)
  as ``LanguageModeling(streaming=True)`` feeds its row packer, no cache.

Peak memory is the process's peak resident set (VmHWM) minus its resident set before the
measurement (after imports), and the largest peak of a worker process (ru_maxrss of the
children: forked workers share the parent's pages, which count there too).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(mode: str, workers: int, data: str, tokenizer: str) -> dict:
    """One measurement in this process (the parent starts a process per measurement)."""
    from deltaflow.tasks import LanguageModeling
    from deltaflow.tasks.corpus import tokenize_corpus

    with tempfile.TemporaryDirectory() as cache:
        task = LanguageModeling(
            data, tokenizer=tokenizer, cache_dir=cache, streaming=mode == "streaming",
            workers=workers,
        )  # fmt: skip
        corpus, before = task.corpus, _status_kb("VmRSS")
        docs = corpus.total_documents()
        start = time.perf_counter()
        if mode == "cached":
            tokenize_corpus(corpus, task.tokenizer, Path(cache) / "tokens", False, workers)
        else:
            train = sum(1 for split, _ in corpus.documents() if split == "train")
            units = task._train_units()
            for _ in range(train):
                next(units)
            units.close()
            docs = train
        seconds = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "mode": mode,
        "workers": workers,
        "documents": docs,
        "seconds": round(seconds, 2),
        "docs_per_s": round(docs / seconds),
        "peak_mb": round((_status_kb("VmHWM") - before) / 1024),
        "worker_peak_mb": round(children / 1024) if workers > 1 else None,
    }


def write_paragraphs(corpus: Path, out: Path) -> int:
    n = 0
    with open(out, "w") as f:
        for path in sorted(corpus.rglob("*.txt")):
            for text in path.read_text().split("\n\n"):
                if len(text) > 300:
                    f.write(json.dumps({"text": text.strip()}) + "\n")
                    n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus"))
    parser.add_argument("--tokenizer", default=str(ROOT.parent / "shared/tokenizers/gpt2.tiktoken"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per setting")
    parser.add_argument(
        "--one", nargs=3, metavar=("MODE", "WORKERS", "DATA"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        mode, workers, data = args.one
        print(json.dumps(measure(mode, int(workers), data, args.tokenizer)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "paragraphs.jsonl"
        n = write_paragraphs(Path(args.corpus), data)
        print(f"{n} documents ({data.stat().st_size / 1e6:.1f} MB) from {args.corpus}")
        print(
            "| data path | workers | documents | seconds | documents/s | peak MB | worker peak MB |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode in ("cached", "streaming"):
            for workers in args.workers:
                runs = []
                for _ in range(args.repeats):
                    cmd = [sys.executable, __file__, "--one", mode, str(workers), str(data)]
                    cmd += ["--tokenizer", args.tokenizer]
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = max(runs, key=lambda r: r["docs_per_s"])
                print(
                    f"| {mode} | {workers} | {r['documents']} | {r['seconds']} | "
                    f"{r['docs_per_s']:,} | {r['peak_mb']} | {r['worker_peak_mb'] or '-'} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
