"""What the tests of narrow heads share (tests/test_half_blocks.py, tests/test_narrow_heads.py):
the Triton op's forward and backward at one small shape, its float64 reference, and the
kernels' launches recorded (name and keyword arguments) by replacing each kernel of a launcher
module with a spy."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from _inputs import make_inputs
from torch import Tensor

from deltaflow import delta_rule
from deltaflow.rules import RULES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
# what run_op and reference return, in order
RESULTS = ["o", "o other forward", "state", *NAMES]


class _Spy:
    """A kernel whose launches are recorded (name, keyword arguments) and then run, or not."""

    def __init__(self, name: str, kernel, seen: list, run: bool) -> None:
        self.name, self.kernel, self.seen, self.run = name, kernel, seen, run

    def __getitem__(self, grid):
        def launch(**kw):
            self.seen.append((self.name, kw))
            return self.kernel[grid](**kw) if self.run else None

        return launch


def record_launches(
    monkeypatch: pytest.MonkeyPatch, kernels: dict[ModuleType, list[str]], *, run: bool = True
) -> list[tuple[str, dict]]:
    """Every launch of the named kernels of each module from now on (the launchers read their
    kernel from the module at each call), in order; ``run`` False launches nothing (the
    outputs stay as allocated: for tests of what is launched, not of its results)."""
    seen: list[tuple[str, dict]] = []
    for module, names in kernels.items():
        for name in names:
            monkeypatch.setattr(module, name, _Spy(name, getattr(module, name), seen, run))
    return seen


def op_inputs(
    dtype: torch.dtype,
    Dk: int,
    Dv: int,
    *,
    rule: str = "delta",
    T: int = 70,
    seed: int = 3,
    state_dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor | None]:
    """Leaves of one sequence of T tokens, 2 heads: q, k, v in ``dtype``, the initial state in
    ``state_dtype``, β and log α in float32 (β None for a rule that takes none)."""
    x = make_inputs(1, T, 2, Dk, Dv, rule=rule, dtype=torch.float32, seed=seed)
    dtypes = {"q": dtype, "k": dtype, "v": dtype, "initial_state": state_dtype}
    leaves = {
        n: t.to(DEVICE, dtypes.get(n, torch.float32)).detach().requires_grad_()
        for n, t in x.items()
    }
    if not RULES[rule].needs_beta:
        leaves["beta"] = None
    return leaves


def _forward_backward(
    leaves: dict[str, Tensor | None], backend: str, out_dtype: torch.dtype, **options
) -> list:
    """Output, final state and every gradient of a loss linear in both, with fixed weights: the
    output's rounded to ``out_dtype`` (the op's output dtype), so that the output's gradient is
    the same exact tensor for the kernels and for the float64 reference."""
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **options)
    g = torch.Generator().manual_seed(0)
    w_o = torch.randn(o.shape, generator=g).to(out_dtype).to(o.device, torch.float64)
    w_s = torch.randn(s.shape, generator=g).to(s.device, torch.float64)  # fp32 values
    ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
    return [o, s, *(None if leaves[n] is None else leaves[n].grad for n in NAMES)]


def run_op(
    leaves: dict[str, Tensor | None],
    *,
    forward: str = "fused",
    other_forward: str = "two_pass",
    **options,
) -> list[Tensor | None]:
    """The Triton op's output (its ``forward``: triton_backend.FORWARD_MODE), the output of its
    ``other_forward`` ("two_pass" or "fused"; without gradients), its final state and every
    gradient (None where there is no input), in :data:`RESULTS`' order. Both forms pinned, not
    "auto": at these few programs a GPU's "auto" is the two-pass form, the interpreter's the
    fused one (session 18, call 3: a launch-set assertion failed on the H100 only)."""
    from deltaflow.ops import triton_backend

    triton_backend.FORWARD_MODE = forward
    try:
        o, s, *grads = _forward_backward(leaves, "triton", leaves["v"].dtype, **options)
        triton_backend.FORWARD_MODE = other_forward
        with torch.no_grad():
            detached = {n: None if t is None else t.detach() for n, t in leaves.items()}
            o2 = delta_rule(**detached, backend="triton", **options)[0]
    finally:
        triton_backend.FORWARD_MODE = "auto"
    return [o, o2, s, *grads]


def reference(leaves: dict[str, Tensor | None], **options) -> list[Tensor | None]:
    """:func:`run_op`'s results from the float64 token-by-token reference on the same (rounded)
    inputs, on the CPU (the output twice)."""
    double = {
        n: None if t is None else t.detach().cpu().double().requires_grad_()
        for n, t in leaves.items()
    }
    o, s, *grads = _forward_backward(double, "reference", leaves["v"].dtype, **options)
    return [o, o, s, *grads]
