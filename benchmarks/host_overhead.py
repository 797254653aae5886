"""The delta-rule op's host time: what one forward and one backward of ``deltaflow::chunk_fwd`` /
``deltaflow::chunk_bwd`` cost the CPU, measured on a CPU with every Triton launch a no-op.

    python benchmarks/host_overhead.py [--repeats 400] [--json out.json]
    python benchmarks/host_overhead.py --smoke          # tiny shapes, a few repeats (CI)
    PYTHONPATH=/other/tree python benchmarks/host_overhead.py   # time another checkout's op
    python benchmarks/host_overhead.py --cuda   # on a GPU: the launches run, host µs a call
    python benchmarks/host_overhead.py --shape 2,8192,8,128 --sms 132 \
        --set triton_backend.SEQUENCE_PARALLEL_STATES=on   # another shape, GPU, settings

What it measures. The ops are called as a compiled training step calls them (``torch.ops``, grad
mode off, the arguments the forward and backward graphs pass) at the 400M model's shape: B=8,
T=2048, H=8, Dk=Dv=128, bf16 q/k/v, fp32 β and log α, rule delta with decay, no initial state,
``triton_backend.SAVE_FOR_BACKWARD`` as set. Every ``kernel[grid](...)`` reaches Triton's
``JITFunction.run``, which ``benchmarks/_launches.intercepted`` replaces by a counter: the
launchers still build every argument, and every output buffer is still allocated. The
forward/backward choice that depends on the GPU sees an H100 (132 SMs: the two-pass forward at
this shape, as in the model). Reported: the median of ``--repeats`` calls, in microseconds, for
the whole op and per stage (the backend's functions wrapped, each stage's own time, nested
stages subtracted); the aten ops one call dispatches (allocations apart: each is a GPU kernel
launch or a caching-allocator call on a GPU); the Triton launches per call; and every host <->
device synchronization point found in the op (dense and packed sequences) and in a small model's
training step (forward, loss, backward), with the line that makes it.

What it does not measure. Triton's own cost per launch (``JITFunction.run``: binding ~25
arguments, the specialization key, the cache lookup, the driver call; tens of microseconds per
launch on a GPU host) is not included: multiply the launch count by it. Nor is the CUDA side of
each aten op (``cudaLaunchKernel``, the caching allocator: a few microseconds each on a GPU
host); the op counts say how many there are. Large CPU buffers come from the heap here (see
:func:`heap_allocations`) so that allocating costs about what the CUDA caching allocator does,
not an mmap per buffer. One thread: the host work of the GPU op is single-threaded.

Syncs: on a GPU, ``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``,
``masked_select``, ``repeat_interleave`` without ``output_size`` and blocking device copies make
the host wait for the GPU's queue to drain, which ends the host's run-ahead; on a CPU they cost
nothing, so they are found by name (:class:`OpWatch`), not by time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Launches are intercepted at JITFunction.run: the interpreter's kernels are no JITFunctions.
os.environ.pop("TRITON_INTERPRET", None)

import _settings  # noqa: E402
import torch  # noqa: E402
from _common import git_commit, smoke_requested  # noqa: E402
from _launches import H100_SMS, intercepted  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SHAPE = (8, 2048, 8, 128)  # B, T, H, D of the 400M model (benchmarks/model_training.py)
SMOKE_SHAPE = (2, 256, 2, 32)
PACKED_LENGTHS = (700, 1, 0, 1347)  # packed sequences of the op's sync scan (one empty)

# aten ops that allocate (a caching-allocator call on a GPU, no kernel unless they fill)
ALLOCATING = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
FILLING = {"zeros", "new_zeros", "zeros_like", "full", "new_full", "full_like", "ones"}
# aten ops whose answer or output shape needs the device's values: a host sync on a GPU
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal"}


def heap_allocations() -> None:
    """Serve every allocation from glibc's heap (no mmap), and keep freed memory (no trim): a
    32 MB CPU buffer otherwise costs an mmap and a munmap (tens of µs, page-table work) that the
    CUDA caching allocator never pays. Nothing is ever touched, so no page is faulted in."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap'd chunks
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give the heap back


def make_inputs(
    shape: tuple[int, int, int, int], device: str = "cpu", packed: bool = False
) -> dict[str, Any]:
    """The op's tensors as the layer hands them over (``DeltaAttention``: bf16 q, k, v, fp32 β
    from a sigmoid, fp32 log α <= 0), and the backward's incoming gradient of o."""
    B, T, H, D = shape
    g = torch.Generator().manual_seed(0)
    cu = None
    if packed:  # the same tokens as one row of packed sequences
        lengths = [n * B * T // sum(PACKED_LENGTHS) for n in PACKED_LENGTHS]
        lengths[-1] += B * T - sum(lengths)
        cu = torch.tensor([0, *lengths]).cumsum(0).to(device, torch.int32)
        B, T = 1, B * T

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, torch.bfloat16)

    return dict(
        q=randn(B, T, H, D),
        k=randn(B, T, H, D),
        v=randn(B, T, H, D),
        beta=torch.rand(B, T, H, generator=g).to(device),
        log_decay=-torch.rand(B, T, H, generator=g).to(device),
        cu_seqlens=cu,
        grad_o=randn(B, T, H, D),
    )


def op_calls(
    x: dict[str, Any], direct: bool = False
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, backward): one call each of the custom ops with the arguments the compiled
    graphs pass. ``direct``: the ops' Python bodies without the dispatcher (so that a dispatch
    mode sees the aten ops inside them)."""
    from deltaflow.ops import triton_backend, triton_ops

    fwd_op, bwd_op = torch.ops.deltaflow.chunk_fwd.default, torch.ops.deltaflow.chunk_bwd.default
    if direct:
        fwd_op, bwd_op = triton_ops.chunk_fwd_op._init_fn, triton_ops.chunk_bwd_op._init_fn
    names = ("q", "k", "v", "beta", "log_decay", "cu_seqlens")
    q, k, v, beta, log_decay, cu = (x[n] for n in names)
    rule = triton_backend.kernel_id_of("delta")
    scale = q.shape[-1] ** -0.5
    options = (rule, False, 1e-6, scale, 64)
    save = triton_backend._save_mode(q.detach().requires_grad_())  # as delta_rule picks it
    with torch.no_grad():
        fwd_out = fwd_op(q, k, v, beta, log_decay, None, cu, *options, save)
    kept = [s if s.numel() else None for s in fwd_out[2:]]
    # The final state is not used: autograd hands the backward no gradient for it. Where the
    # schema takes None the backward gets None; else the zeros the autograd formula made (in
    # the compiled backward graph: one more allocation and fill, outside the op).
    schema = torch.ops.deltaflow.chunk_bwd.default._schema
    arg = next(a for a in schema.arguments if a.name == "grad_state")
    optional = isinstance(arg.type, torch.OptionalType)
    grad_state = None if optional else torch.zeros_like(fwd_out[1])

    def forward() -> Any:
        return fwd_op(q, k, v, beta, log_decay, None, cu, *options, save)

    def backward() -> Any:
        return bwd_op(
            q, k, v, beta, log_decay, None, cu, x["grad_o"], grad_state, *kept, *options
        )  # fmt: skip

    return forward, backward


def median_us(
    fn: Callable[[], Any], repeats: int, warmup: int = 20, cuda: bool = False
) -> dict[str, float]:
    """Median (and 10th / 90th percentile) microseconds of ``fn()`` over ``repeats`` calls; on
    the GPU the host's time only (the queue drained before each call, not waited for after)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    times.sort()
    return {
        "median": statistics.median(times),
        "p10": times[len(times) // 10],
        "p90": times[(len(times) * 9) // 10],
    }


# The backend's stages: (module, function) pairs wrapped by :class:`StageTimer`, those that a
# checkout has (the names moved between versions; a missing one is skipped).
STAGES = {
    "inputs (dtype, contiguous)": ("deltaflow.ops.triton_backend", "_inputs"),
    "chunk tables": ("deltaflow.ops.triton_backend", "chunk_tables"),
    "two-pass choice": ("deltaflow.ops.triton_backend", "_use_two_pass"),
    "buffers (allocations)": ("deltaflow.ops.triton_backend", "_output"),
    "prepare launch": ("deltaflow.ops.triton_backend", "launch_prepare"),
    "state pass launch": ("deltaflow.ops.triton_backend", "launch_states"),
    "segments (choice, tables)": ("deltaflow.ops.triton_backend", "_segments"),
    "segmented state pass launches": ("deltaflow.ops.triton_backend", "launch_segmented_states"),
    "segmented reverse launches": ("deltaflow.ops.triton_backend", "launch_segmented_dstates"),
    "fused forward launch": ("deltaflow.ops.triton_backend", "launch_forward"),
    "outputs launch": ("deltaflow.ops.triton_backend", "launch_outputs"),
    "reverse pass launch": ("deltaflow.ops.triton_backend", "launch_dstates"),
    "gradients launch": ("deltaflow.ops.triton_backend", "launch_gradients"),
    "backend forward, rest": ("deltaflow.ops.triton_backend", "_forward"),
    "backend backward, rest": ("deltaflow.ops.triton_backend", "_backward"),
}


class StageTimer:
    """Wraps :data:`STAGES` so that each records its own time per call (time inside a nested
    stage counts for that one only); what the op takes beyond them is the custom op's wrapper
    and dispatch ("op wrapper, dispatch")."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.stack: list[list[float]] = []  # [start, time spent in nested stages]

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append([time.perf_counter_ns(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, nested = self.stack.pop()
                spent = time.perf_counter_ns() - start
                self.times.setdefault(name, []).append(spent - nested)
                if self.stack:
                    self.stack[-1][1] += spent

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import importlib

        saved = []
        for name, (module_name, attr) in STAGES.items():
            module = importlib.import_module(module_name)
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, self.wrap(name, getattr(module, attr)))
        try:
            yield
        finally:
            for module, attr, fn in saved:
                setattr(module, attr, fn)

    def per_call(self, calls: int) -> dict[str, float]:
        """Microseconds per op call of each stage: the median call's share (a stage that runs
        k times a call counts k times)."""
        out = {}
        for name, times in self.times.items():
            k = len(times) // calls
            out[name] = statistics.median(times) * k / 1e3 if k else 0.0
        return out


def stage_breakdown(
    fn: Callable[[], Any], repeats: int, cuda: bool = False
) -> tuple[dict[str, float], float]:
    """Each stage's µs per call of ``fn`` (wrapped), and the whole call's median (wrapped too:
    the difference is the custom op's own wrapper and the dispatcher)."""
    for _ in range(10):
        fn()
    timer = StageTimer()
    with timer.installed():
        total = median_us(fn, repeats, warmup=0, cuda=cuda)["median"]
    stages = timer.per_call(repeats)
    stages["op wrapper, dispatch"] = max(total - sum(stages.values()), 0.0)
    return stages, total


class OpWatch(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, and records every one that would make a GPU's
    host wait (:data:`SYNCING`, and ``repeat_interleave`` without ``output_size``) with the
    deltaflow line that asked for it. ``.tolist()``, ``.cpu()`` and ``.numpy()`` of a CPU
    tensor dispatch nothing: :func:`watched_methods` catches those.

    Only device tensors count: on a GPU, CUDA ones; on a CPU, where every tensor is a CPU one,
    those not derived from the ``host`` tensors (a batch the trainer holds on the CPU): an op
    whose tensor arguments are all host tensors makes host tensors."""

    def __init__(self, host: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.host = {id(t) for t in host}
        self.kept = list(host)  # alive, so that no other tensor takes their ids

    def on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda or (t.device.type == "cpu" and id(t) not in self.host)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops[name] += 1
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        device = any(self.on_device(t) for t in tensors)
        data_dependent = name == "repeat_interleave" and kwargs.get("output_size") is None
        if device and (name in SYNCING or data_dependent):
            self.syncs[f"{name} at {caller()}"] += 1
        out = func(*args, **kwargs)
        if tensors and not device and not any(t.is_cuda for t in tensors):
            produced = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.host.update(id(t) for t in produced)
            self.kept.extend(produced)
        return out


def caller() -> str:
    """The innermost deltaflow line on the stack (file:line (function)), in the checkout whose
    deltaflow is imported."""
    import deltaflow

    package = Path(deltaflow.__file__).resolve().parent
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        if package in path.parents:
            return f"{path.relative_to(package.parent)}:{frame.lineno} ({frame.name})"
    return "outside deltaflow"


@contextlib.contextmanager
def watched_methods(watch: OpWatch) -> Iterator[None]:
    """``Tensor.tolist``, ``.cpu``, ``.numpy`` recorded as syncs while inside (a GPU tensor's
    copy to the host waits for the GPU)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if watch.on_device(self):
                watch.syncs[f"{name} at {caller()}"] += 1
            return fn(self, *args, **kwargs)

        return method

    for name, fn in saved.items():
        setattr(torch.Tensor, name, recorded(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def watched(fn: Callable[[], Any], host: list[torch.Tensor] = ()) -> OpWatch:
    """The aten ops and syncs of one call of ``fn`` (``host``: see :class:`OpWatch`)."""
    watch = OpWatch(host)
    with watch, watched_methods(watch):
        fn()
    return watch


def summarize_ops(ops: Counter[str]) -> dict[str, Any]:
    views = {"view", "_unsafe_view", "as_strided", "slice", "select", "alias", "detach", "t"}
    alloc = sum(n for op, n in ops.items() if op in ALLOCATING)
    fill = sum(n for op, n in ops.items() if op in FILLING)
    other = {op: n for op, n in ops.items() if op not in ALLOCATING | FILLING | views}
    return {
        "allocations": alloc,
        "allocations with a fill": fill,
        "other tensor ops (a GPU kernel each)": sum(other.values()),
        "views": sum(n for op, n in ops.items() if op in views),
        "ops": dict(sorted(ops.items())),
    }


def model_step_syncs(shape: tuple[int, int, int, int], device: str) -> dict[str, dict]:
    """The syncs of one training step (forward with labels, the loss, backward) of a one-layer
    DeltaFlowForCausalLM with the op's H and D, eager, the layer on the Triton backend: as
    ``model_training.py``'s pure step calls it (ids on the device), as the trainer does (ids
    checked on the CPU batch, moved without waiting) and packed as the trainer packs documents.
    When compiled, the blocks' Python runs only while tracing; the model's around them runs
    every step."""
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM, modeling
    from deltaflow.train.packing import cu_seqlens_from_starts

    _, _, H, D = shape
    torch.manual_seed(0)
    config = DeltaFlowConfig(
        vocab_size=97, hidden_size=H * D, num_layers=1, num_heads=H, head_dim=D,
        rule="delta", use_decay=True, qk_norm="l2", backend="triton",
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = DeltaFlowForCausalLM(config).to(device, dtype).train()
    ids = torch.randint(0, 97, (2, 128))  # the batch, on the CPU as a task returns it
    starts = torch.zeros(2, 128, dtype=torch.bool)
    starts[:, [0, 40, 41]] = True
    on_host = getattr(modeling, "check_batch_token_ids", None)  # this checkout's trainer path
    checked = getattr(modeling, "token_ids_checked", contextlib.nullcontext)
    cu = cu_seqlens_from_starts(starts)  # the trainer's packing, on the CPU (packing.py)
    cu_passed = cu_of(cu, torch.device(device))
    # The ids copied to the device; on a CPU run, a copy that is not a host tensor
    copy = ids.to(device) if device == "cuda" else ids.clone()

    def pure() -> None:
        model(input_ids=copy, labels=copy).loss.backward()

    def trainer(packed: bool = False) -> Callable[[], None]:
        def step() -> None:
            context = checked if on_host is not None and on_host(model, ids, ids) else None
            x = ids.to(device, non_blocking=True) if device == "cuda" else copy
            with context() if context else contextlib.nullcontext():
                if packed:  # packed_forward's call, the offsets as the checkout passes them
                    row = x.reshape(1, -1)
                    out = model(input_ids=row, labels=row, cu_seqlens=cu_passed)
                else:
                    out = model(input_ids=x, labels=x)
            out.loss.backward()

        return step

    steps = {"pure step (ids on the device)": pure, "trainer's step": trainer()}
    steps["trainer's step, packed documents"] = trainer(packed=True)
    out = {}
    for name, step in steps.items():
        step()  # first call: lazy imports, compiles, the tables cache
        out[name] = dict(watched(step, host=[ids, starts, cu]).syncs)
    return out


def cu_of(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The offsets as this checkout's ``packed_forward`` hands them to the model: on the CPU
    (the model checks and moves them), or moved first (before issue 31's host-time cuts: a
    blocking copy, then the model's checks on the device)."""
    import inspect

    from deltaflow.train import packing

    if ".to(input_ids.device)" in inspect.getsource(packing.packed_forward):
        return cu.to(device) if device.type == "cuda" else cu.clone()  # not a host tensor
    return cu


def launch_counter() -> tuple[Counter[str], Callable[..., None]]:
    launches: Counter[str] = Counter()

    def count(fn: Any, _run: Any, kwargs: dict[str, Any]) -> None:
        launches[fn.__name__] += 1

    return launches, count


@contextlib.contextmanager
def counted(launches: Counter[str]) -> Iterator[None]:
    """Within, every Triton launch runs and is counted (on a GPU)."""
    from triton.runtime.jit import JITFunction

    real = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches[self.__name__] += 1
        return real(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = real


def clear_tables_cache() -> None:
    """Empty the chunk tables cache where this checkout has one (its misses sync, packed), and
    the segment tables' caches (sequence-parallel state passes) where it has those."""
    from deltaflow.ops.triton import common

    if hasattr(common, "_tables"):
        common._tables.clear()
    with contextlib.suppress(ImportError):
        from deltaflow.ops.triton import segment_states

        for name in ("_segment_cache", "_dense_cache"):
            if hasattr(segment_states, name):
                getattr(segment_states, name).clear()


def measure(
    shape: tuple[int, int, int, int], repeats: int, device: str, sms: int = H100_SMS
) -> dict[str, Any]:
    """Every number of the report, for the dense and the packed layout (``sms``: the
    multiprocessors the traced op sees on a CPU, for its two-pass and segment choices)."""
    launches, count = launch_counter()
    report: dict[str, Any] = {"shape": dict(zip("BTHD", shape)), "device": device}
    report["sms"] = None if device == "cuda" else sms
    from deltaflow.ops import triton_backend

    report["save_for_backward"] = triton_backend.SAVE_FOR_BACKWARD
    # On a CPU the launches are counted instead of run; on a GPU they run (counted on one call).
    cuda = device == "cuda"
    with contextlib.nullcontext() if cuda else intercepted(count, sms):
        for layout in ("dense", "packed"):
            x = make_inputs(shape, device, packed=layout == "packed")
            entry: dict[str, Any] = {}
            for name, fn, body in zip(("forward", "backward"), op_calls(x), op_calls(x, True)):
                fn()
                launches.clear()
                with counted(launches) if cuda else contextlib.nullcontext():
                    fn()
                per_call = dict(launches)
                clear_tables_cache()
                cold = watched(body)
                warm = watched(body)
                stages, wrapped = stage_breakdown(fn, max(repeats // 2, 3), cuda)
                entry[name] = {
                    "us": median_us(fn, repeats, cuda=cuda),
                    "stages_us": stages,
                    "wrapped_total_us": wrapped,
                    "launches": per_call,
                    "syncs": dict(warm.syncs),
                    "syncs_on_a_tables_miss": dict(cold.syncs),
                    **summarize_ops(warm.ops),
                }
            report[layout] = entry
        report["model step syncs"] = model_step_syncs(shape, device)
    return report


def print_report(report: dict[str, Any]) -> None:
    shape = report["shape"]
    print(f"host_overhead: commit {report['commit']}, {report['device']}, B={shape['B']} "
          f"T={shape['T']} H={shape['H']} D={shape['D']}, "
          f"SAVE_FOR_BACKWARD={report['save_for_backward']!r}, SMs {report['sms']}, "
          f"settings {report['settings']}")  # fmt: skip
    for layout in ("dense", "packed"):
        for name in ("forward", "backward"):
            e = report[layout][name]
            us = e["us"]
            n = sum(e["launches"].values())
            print(f"\n{layout} {name}: {us['median']:.1f} us a call (p10 {us['p10']:.1f}, "
                  f"p90 {us['p90']:.1f}); {n} Triton launches {sorted(e['launches'])}")  # fmt: skip
            print(f"  aten ops: {e['allocations']} allocations, {e['allocations with a fill']} "
                  f"allocations with a fill, {e['other tensor ops (a GPU kernel each)']} other "
                  f"ops, {e['views']} views: {e['ops']}")  # fmt: skip
            for stage, t in sorted(e["stages_us"].items(), key=lambda kv: -kv[1]):
                if t > 0:
                    print(f"  {t:8.1f} us  {stage}")
            for where, k in e["syncs"].items():
                print(f"  SYNC x{k} every call: {where}")
            for where, k in e["syncs_on_a_tables_miss"].items():
                if where not in e["syncs"]:
                    print(f"  SYNC x{k} on a tables miss (first call per layout): {where}")
            if not e["syncs"]:
                print("  syncs every call: none")
    print("\n(The model steps below see each custom op whole, not the syncs inside it: those "
          "are the op rows' above; with packed documents a step's new offsets tensor is one "
          "tables miss, one sync, per step.)")  # fmt: skip
    for step, syncs in report["model step syncs"].items():
        print(f"\nmodel training step, {step}: {sum(syncs.values())} syncs")
        for where, k in syncs.items():
            print(f"  SYNC x{k}: {where}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=400, help="timed calls (median reported)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument(
        "--cuda",
        action="store_true",
        help="on the GPU, launches run: the host time of each call including Triton's own "
        "per-launch cost and the CUDA calls (the queue drained between calls)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats (CI)")
    p.add_argument(
        "--shape",
        default=",".join(map(str, SHAPE)),
        help="B,T,H,D of the op's call (default the 400M model's training shape)",
    )
    p.add_argument(
        "--sms",
        type=int,
        default=H100_SMS,
        help="on a CPU, the multiprocessor count the op sees (two-pass and segment choices)",
    )
    _settings.add_settings_arg(p)
    args = p.parse_args(argv)
    try:
        settings = _settings.parse(args.set)
        shape = tuple(int(x) for x in args.shape.split(","))
        if len(shape) != 4:
            raise ValueError(f"--shape takes B,T,H,D, got {args.shape!r}")
    except (_settings.SettingError, ValueError) as e:  # one line, not argparse's usage block
        p.exit(2, f"host_overhead: {e}\n")
    _settings.apply(settings)
    smoke = args.smoke or smoke_requested(argv)
    device = "cuda" if args.cuda else "cpu"
    if not args.cuda:
        heap_allocations()
    torch.set_num_threads(1)
    shape = SMOKE_SHAPE if smoke else shape
    report = measure(shape, 5 if smoke else args.repeats, device, args.sms)
    report["commit"] = git_commit()
    report["settings"] = settings
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    print("host_overhead: done")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
