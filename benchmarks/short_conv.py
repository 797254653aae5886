"""The Triton short conv (issue 31 item 4, ``deltaflow/layers/short_conv_triton.py``) alone, at
the training step's shape: x = the q|k|v columns (C) of the fused projection's output (N wide),
bf16, kernel size 4, SiLU.

    python benchmarks/short_conv.py time [--shape 8x2048x3072x4112] [--smoke] [--sweep]
    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/short_conv.py cost [--arch 90]

``time`` (GPU; ``--smoke``: tiny, on the CPU interpreter): forward and forward + backward of the
Triton kernels and of the tap sum compiled by torch.compile (what the layer runs with the switch
off), median ms, and the bytes floor of each at the measured copy bandwidth; plus the kernels'
error against the float32 tap sum. ``--sweep``: then every launch setting of ``SWEEP_FWD`` and
``SWEEP_BWD`` (the module constants of short_conv_triton.py), each checked against the tap sum
and timed, fastest first. ``cost`` (CPU, no GPU needed): every kernel specialization
the training step launches (plain and packed, bf16 and float32 weight), compiled for sm_90 by
the Triton first on the path (the GPU machine's: its ptxas is what compiles), with compile
seconds, registers, spill stack and shared memory (launches traced by ``_launches.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _common import bench_ms, copy_bandwidth, git_commit, smoke_env, smoke_requested

if sys.argv[1:2] == ["cost"]:  # compiling, not interpreting, into a fresh cache
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="short_conv_cost_"))
    os.environ.pop("TRITON_INTERPRET", None)
elif smoke_requested():
    smoke_env()

import torch  # noqa: E402

from deltaflow.layers import short_conv_triton as sct  # noqa: E402
from deltaflow.layers.conv import causal_conv_taps  # noqa: E402


def parse_shape(text: str) -> tuple[int, int, int, int]:
    dims = tuple(int(v) for v in text.lower().split("x"))
    if len(dims) != 4 or min(dims) < 1 or dims[2] > dims[3]:
        raise SystemExit(f"error: --shape takes BxTxCxN with positive sizes, C <= N, got {text!r}")
    return dims  # type: ignore[return-value]


def run_time(shape: tuple[int, int, int, int], smoke: bool, sweep: bool = False) -> None:
    B, T, C, N = shape
    dev = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter's bf16 is not trusted
    g = torch.Generator(device=dev).manual_seed(0)
    wide = torch.randn(B, T, N, device=dev, generator=g).to(dtype)
    x = wide[..., :C]  # read in place, as the layer does
    w = (0.5 * torch.randn(C, 4, device=dev, generator=g)).to(dtype)
    dy = torch.randn(B, T, C, device=dev, generator=g).to(dtype)
    taps = torch.compile(causal_conv_taps, backend="aot_eager" if smoke else "inductor")
    ref = causal_conv_taps(x.float(), w.float())
    err = ((sct.short_conv(x, w).float() - ref).norm() / ref.norm()).item()
    print(f"short_conv: {B}x{T}x{C} of {N} {str(dtype)[6:]}, commit {git_commit()}")
    print(f"triton vs float32 tap sum: relative error {err:.2e}")
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

    element = B * T * C * x.element_size()
    floor = {"forward": 2 * element, "forward + backward": 5 * element}  # x, y | x, dy, dx
    bandwidth = copy_bandwidth(dev)
    for what, cases in (
        ("forward", {"triton": lambda: sct.short_conv(x, w), "tap sum": lambda: taps(x, w)}),
        ("forward + backward", {"triton": fwd_bwd(sct.short_conv), "tap sum": fwd_bwd(taps)}),
    ):
        floor_ms = floor[what] / bandwidth * 1e3
        for name, fn in cases.items():
            fn()  # compile / warm
            ms = bench_ms(fn, dev)
            print(f"{what:>18} {name:>8}: {ms:8.3f} ms  ({ms / floor_ms:.2f}x the bytes floor "
                  f"{floor_ms:.3f} ms)")  # fmt: skip
    if sweep:
        run_sweep(x, w, dy, smoke)
    print("short_conv: done")


# The launch settings a sweep sets (short_conv_triton.py's constants) and their values
FWD_NAMES = ("FWD_BT", "FWD_BC", "FWD_WARPS")
BWD_NAMES = ("BWD_BT", "BWD_BC", "BWD_WARPS", "BWD_TILES")
SWEEP_FWD = [(32, 128, 8), (32, 64, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4),
             (128, 64, 8), (16, 128, 4)]  # fmt: skip
# tiles of 1k-4k elements, 1 or 8 row tiles a program
SWEEP_BWD = [
    (bt, bc, warps, tiles)
    for bt, bc in ((16, 64), (16, 128), (32, 32), (32, 64), (32, 128), (64, 32), (64, 64))
    for warps in (4, 8)
    for tiles in (1, 8)
]


def run_sweep(x, w, dy, smoke: bool) -> None:
    """Each launch setting: the max relative error of y, dx, dw against the float32 tap sum, and
    the median ms of the forward (forward settings) or forward + backward (backward settings)."""
    dev = x.device.type
    xr, wr = x.float().detach().requires_grad_(), w.float().detach().requires_grad_()
    yr = causal_conv_taps(xr, wr)
    ref = [yr.detach(), *torch.autograd.grad(yr, (xr, wr), dy.float())]
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def check() -> float:
        y = sct.short_conv(xg, wg)
        got = [y.detach(), *torch.autograd.grad(y, (xg, wg), dy)]
        return max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, ref))

    saved = {k: getattr(sct, k) for k in FWD_NAMES + BWD_NAMES}
    rows = []
    fwd_bwd = lambda: torch.autograd.grad(sct.short_conv(xg, wg), (xg, wg), dy)  # noqa: E731
    for names, settings, fn in (
        (FWD_NAMES, SWEEP_FWD[: 2 if smoke else None], lambda: sct.short_conv(x, w)),
        (BWD_NAMES, SWEEP_BWD[:: 7 if smoke else 1], fwd_bwd),
    ):  # fmt: skip
        for values in settings:
            for k, v in saved.items():
                setattr(sct, k, v)
            for k, v in zip(names, values):
                setattr(sct, k, v)
            try:
                err = check()
                ms = bench_ms(fn, dev)
            except Exception as e:  # noqa: BLE001 - out of resources: reported, next setting
                rows.append((float("inf"), names[0][:3], values, f"failed: {str(e)[:60]}"))
                continue
            rows.append((ms, names[0][:3], values, f"error {err:.1e}"))
    for k, v in saved.items():
        setattr(sct, k, v)
    best = []
    for what, timed, names in (
        ("FWD", "forward", FWD_NAMES),
        ("BWD", "forward + backward", BWD_NAMES),
    ):
        print(f"sweep {what} ({timed}, fastest first):")
        ranked = sorted(r for r in rows if r[1] == what)
        for ms, _, values, note in ranked:
            print(f"  {values}: {ms:8.3f} ms  {note}")
        if ranked and ranked[0][0] < float("inf"):
            best += [f"short_conv_triton.{k}={int(v)}" for k, v in zip(names, ranked[0][2])]
    # MODULE.NAME=V items for model_training.py --set (issue31_call.sh passes them on)
    print(f"best launch: {','.join(best)}")


def run_cost(arch: int) -> None:
    import compile_cost
    from _launches import compile_launch, intercepted, resource_usage, specialization

    compile_cost._init(arch)
    seen: set = set()

    def handler(fn, run, kwargs) -> None:
        key = specialization(fn, kwargs)
        if key in seen:
            return
        seen.add(key)
        t0 = time.perf_counter()
        usage = resource_usage(compile_launch(fn, run, kwargs))
        flags = {k: v for k, v in key.constexprs if k in ("VARLEN", "HAS_STATE")}
        ptrs = sorted({a.split(":")[0] for a in key.args if a.startswith("*")})
        print(f"{key.kernel} {flags} ptrs={','.join(ptrs)} seconds={time.perf_counter() - t0:.1f}",
              " ".join(f"{k}={v}" for k, v in usage.items()), flush=True)  # fmt: skip

    B, T, C, N = 8, 2048, 3072, 4112  # the 400M model's step (benchmarks/NOTES.md)
    x = torch.empty(B, T, N, dtype=torch.bfloat16)[..., :C]
    packed = torch.empty(1, B * T, N, dtype=torch.bfloat16)[..., :C]
    cu = torch.tensor([0, 100, B * T])
    with intercepted(handler):
        for w_dtype in (torch.float32, torch.bfloat16):  # autocast / pure bf16 training
            w = torch.empty(C, 4, dtype=w_dtype)
            for xb, cu_seqlens in ((x, None), (packed, cu)):
                dy = torch.empty(xb.shape, dtype=xb.dtype)
                sct._forward(xb, w, None, cu_seqlens, True)
                sct._backward(xb, w, None, cu_seqlens, dy, True)
    print("short_conv: done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["time", "cost"])
    parser.add_argument("--shape", default=None, help="BxTxCxN (default 8x2048x3072x4112)")
    parser.add_argument("--arch", type=int, default=90, help="cost: the target sm_XX")
    parser.add_argument("--smoke", action="store_true", help="time: tiny, CPU interpreter")
    parser.add_argument("--sweep", action="store_true", help="time: every launch setting too")
    args = parser.parse_args(argv)
    if args.mode == "cost":
        run_cost(args.arch)
        return 0
    default = "2x40x24x31" if args.smoke else "8x2048x3072x4112"
    run_time(parse_shape(args.shape or default), args.smoke, args.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
