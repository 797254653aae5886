"""One profiled training step (``benchmarks/model_training.py``): device time per module kind
(forward ranges of eager models) and the top ops / kernels by self time."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

# Block children of both models mapped to one vocabulary (deltaflow name | fla name).
_ROLES = {"mixer_norm": "norm", "attn_norm": "norm", "mlp_norm": "norm", "mixer": "mixer"}
_ROLES.update({"attn": "mixer", "mlp": "mlp"})


def module_labels(model: nn.Module) -> dict[str, nn.Module]:
    """``label -> module`` for the forward ranges of the profile; layers share one label."""
    labels: dict[str, list[nn.Module]] = {}
    for name, module in model.named_modules():
        m = re.fullmatch(r"model\.layers\.\d+\.(\w+)", name)
        if m and m.group(1) in _ROLES:
            label = f"fwd/{_ROLES[m.group(1)]}"
        elif name in ("model.embed_tokens", "model.embeddings"):
            label = "fwd/embedding"
        elif name == "model.norm":
            label = "fwd/final_norm"
        elif name == "model":
            label = "fwd/backbone (total - backbone = head + loss)"
        else:
            continue
        labels.setdefault(label, []).append(module)
    return labels  # type: ignore[return-value]


@contextlib.contextmanager
def labelled_forward(model: nn.Module) -> Iterator[None]:
    """Wrap each labelled module's forward in a profiler ``record_function`` range."""
    handles, stack = [], []

    def pre(label: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for label, modules in module_labels(model).items():
        for module in modules:
            handles.append(module.register_forward_pre_hook(pre(label)))
            handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _device_time_us(event: Any, self_only: bool) -> float:
    """Device (CUDA) time of a profiler event, across torch versions (names changed in 2.4)."""
    names = (
        ("self_device_time_total", "self_cuda_time_total")
        if self_only
        else ("device_time_total", "cuda_time_total")
    )
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(
    step: Callable[[], None], model: nn.Module, device: torch.device, top: int
) -> dict[str, Any]:
    """One profiled training step: per-label times and the top-N op/kernel table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Module hooks inside a compiled block would break its graph: label eager models only.
    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    labels = contextlib.nullcontext() if compiled else labelled_forward(model)
    with torch.profiler.profile(activities=activities) as prof:
        with labels:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = device.type == "cuda"
    ranges = {}
    for e in events:
        if e.key.startswith(("fwd/", "step/")):
            ms = (_device_time_us(e, False) if cuda else e.cpu_time_total) / 1e3
            ranges[e.key] = {"ms": ms, "calls": e.count}
    sort_keys = (
        ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    )
    table = ""
    for key in sort_keys:
        try:
            table = events.table(sort_by=key, row_limit=top, max_name_column_width=70)
            break
        except Exception:  # noqa: BLE001 - the sort key was renamed across torch versions
            continue
    kernels = sorted(
        (
            {
                "name": e.key,
                "self_ms": (_device_time_us(e, True) if cuda else e.self_cpu_time_total) / 1e3,
                "calls": e.count,
            }
            for e in events
            if not e.key.startswith(("fwd/", "step/"))
        ),
        key=lambda r: -r["self_ms"],
    )[:top]
    result = {"ranges": ranges, "top": kernels, "table": table}
    if cuda:
        result["gpu_time"] = gpu_time(_kernel_intervals(prof))
        table += "\n" + describe_gpu_time(result["gpu_time"])
        result["table"] = table
    return result


def _kernel_intervals(prof: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel / memcpy / memset the profile saw."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return out


def gpu_time(intervals: list[tuple[float, float, str]], gaps: int = 12) -> dict[str, Any]:
    """Where the device was idle in one profiled step: span (first kernel start to last end),
    busy (the union of kernel intervals), idle = span - busy, and the largest gaps with the
    kernels on either side (a gap is the GPU waiting for the host: launch overhead, a sync, a
    Python loop). Under the profiler the host is slower, so idle is an upper bound."""
    if not intervals:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    intervals = sorted(intervals)
    busy, holes = 0.0, []
    cur_start, cur_end, cur_name = intervals[0]
    for start, end, name in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            holes.append(((start - cur_end) / 1e3, cur_name, name))
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
        if end >= cur_end:
            cur_name = name
    busy += cur_end - cur_start
    span = intervals[-1][1] - intervals[0][0]
    span = max(span, max(e for _, e, _ in intervals) - intervals[0][0])
    holes.sort(key=lambda h: -h[0])
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "n_gaps": len(holes),
        "gaps_over_20us_ms": sum(h[0] for h in holes if h[0] > 0.02),
        "gaps": [
            {"ms": round(ms, 3), "after": a[:90], "before": b[:90]} for ms, a, b in holes[:gaps]
        ],
    }


def describe_gpu_time(t: dict[str, Any]) -> str:
    lines = [
        f"GPU: span {t['span_ms']:.2f} ms, busy {t['busy_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms "
        f"in {t.get('n_gaps', 0)} gaps ({t.get('gaps_over_20us_ms', 0.0):.2f} ms in gaps > 20 us)"
    ]
    lines += [f"  gap {g['ms']:.3f} ms after {g['after']} before {g['before']}" for g in t["gaps"]]
    return "\n".join(lines)
