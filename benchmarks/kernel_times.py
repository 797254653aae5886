"""Time of each GPU kernel of the op's forward and forward + backward, through the public
``delta_rule`` only, so the same script times any commit (put that commit's tree first on
PYTHONPATH) and tells which kernel a change made slower.

    python benchmarks/kernel_times.py [--shapes 8x4096x16x128,16x2048x32x64] [--rule delta]
    python benchmarks/kernel_times.py --smoke     # CPU: runs the calls, times nothing (CI)
    python benchmarks/kernel_times.py --set triton_backend.SAVE_FOR_BACKWARD=prepare   # a switch
    python benchmarks/kernel_times.py --impl fla      # fla's chunk_gated_delta_rule, same inputs
    ncu --profile-from-start off ... python benchmarks/kernel_times.py --profile-once  # ncu

Per kernel name: mean time per call over ``--iters`` profiled calls (torch.profiler, CUDA
activity), after a warm-up; plus the median wall time per call of the whole op (do_bench).
Forward + backward returns the gradients (``torch.autograd.grad``), as benchmarks/kernels.py
times it: no accumulation into ``.grad`` (an elementwise kernel of ~0.28 ms at 67M elements
that neither implementation's op launches). ``--impl fla`` lists fla's kernels the same way
(delta with decay only), so the two backward breakdowns can be set side by side.
``--profile-once``: no timing; after a warm-up (compiles, fla's autotuning), one forward +
backward a shape inside cudaProfilerStart/Stop, the range a profiler started with
``--profile-from-start off`` (Nsight Compute: issue32_call.sh's NCU step) sees, and nothing else.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections import defaultdict

import _settings
from _common import git_commit, load_fla, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

import torch  # noqa: E402

import deltaflow  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    shapes = []
    for part in text.split(","):
        dims = tuple(int(x) for x in part.lower().split("x"))
        if len(dims) != 4 or min(dims) < 1:
            raise SystemExit(f"error: --shapes takes BxTxHxD,... with positive sizes, got {part!r}")
        shapes.append(dims)
    return shapes


def inputs(B, T, H, D, device, grad):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, T, H, D, device=device, generator=g).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, device=device, generator=g).bfloat16()
    beta = torch.rand(B, T, H, device=device, generator=g).bfloat16()
    ld = (-0.05 * torch.rand(B, T, H, device=device, generator=g)).bfloat16()
    xs = [q, k.bfloat16(), v, beta, ld]
    return [x.requires_grad_(grad) for x in xs]


def kernel_ms(fn, iters: int) -> dict[str, float]:
    """Mean device time per call of every kernel ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name[:60]] += event.device_time_total / 1e3  # µs -> ms
    return {name: ms / iters for name, ms in sorted(total.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8x4096x16x128,16x2048x32x64,1x32768x16x128")
    parser.add_argument("--rule", default="delta")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--label", default="", help="a name for this tree in the output")
    parser.add_argument(
        "--impl",
        choices=("deltaflow", "fla"),
        default="deltaflow",
        help="whose op to time (fla: chunk_gated_delta_rule, delta with decay only)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument(
        "--profile-once",
        action="store_true",
        help="no timing: one warmed-up forward + backward a shape in a profiler range (ncu)",
    )
    _settings.add_settings_arg(parser)
    args = parser.parse_args(argv)
    try:
        settings = _settings.parse(args.set)  # old trees (bisection) may lack a setting: refused
    except _settings.SettingError as e:
        parser.error(str(e))
    _settings.apply(settings)
    if args.impl == "fla" and (args.smoke or args.rule != "delta"):
        parser.error("--impl fla times delta with decay on the GPU: no --smoke, --rule delta")
    fla = None
    if args.impl == "fla":
        fla = load_fla("fla.ops.gated_delta_rule:chunk_gated_delta_rule")
    if args.impl == "fla" and fla is None:
        return 1
    device = "cpu" if args.smoke else "cuda"
    shapes = [(1, 65, 2, 32)] if args.smoke else parse_shapes(args.shapes)
    label = args.label or (git_commit() if fla is None else "fla")
    # older trees (timed for bisection) have no check_values; pass it where it exists
    extra = (
        {"check_values": False}
        if "check_values" in inspect.signature(deltaflow.delta_rule).parameters
        else {}
    )
    print(
        f"# kernel times: {label}, deltaflow at {deltaflow.__file__}, rule {args.rule}"
        + (f", settings {json.dumps(settings)}" if settings else "")
    )
    results = []
    for B, T, H, D in shapes:
        for mode in ("forward+backward",) if args.profile_once else ("forward", "forward+backward"):
            q, k, v, beta, ld = inputs(B, T, H, D, device, grad=mode != "forward")
            do = torch.randn_like(v)

            def fn(q=q, k=k, v=v, beta=beta, ld=ld, do=do, mode=mode):
                if fla is not None:  # fla's argument order: q, k, v, g, beta
                    o, _ = fla(q, k, v, ld if mode != "forward" else ld.float(), beta)
                else:
                    o, _ = deltaflow.delta_rule(
                        q, k, v, beta, rule=args.rule, log_decay=ld, backend="triton", **extra
                    )
                if mode != "forward":
                    torch.autograd.grad(o, (q, k, v, beta, ld), do)

            if args.smoke:
                fn()
                continue
            if args.profile_once:  # warmed up outside the range, then one call inside it
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"{label} {(B, T, H, D)} {mode}: profiled once")
                continue
            import triton.testing

            wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            per_kernel = kernel_ms(fn, args.iters)
            results.append({"shape": [B, T, H, D], "mode": mode, "ms": wall, "kernels": per_kernel})
            print(f"{label} {(B, T, H, D)} {mode}: {wall:.3f} ms")
            for name, ms in per_kernel.items():
                if ms >= 0.005:
                    print(f"    {ms:8.3f} ms  {name}")
    if args.smoke:
        print("smoke ok")
    elif not args.profile_once:
        print("JSON " + json.dumps({"label": label, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
