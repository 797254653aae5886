"""A bounds-checking Triton interpreter for tests: inside :func:`checked`, every address a
kernel loads or stores under its mask must lie inside one of the storages passed to that launch.

The interpreter reads and writes host memory through raw pointers, so an out-of-bounds access
there returns garbage or lands in a neighbour silently, where a GPU faults (an illegal memory
access that poisons the process). This turns it into a recorded hit. It patches three internals
of ``triton.runtime.interpreter``; :func:`available` says whether this Triton has them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

try:
    from triton.runtime import interpreter as _interp
except ImportError:  # pragma: no cover - no Triton
    _interp = None

_NAMES = ("GridExecutor._init_args_hst", "InterpreterBuilder.create_masked_load",
          "InterpreterBuilder.create_masked_store")  # fmt: skip


def available() -> bool:
    """Whether this Triton's interpreter has the internals :func:`checked` patches."""
    if _interp is None or not hasattr(_interp, "_get_np_dtype"):
        return False
    return all(hasattr(getattr(_interp, c, None), m) for c, m in (n.split(".") for n in _NAMES))


@contextlib.contextmanager
def checked() -> Iterator[list[tuple[str, str, int]]]:
    """Yields the list of hits, (kernel, "load" | "store", addresses out of bounds), filled as
    launches run; the interpreter is restored on exit."""
    hits: list[tuple[str, str, int]] = []
    ranges: list[tuple[int, int]] = []
    kernel = [""]
    Grid, Builder = _interp.GridExecutor, _interp.InterpreterBuilder
    init, load, store = Grid._init_args_hst, Builder.create_masked_load, Builder.create_masked_store

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        ranges.clear()
        kernel[0] = self.fn.__name__
        for arg in [*args_hst, *kwargs_hst.values()]:
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        p = ptrs.data[mask.data.astype(bool)]
        if p.size:
            size = np.dtype(_interp._get_np_dtype(ptrs.get_element_ty())).itemsize
            inside = np.zeros(p.shape, dtype=bool)
            for lo, hi in ranges:
                inside |= (p >= lo) & (p + size <= hi)
            if not inside.all():
                hits.append((kernel[0], what, int((~inside).sum())))

    def checked_load(self, ptrs, mask, other, *args):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    Grid._init_args_hst = init_args
    Builder.create_masked_load, Builder.create_masked_store = checked_load, checked_store
    try:
        yield hits
    finally:
        Grid._init_args_hst = init
        Builder.create_masked_load, Builder.create_masked_store = load, store
