"""Reference loop vs chunked torch backend on CPU (issue 2's speed goal: >= 20x).

    python benchmarks/cpu_backends.py [--T 4096 --H 4 --D 64 --repeats 3]
    python benchmarks/cpu_backends.py --smoke   # tiny shapes, the table in a temporary folder

Prints a markdown table and writes it with the machine, shapes and commit to
benchmarks/results/cpu_backends.md (or ``--out``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from _common import git_commit, output_dir, smoke_requested

from deltaflow import delta_rule

# --smoke's defaults (flags still override): the same code at a size that runs in a second
SMOKE = dict(T=64, H=2, D=16, repeats=1)


def timed(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:  # the reference loop needs none (and a warm-up would cost minutes)
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--rule", default="delta")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/cpu_backends.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, temporary folder")
    if smoke_requested():
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    if args.out is None:
        folder = None if args.smoke else str(Path(__file__).parent / "results")
        args.out = str(output_dir(folder, args.smoke) / "cpu_backends.md")

    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, T, H, D = args.B, args.T, args.H, args.D
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    log_decay = -0.1 * torch.rand(B, T, H, generator=g)
    leaves = [q, k, v, beta, log_decay]

    rows = []
    for backend in ("reference", "torch"):

        def forward(backend=backend):
            with torch.no_grad():
                delta_rule(q, k, v, beta, rule=args.rule, log_decay=log_decay, backend=backend)

        def forward_backward(backend=backend):
            xs = [x.clone().requires_grad_(True) for x in leaves]
            o, _ = delta_rule(*xs[:4], rule=args.rule, log_decay=xs[4], backend=backend)
            o.sum().backward()

        warm = backend != "reference"
        rows.append(
            (
                backend,
                timed(forward, args.repeats, warm),
                timed(forward_backward, args.repeats, warm),
            )
        )

    ref = rows[0]
    commit = git_commit()
    lines = [
        f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, commit {commit}",
        f"B={B}, T={T}, H={H}, Dk=Dv={D}, float32, rule={args.rule} with decay, "
        f"median of {args.repeats}",
        "",
        "| backend | forward (s) | forward+backward (s) | fwd speed-up | fwd+bwd speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, fwd, fb in rows:
        lines.append(
            f"| {name} | {fwd:.3f} | {fb:.3f} | {ref[1] / fwd:.1f}x | {ref[2] / fb:.1f}x |"
        )
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
