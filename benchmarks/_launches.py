"""Which Triton kernel specializations a piece of code compiles, found without running it on a
GPU: inside :func:`intercepted` every Triton launch calls a handler instead, with the kernel and
its arguments, and the code runs on CPU tensors. The handler records the launch
(:func:`specialization`: what Triton compiles once per process and caches on disk), or compiles
it without launching (``compile_launch``: Triton's warm-up path, which fills the disk cache and
loads nothing onto the GPU).

Used by ``check_triton.py`` (``--plan``, and its compile phase: every specialization compiled
once, in parallel, before any case touches the GPU) and ``compile_cost.py`` (the compile time,
registers, spill stack and shared memory of each, for sm_90 on a CPU).
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The H100 SXM's multiprocessor count: what the forward's fused/two-pass choice
# (triton_backend._use_two_pass) sees while tracing on a CPU.
H100_SMS = 132


@dataclass(frozen=True)
class Specialization:
    """One compiled kernel: its name, constexpr values, the type of every other argument (as
    Triton specializes it: dtype and 16-byte alignment of pointers, ints equal to 1 or multiples
    of 16) and the launch options that enter the compile (warps, stages)."""

    kernel: str
    constexprs: tuple[tuple[str, Any], ...]
    args: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]

    def label(self) -> str:
        """Short and readable: the kernel, its constexprs, the dot dtype and the options."""
        consts = " ".join(f"{k}={_short(v)}" for k, v in self.constexprs)
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        dtypes = sorted({a.split(":")[0] for a in self.args if a.startswith("*")})
        return f"{self.kernel}[{consts} {opts} ptrs={','.join(dtypes)}]"


def _short(v: Any) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def _arg_type(v: Any) -> str:
    if isinstance(v, torch.Tensor):  # Triton specializes pointers on 16-byte alignment
        return f"*{str(v.dtype).removeprefix('torch.')}:{'D' if v.data_ptr() % 16 == 0 else ''}"
    if isinstance(v, bool):
        return f"i1:{int(v)}"
    if isinstance(v, int):  # == 1 and % 16 == 0 are specialized
        return "i32:1" if v == 1 else ("i32:D" if v % 16 == 0 else "i32")
    if isinstance(v, float):
        return "fp32"
    return type(v).__name__


def specialization(fn: Any, kwargs: dict[str, Any]) -> Specialization:
    """The specialization of a launch ``fn[grid](**kwargs)`` (the launchers pass keywords)."""
    names = fn.arg_names
    const = {names[i] for i in fn.constexprs}
    missing = [n for n in names if n not in kwargs and n not in const]
    # runtime ints Triton does not specialize on (jit(do_not_specialize=[...]))
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    if missing:  # a positional launch: the key would be wrong, so say so
        raise TypeError(f"{fn.__name__}: launch arguments must be keywords, missing {missing}")
    return Specialization(
        kernel=fn.__name__,
        constexprs=tuple((n, kwargs[n]) for n in names if n in const and n in kwargs),
        args=tuple(
            "i32" if n in unspecialized else _arg_type(kwargs[n]) for n in names if n not in const
        ),
        options=tuple((k, kwargs[k]) for k in sorted(kwargs) if k not in names),
    )


Handler = Callable[[Any, Callable[..., Any], dict[str, Any]], Any]


def compile_launch(fn: Any, run: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Compile (or find in the disk cache) what this launch needs, launching nothing: Triton's
    warm-up path. Returns the compiled kernel (``.asm``, ``.metadata``)."""
    return run(fn, grid=(1,), warmup=True, **kwargs)


def compile_task(key: Specialization, traced: Callable[[Handler], Any]) -> tuple[float, dict]:
    """A compile phase's task (_check_schedule.compile_phase): ``traced(handler)`` runs some code
    with its Triton launches sent to ``handler``, which compiles the first launch of
    specialization ``key`` into Triton's disk cache (nothing launched or loaded on the GPU).
    Returns the seconds and the kernel's :func:`resource_usage` (empty if ``key`` never came)."""
    found: dict[str, Any] = {}

    def handler(fn: Any, run: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        if not found and specialization(fn, kwargs) == key:
            found["kernel"] = compile_launch(fn, run, kwargs)

    start = time.perf_counter()
    traced(handler)
    return time.perf_counter() - start, resource_usage(found["kernel"]) if found else {}


@contextlib.contextmanager
def intercepted(handler: Handler, sms: int = H100_SMS) -> Iterator[None]:
    """Within: every Triton launch calls ``handler(fn, run, kwargs)`` instead of running (``run``
    is Triton's own, for :func:`compile_launch`); the Triton backend counts as available on a
    CPU, so the public op reaches the launchers with CPU tensors; and the forward's two-pass
    choice sees a GPU of ``sms`` multiprocessors. Outputs are left unwritten (garbage)."""
    from triton.runtime.jit import JITFunction

    from deltaflow.ops import triton_backend

    real_run = JITFunction.run
    real_available = triton_backend.available
    real_props = torch.cuda.get_device_properties

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if args:
            raise TypeError(f"{self.__name__}: intercepted launches must pass keywords only")
        return handler(self, real_run, kwargs)

    JITFunction.run = run
    triton_backend.available = lambda: True

    def props(device: Any = None, *a: Any, **k: Any) -> Any:
        # The traced op asks about its CPU tensors' device; torch itself (initialising CUDA in a
        # compile process on a GPU machine) asks about real devices: those get real answers.
        on_cpu = isinstance(device, torch.device) and device.type == "cpu"
        if on_cpu or not torch.cuda.is_available():
            return types.SimpleNamespace(multi_processor_count=sms)
        return real_props(device, *a, **k)

    torch.cuda.get_device_properties = props
    try:
        yield
    finally:
        JITFunction.run = real_run
        triton_backend.available = real_available
        torch.cuda.get_device_properties = real_props


def record(call: Callable[[], Any], sms: int = H100_SMS) -> list[Specialization]:
    """The specializations ``call()`` launches, in first-launch order, each once."""
    seen: dict[Specialization, None] = {}

    def handler(fn: Any, run: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        seen.setdefault(specialization(fn, kwargs), None)

    with intercepted(handler, sms):
        call()
    return list(seen)


def resource_usage(kernel: Any) -> dict[str, int]:
    """Registers per thread (REG), spill stack per thread in bytes (STACK: the local memory the
    driver reserves for every resident thread of the GPU while the kernel's module is loaded),
    and shared memory in bytes (dynamic, as launched), read from the cubin with the cuobjdump
    that ships with Triton's NVIDIA backend. Empty where that tool is missing."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() or "cubin" not in kernel.asm:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, timeout=60
        ).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK):(\d+)", out)}
    usage["SHARED"] = int(getattr(kernel.metadata, "shared", 0))
    return usage
