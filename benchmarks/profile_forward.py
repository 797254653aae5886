"""Time each launch of the Triton forward separately (prepare vs the fused state pass), under
several launch settings of each (run on the GPU machine).

    python benchmarks/profile_forward.py
    python benchmarks/profile_forward.py --smoke   # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse

from _common import bench_ms, device, low_precision, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402

from deltaflow.ops.triton import prepare, states  # noqa: E402
from deltaflow.ops.triton.common import chunk_tables  # noqa: E402
from deltaflow.rules import RULES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    dev = device(args.smoke)
    dtype = low_precision(args.smoke)
    B, T, H, D = (1, 70, 1, 16) if args.smoke else (8, 4096, 16, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1)
    k = k.to(dtype)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    ld = (-0.05 * torch.rand(B, T, H, device=dev, generator=g)).to(dtype)
    tables = chunk_tables(None, B, T, q.device)
    w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v)
    first_bad = torch.empty(tables.n_chunks, H, device=dev, dtype=torch.int32)
    final_state = torch.empty(B, H, D, D, device=dev)

    def run_prepare():
        prepare.launch_prepare(
            k,
            v,
            beta=beta,
            log_decay=ld,
            tables=tables,
            kernel_id=RULES["delta"].kernel_id,
            negative_eigenvalues=False,
            eps=1e-6,
            w=w,
            u=u,
            t=None,
            first_bad=first_bad,
        )

    def run_fused():
        states.launch_forward(
            q,
            k,
            w=w,
            u=u,
            log_decay=ld,
            initial_state=None,
            first_bad=first_bad,
            tables=tables,
            scale=D**-0.5,
            o=o,
            final_state=final_state,
        )

    for warps, low in [(2, True), (1, True), (4, True), (2, False)]:
        prepare.PREPARE_WARPS, prepare.PREPARE_LOW_PRECISION_DOTS = warps, low
        ms = bench_ms(run_prepare, dev)
        print(f"prepare warps={warps} low-precision dots={low}: {ms:.3f} ms", flush=True)
    prepare.PREPARE_WARPS, prepare.PREPARE_LOW_PRECISION_DOTS = 2, True
    run_prepare()
    for BV, warps, stages in [(64, 4, 1), (64, 4, 2), (128, 4, 1), (64, 2, 1)]:
        states.FUSED_BV, states.FUSED_WARPS, states.FUSED_STAGES = BV, warps, stages
        ms = bench_ms(run_fused, dev)
        print(f"fused state pass BV={BV} warps={warps} stages={stages}: {ms:.3f} ms", flush=True)
    if not torch.isfinite(o).all():
        raise SystemExit("profile_forward: FAILED, non-finite output")
    print("profile_forward: done")


if __name__ == "__main__":
    main()
