"""How check_triton.py spends its wall time on one GPU: compile everything first, on every CPU
core, then run the cases under a GPU-memory budget.

Measured on an H100 (benchmarks/NOTES.md, issue 30): compiling is most of the wall time, and
each process that loads a kernel which spills registers reserves local memory for every thread
the GPU can hold (spill stack per thread × multiprocessors × threads per multiprocessor: 20 KB
of stack is 5.5 GB on an H100), kept until the process ends. Compiling inside the case
processes therefore did both at once: a dozen processes compiling and holding GBs each ran the
GPU out of memory, and fewer left cores idle.

1. Compile phase: every distinct specialization of the plan, once, each in a task of its own
   on ``compile_workers`` processes (the longest first). Triton's warm-up path compiles into
   the disk cache and loads nothing onto the GPU, so these processes hold no local memory.
2. Run phase: each batch of cases that share their kernels in a fresh process (the
   reservation ends with it) that finds every kernel in the cache; a batch starts when its
   predicted memory (a base plus its largest spill stack × the GPU's resident threads, from the
   compile phase's cubins) fits the budget left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

# A case process's memory besides local memory: the CUDA context, torch, the inputs and the
# float64 references (measured per process on the H100: under 2 GB without spilling kernels).
BASE_GB = 2.0
# A kernel whose spill stack is unknown (no cuobjdump beside Triton) counts as this large.
UNKNOWN_STACK = 32 * 1024


def describe(kind: str, args: tuple) -> str:
    if kind == "op":
        label, _, _, _, _, _, rule, ne, dt, _, _ = args
        return f"op {label} {rule} ne={ne} {dt}"
    return f"{kind} {' '.join(str(a) for a in args[:-1])}".strip()


def print_plan(cases: list, keys: list[list]) -> None:
    """Every case and the specializations it launches: '+' first launched there (compiled by
    the compile phase on that case's trace), '=' already compiled by an earlier case."""
    seen: set = set()
    for n, (case, case_keys) in enumerate(zip(cases, keys), 1):
        print(f"case {n}: {describe(*case)}")
        for key in case_keys:
            print(f"  {'=' if key in seen else '+'} {key.label()}")
            seen.add(key)
    kernels: dict[str, int] = {}
    for key in seen:
        kernels[key.kernel] = kernels.get(key.kernel, 0) + 1
    counts = ", ".join(f"{k} {v}" for k, v in sorted(kernels.items()))
    print(f"plan: {len(cases)} cases, {len(seen)} specializations ({counts})")


def first_case_of(cases: list, keys: list[list]) -> dict:
    """Every specialization of the plan (``keys[i]``: what case i launches), mapped to the
    first case that launches it: the case the compile phase traces to compile it."""
    first: dict = {}
    for case, case_keys in zip(cases, keys):
        for key in case_keys:
            first.setdefault(key, case)
    return first


# Relative compile seconds by kernel (benchmarks/NOTES.md, issue 30: the AOT sm_90 table): the
# prepare kernel takes longest (bf16 30-55 s, fp32 120 s on the 2-core box), then the key-side
# gradients; fp32 operands (tf32x3) about twice bf16.
KERNEL_WEIGHT = {"chunk_prepare_kernel": 8.0, "chunk_grads_k_kernel": 2.0}


def compile_cost_hint(key: Any) -> float:
    """An order for the compile phase, longest first, so that no long compile starts last."""
    c = dict(key.constexprs)
    fp32 = not any(a.startswith("*bfloat16") or a.startswith("*float16") for a in key.args)
    blocks = c.get("BK", 64) * c.get("BV", 64) / 16384
    exact = 8.0 if c.get("PREC") == "ieee" else 1.0  # exact fp32 dots: minutes (NOTES.md)
    return KERNEL_WEIGHT.get(key.kernel, 1.0) * (2.0 if fp32 else 1.0) * blocks * exact


def compile_phase(
    first: dict[Any, tuple[str, tuple]],
    task: Callable[..., tuple[float, dict]],
    workers: int,
    ctx: Any,
    init: Callable[..., None] | None = None,
    init_args: tuple = (),
    log: Callable[[str], None] = print,
) -> dict[Any, dict]:
    """Compile every key of ``first`` (key → the case whose trace launches it) with
    ``task(kind, args, key)``; returns each key's resource usage (with its seconds)."""
    usage: dict[Any, dict] = {}
    order = sorted(first, key=compile_cost_hint, reverse=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(workers, ctx, init, init_args) as pool:
        futures = {pool.submit(task, *first[key], key): key for key in order}
        for future in futures:
            key = futures[future]
            try:
                seconds, res = future.result()
            except Exception as e:  # noqa: BLE001 - the run phase reports the case that fails
                log(f"compile FAILED {key.label()}: {type(e).__name__}: {str(e)[:200]}")
                continue
            usage[key] = {"seconds": seconds, **res}
    total = sum(u["seconds"] for u in usage.values())
    slowest = sorted(usage, key=lambda k: -usage[k]["seconds"])[:5]
    log(
        "slowest compiles: "
        + "; ".join(f"{usage[k]['seconds']:.0f} s {k.label()}" for k in slowest)
    )
    log(
        f"compile phase: {len(usage)}/{len(first)} specializations, {total:.0f} s of compiling "
        f"on {workers} processes, {time.perf_counter() - start:.0f} s of wall time"
    )
    return usage


def batches(cases: list, group_of: Callable[[Any], Any], size: int) -> list[list[int]]:
    """The cases' indices in batches of at most ``size``, each batch from one group
    (``group_of(case)``: cases that launch the same kernels), in order of first appearance.
    A batch runs in one process: its start-up (~6 s on the H100 machine: torch, CUDA) and its
    kernels' first launches (~8 s: Triton finds and loads each kernel and its launcher) are paid
    once per batch, not once per case (measured per case in session 13: a T=1 case was 9 s of
    which 0.5 s computing)."""
    groups: dict[Any, list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(group_of(case), []).append(i)
    return [g[j : j + size] for g in groups.values() for j in range(0, len(g), size)]


def warm_up(
    cases: list,
    keys: list[list],
    task: Callable[..., tuple[float, dict]],
    workers: int,
    smoke: bool,
    started: float,
) -> bool:
    """The --warm-only path of kernels.py and generation.py: every specialization of ``keys``
    (``keys[i]``: what ``cases[i]`` launches, traced since ``started``) compiled once with
    ``task`` by :func:`compile_phase` on spawned processes. False when the trace saw no launch
    (a warm-up that warms nothing must not pass) or a compile failed; smoke: trace only (the
    interpreter compiles nothing)."""
    import multiprocessing

    first = first_case_of(cases, keys)
    print(f"warm: {len(first)} specializations traced in {time.perf_counter() - started:.0f} s")
    if not first:
        print("error: --warm-only traced no Triton launch")
        return False
    if smoke:
        return True
    ctx = multiprocessing.get_context("spawn")  # torch's threads do not survive a fork
    return len(compile_phase(first, task, workers, ctx)) == len(first)


def case_memory_gb(keys: list[Any], usage: dict[Any, dict], threads: int) -> float:
    """What a case's process is predicted to hold: BASE_GB plus the local memory its largest
    spill stack reserves for ``threads`` resident threads."""
    stack = max((usage.get(k, {}).get("STACK", UNKNOWN_STACK) for k in keys), default=0)
    return BASE_GB + stack * threads / 1e9


def run_phase(
    cases: list[tuple[str, tuple]],
    memory_gb: list[float],
    budget_gb: float,
    task: Callable[..., Any],
    workers: int,
    ctx: Any,
    init: Callable[..., None],
    init_args: tuple,
    on_result: Callable[[Any], None],
) -> None:
    """Run every case with ``task(kind, args)`` in a fresh process each, at most ``workers`` at
    once and, in plan order, the first whose ``memory_gb`` fits what the running ones leave of
    ``budget_gb`` (a case larger than the whole budget runs alone)."""
    pending = list(range(len(cases)))
    running: dict[Future, float] = {}
    used = 0.0
    with ProcessPoolExecutor(workers, ctx, init, init_args, max_tasks_per_child=1) as pool:
        while pending or running:
            while pending and len(running) < workers:
                fits = [i for i in pending if used + memory_gb[i] <= budget_gb]
                if not fits and running:
                    break
                i = fits[0] if fits else pending[0]
                pending.remove(i)
                used += memory_gb[i]
                running[pool.submit(task, *cases[i])] = memory_gb[i]
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                used -= running.pop(future)
                on_result(future.result())
