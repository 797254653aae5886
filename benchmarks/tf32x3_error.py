"""What fp32 operands on the tensor cores as ``tf32x3`` would cost the fp32 Triton backend in
accuracy, measured on a CPU: the chunked algorithm (the torch backend at the Triton chunk length,
forward and backward) in float32 with every matrix product emulated as Triton's tf32x3 dot, against
float64, beside the same with exact float32 products (what ``"ieee"`` computes) and with one tf32
product (``"tf32"``, for scale).

    python benchmarks/tf32x3_error.py            # check_triton's fp32 shapes, a few rules
    python benchmarks/tf32x3_error.py --smoke    # one small shape (CI)

tf32x3 (Triton's lowering): x = big + small with big = tf32(x), small = tf32(x − big) (tf32:
10 mantissa bits, rounded to nearest, ties away), and x·y ≈ big·small' + small·big' + big·big',
each product exact in fp32 and accumulated in fp32: only small·small' (~2^-22 relative) and the
rounding of small are lost. The Triton interpreter ignores ``input_precision``, so the CPU tests
cannot see this; this script can.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import smoke_requested  # noqa: F401  (puts the checkout on the path)
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
TOL_FP32 = 1e-4  # check_triton's fp32 tolerance


def tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to tf32 (10 mantissa bits), to nearest with ties away from zero (the
    sign-magnitude bit pattern: adding half an ulp to the magnitude rounds away)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "tf32":
        return tf32(a) @ tf32(b)
    a_big, b_big = tf32(a), tf32(b)
    a_small, b_small = tf32(a - a_big), tf32(b - b_big)
    return a_big @ b_small + a_small @ b_big + a_big @ b_big


class Products(TorchDispatchMode):
    """Every float32 mm/bmm/addmm/baddbmm (forward and backward, in place and out= forms) as
    ``mode`` ('tf32x3' or 'tf32') computes it."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten.mm, aten.bmm) and args[0].dtype == torch.float32:
            result = product(args[0], args[1], self.mode)
            if "out" in kwargs:
                return kwargs["out"].copy_(result)
            return result
        add = {aten.addmm: aten.addmm, aten.addmm_: aten.addmm, aten.baddbmm: aten.baddbmm}
        add[aten.baddbmm_] = aten.baddbmm
        if packet in add and args[0].dtype == torch.float32:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            result = beta * args[0] + alpha * product(args[1], args[2], self.mode)
            if packet in (aten.addmm_, aten.baddbmm_):
                return args[0].copy_(result)
            if "out" in kwargs:
                return kwargs["out"].copy_(result)
            return result
        return func(*args, **kwargs)


def errors(B, T, Dk, Dv, rule, ne, cu_lengths=None) -> dict[str, float]:
    """Worst ‖Δ‖/‖ref‖ over o, the state and the six gradients, per product mode."""
    import _check_cases as ct

    cu = None
    if cu_lengths is not None:
        T = sum(cu_lengths)
        cu = torch.tensor([0] + cu_lengths).cumsum(0)
    x = ct.make(B, T, Dk, Dv, rule, torch.float32, "cpu", None if cu is None else len(cu_lengths))
    kw = dict(rule=rule, negative_eigenvalues=ne, cu_seqlens=cu, chunk_size=64)
    ref = ct.run(x, "torch", dtype=torch.float64, grad_dtype=torch.float32, **kw)
    worst = {}
    for mode in ("ieee", "tf32x3", "tf32"):
        if mode == "ieee":
            got = ct.run(x, "torch", grad_dtype=torch.float32, **kw)
        else:
            with Products(mode):
                got = ct.run(x, "torch", grad_dtype=torch.float32, **kw)
        errs = [ct.rel(got[0], ref[0]), ct.rel(got[1], ref[1])]
        errs += [ct.rel(got[2][n], ref[2][n]) for n in ct.NAMES]
        worst[mode] = max(errs)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small shape")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.smoke:
        cases = [("T=65", 1, 65, 32, 16, None, "efla", True)]
    else:
        cases = [
            ("T=65", 2, 65, 128, 64, None, rule, ne)
            for rule, ne in (("delta", True), ("efla", False), ("kaczmarz", True))
        ]
        cases += [
            ("T=1000 Dk=100 Dv=72", 1, 1000, 100, 72, None, "efla", True),
            ("varlen", 1, None, 64, 128, [0, 1, 63, 64, 65, 1000, 0, 300], "delta", True),
            ("T=200 Dk=Dv=256", 1, 200, 256, 256, None, "delta", False),
        ]
    print("| shape | rule | neg. eig. | fp32 exact (ieee) | tf32x3 | tf32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for label, B, T, Dk, Dv, lengths, rule, ne in cases:
        e = errors(B, T, Dk, Dv, rule, ne, lengths)
        worst = max(worst, e["tf32x3"])
        print(
            f"| {label} | {rule} | {ne} | {e['ieee']:.1e} | {e['tf32x3']:.1e} | {e['tf32']:.1e} |",
            flush=True,
        )
    verdict = "within" if worst <= TOL_FP32 else "OVER"
    print(f"tf32x3: worst {worst:.1e}, {verdict} the fp32 tolerance {TOL_FP32:.0e}")
    return 0 if worst <= TOL_FP32 else 1


if __name__ == "__main__":
    sys.exit(main())
