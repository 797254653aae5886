"""Out-of-bounds accesses of Triton kernels run on the CPU interpreter, which does not check them
itself (a GPU reports them as "illegal memory access", or not at all). :func:`checked_accesses`
records, for every launch inside it, each load or store of an address (with its mask true) that
lies outside every tensor argument of that launch (each argument's own extent: a view's
elements, not its whole storage)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Access:
    kernel: str
    op: str  # "load" | "store"
    count: int  # out-of-bounds elements in this access
    nearest: str  # the argument whose extent the first bad address is nearest
    offset: int  # that address minus the argument's start, in bytes


@dataclass
class Report:
    bad: list[Access] = field(default_factory=list)

    def kernels(self) -> set[str]:
        return {a.kernel for a in self.bad}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of a tensor view's elements."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextlib.contextmanager
def checked_accesses():
    """Yield a :class:`Report` that fills with every out-of-bounds load or store of the
    interpreted launches made inside the block."""
    from triton.runtime import interpreter as itp

    report = Report()
    state: dict = {"kernel": None, "ranges": []}
    builder = type(itp.interpreter_builder)
    executor_call = itp.GridExecutor.__call__
    masked_load = builder.create_masked_load
    masked_store = builder.create_masked_store

    def call(self, *args, **kwargs):
        ranges = []
        for name, arg in list(zip(self.arg_names, args)) + list(kwargs.items()):
            if isinstance(arg, torch.Tensor):
                ranges.append((name, *_extent(arg)))
        state["kernel"], state["ranges"] = self.fn.__name__, ranges
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            state["kernel"], state["ranges"] = None, []

    def check(op, ptrs, mask):
        if state["kernel"] is None:
            return
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        addr = addr[on].astype(np.int64)
        if addr.size == 0:
            return
        size = np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addr.shape, dtype=bool)
        for _, start, end in state["ranges"]:
            inside |= (addr >= start) & (addr + size <= end)
        if inside.all():
            return
        first = int(addr[~inside][0])
        name, start, end = min(
            state["ranges"], key=lambda r: min(abs(first - r[1]), abs(first - r[2]))
        )
        report.bad.append(Access(state["kernel"], op, int((~inside).sum()), name, first - start))

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        check("load", ptrs, mask)
        return masked_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        check("store", ptrs, mask)
        return masked_store(self, ptrs, value, mask, cache_policy)

    itp.GridExecutor.__call__ = call
    builder.create_masked_load = load
    builder.create_masked_store = store
    try:
        yield report
    finally:
        itp.GridExecutor.__call__ = executor_call
        builder.create_masked_load = masked_load
        builder.create_masked_store = masked_store
