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
    return {"ranges": ranges, "top": kernels, "table": table}
