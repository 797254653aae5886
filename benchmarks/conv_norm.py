"""The conv + SiLU + per-head L2 norm Triton op (issue 31, ``deltaflow/layers/conv_norm_triton.py``)
alone, at the training step's shape: x = the q|k|v columns (C) of the fused projection's output
(N wide), bf16, kernel size 4, SiLU, then L2 norms over the q and k heads (the first ``2 H D``
channels, groups of D = 128), v left as is.

    python benchmarks/conv_norm.py time [--shape 8x2048x3072x4112] [--head-dim 128] [--smoke]
        [--sweep]
    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/conv_norm.py cost [--arch 90]

``time`` (GPU; ``--smoke``: tiny, on the CPU interpreter): forward and forward + backward of the
Triton op and of the torch path it replaces (causal_conv_taps + SiLU + l2_normalize on the q|k
groups, compiled by torch.compile: what the compiled layer runs with the switch off), median ms,
and each one's ratio to the bytes floor (forward: read x, write y; forward + backward: that and
read x, dy, write dx) at the measured copy bandwidth; plus the op's error against the float32
reference. ``--sweep``: then the launch settings of ``SWEEPS`` (the module
constants of conv_norm_triton.py), each checked and timed, fastest first. ``cost`` (CPU, no GPU
needed): every kernel specialization the training step launches (plain and packed, bf16 and
float32 weight) at the current launch settings, compiled for sm_90 by the Triton first on the
path, with registers, spill stack and shared memory (as ``short_conv.py cost``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _common import bench_ms, copy_bandwidth, git_commit, smoke_env, smoke_requested

if sys.argv[1:2] == ["cost"]:  # compiling, not interpreting, into a fresh cache
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="conv_norm_cost_"))
    os.environ.pop("TRITON_INTERPRET", None)
elif smoke_requested():
    smoke_env()

import torch  # noqa: E402

from deltaflow.layers import conv_norm_triton as cn  # noqa: E402

# The launch settings a sweep sets (conv_norm_triton.py's constants) and their values: the
# forward's and the backward's dz kernel take one head group of channels a program, the dx
# kernel any channel block. Each group is swept with the groups before it at their fastest.
SWEEPS = {
    ("FWD_BT", "FWD_WARPS"): [(8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)],
    ("BWD_BT", "BWD_WARPS", "BWD_TILES"): [
        (16, 4, 1),
        (64, 8, 1),
        (16, 4, 8),
        (16, 8, 8),
        (32, 8, 4),
        (32, 4, 4),
        (8, 4, 16),
        (64, 8, 2),
    ],  # fmt: skip
    ("DX_BT", "DX_BC", "DX_WARPS"): [
        (16, 128, 4),
        (32, 128, 4),
        (32, 64, 4),
        (64, 64, 4),
        (64, 128, 8),
        (32, 256, 8),
    ],  # fmt: skip
}


def parse_shape(text: str) -> tuple[int, int, int, int]:
    dims = tuple(int(v) for v in text.lower().split("x"))
    if len(dims) != 4 or min(dims) < 1 or dims[2] > dims[3]:
        raise SystemExit(f"error: --shape takes BxTxCxN with positive sizes, C <= N, got {text!r}")
    return dims  # type: ignore[return-value]


def run_time(shape: tuple[int, int, int, int], D: int, smoke: bool, sweep: bool) -> None:
    B, T, C, N = shape
    # q|k|v of equal widths: the first two thirds are q and k, normalized per head
    begin, end = 0, (2 * C // 3) // D * D
    dev = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter's bf16 is not trusted
    g = torch.Generator(device=dev).manual_seed(0)
    wide = torch.randn(B, T, N, device=dev, generator=g).to(dtype)
    x = wide[..., :C]  # read in place, as the layer does
    w = (0.5 * torch.randn(C, 4, device=dev, generator=g)).to(dtype)
    dy = torch.randn(B, T, C, device=dev, generator=g).to(dtype)
    args = dict(head_dim=D, norm_begin=begin, norm_end=end)

    def triton_op(x, w):
        return cn.conv_silu_l2(x, w, **args)

    compiled = torch.compile(
        lambda x, w: cn.reference(x, w, **args), backend="aot_eager" if smoke else "inductor"
    )
    ref = cn.reference(x.float(), w.float(), **args)
    err = ((triton_op(x, w).float() - ref).norm() / ref.norm()).item()
    print(f"conv_norm: {B}x{T}x{C} of {N} {str(dtype)[6:]}, head_dim {D}, L2 norm on channels "
          f"[{begin}, {end}), commit {git_commit()}")  # fmt: skip
    print(f"triton vs float32 reference: relative error {err:.2e}")
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

    element = B * T * C * x.element_size()
    floor = {"forward": 2 * element, "forward + backward": 5 * element}  # x, y | x, dy, dx
    bandwidth = copy_bandwidth(dev)
    for what, cases in (
        ("forward", {"triton": lambda: triton_op(x, w), "compiled": lambda: compiled(x, w)}),
        ("forward + backward", {"triton": fwd_bwd(triton_op), "compiled": fwd_bwd(compiled)}),
    ):
        floor_ms = floor[what] / bandwidth * 1e3
        for name, fn in cases.items():
            fn()  # compile / warm
            ms = bench_ms(fn, dev)
            print(f"{what:>18} {name:>8}: {ms:8.3f} ms  ({ms / floor_ms:.2f}x the bytes floor "
                  f"{floor_ms:.3f} ms)")  # fmt: skip
    # the backward's kernels alone, replayed from a CUDA graph (the GPU's time: the forward +
    # backward above goes through autograd, whose host work is as long as these kernels)
    floor_ms = 3 * element / bandwidth * 1e3  # read x, dy, write dx
    ms = bench_ms(lambda: backward_kernels(x, w, dy, args), dev, graph=True)
    print(f"{'backward kernels':>18} {'triton':>8}: {ms:8.3f} ms  ({ms / floor_ms:.2f}x the bytes "
          f"floor {floor_ms:.3f} ms; CUDA graph)")  # fmt: skip
    if sweep:
        run_sweep(x, w, dy, args, smoke)
    print("conv_norm: done")


def backward_kernels(x, w, dy, args: dict):
    """The op's backward launches without autograd (dz + dw partials, dx, the partials' sum)."""
    return cn._backward(x, w, None, dy, args["head_dim"], args["norm_begin"], args["norm_end"],
                        1e-6)  # fmt: skip


def run_sweep(x, w, dy, args: dict, smoke: bool) -> None:
    """Each launch setting: the max relative error of y, dx, dw against the float32 reference,
    and the median ms of the forward (forward settings) or forward + backward (backward)."""
    dev = x.device.type
    xr, wr = x.float().detach().requires_grad_(), w.float().detach().requires_grad_()
    yr = cn.reference(xr, wr, **args)
    ref = [yr.detach(), *torch.autograd.grad(yr, (xr, wr), dy.float())]
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def check() -> float:
        y = cn.conv_silu_l2(xg, wg, **args)
        got = [y.detach(), *torch.autograd.grad(y, (xg, wg), dy)]
        return max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, ref))

    original = {k: getattr(cn, k) for keys in SWEEPS for k in keys}
    saved = dict(original)  # each group swept with the groups before it at their fastest

    best = []
    for keys, settings in SWEEPS.items():
        forward = keys[0] == "FWD_BT"
        # the backward's settings by its kernels' GPU time alone (CUDA graph: see bench_ms)
        rows = []
        for values in settings[: 2 if smoke else None]:
            for k, v in saved.items():
                setattr(cn, k, v)
            for k, v in zip(keys, values):
                setattr(cn, k, v)
            try:
                err = check()
                if forward:
                    ms = bench_ms(lambda: cn.conv_silu_l2(x, w, **args), dev)
                else:
                    ms = bench_ms(lambda: backward_kernels(x, w, dy, args), dev, graph=True)
            except Exception as e:  # noqa: BLE001 - out of resources: reported, next setting
                rows.append((float("inf"), values, f"failed: {str(e)[:60]}"))
                continue
            rows.append((ms, values, f"error {err:.1e}"))
        timed = "forward" if forward else "backward kernels, CUDA graph"
        print(f"sweep {keys} ({timed}, fastest first):")
        for ms, values, note in sorted(rows):
            print(f"  {values}: {ms:8.3f} ms  {note}")
        ms, values, _ = min(rows)
        if ms < float("inf"):
            best += [f"conv_norm_triton.{k}={v}" for k, v in zip(keys, values)]
            saved.update(zip(keys, values))
    for k, v in original.items():
        setattr(cn, k, v)
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
        flags = {k: v for k, v in key.constexprs if k in ("VARLEN", "BT")}
        ptrs = sorted({a.split(":")[0] for a in key.args if a.startswith("*")})
        print(f"{key.kernel} {flags} ptrs={','.join(ptrs)} seconds={time.perf_counter() - t0:.1f}",
              " ".join(f"{k}={v}" for k, v in usage.items()), flush=True)  # fmt: skip

    B, T, C, N, D = 8, 2048, 3072, 4112, 128  # the 400M model's step (benchmarks/NOTES.md)
    x = torch.empty(B, T, N, dtype=torch.bfloat16)[..., :C]
    packed = torch.empty(1, B * T, N, dtype=torch.bfloat16)[..., :C]
    cu = torch.tensor([0, 100, B * T])
    with intercepted(handler):
        for w_dtype in (torch.float32, torch.bfloat16):  # autocast / pure bf16 training
            w = torch.empty(C, 4, dtype=w_dtype)
            for xb, cu_seqlens in ((x, None), (packed, cu)):
                dy = torch.empty(xb.shape, dtype=xb.dtype)
                cn._forward(xb, w, cu_seqlens, D, 0, 2048, 1e-6)
                cn._backward(xb, w, cu_seqlens, dy, D, 0, 2048, 1e-6)
    print("conv_norm: done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["time", "cost"])
    parser.add_argument("--arch", type=int, default=90, help="cost: the target sm_XX")
    parser.add_argument("--shape", default=None, help="BxTxCxN (default 8x2048x3072x4112)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (smoke: 8)")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    parser.add_argument("--sweep", action="store_true", help="every launch setting too")
    args = parser.parse_args(argv)
    if args.mode == "cost":
        run_cost(args.arch)
        return 0
    default = "2x40x24x31" if args.smoke else "8x2048x3072x4112"
    head_dim = args.head_dim or (8 if args.smoke else 128)
    run_time(parse_shape(args.shape or default), head_dim, args.smoke, args.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
