"""Smallest GPU smoke test of the Triton forward (for compute-sanitizer runs).

compute-sanitizer python benchmarks/smoke_triton.py
python benchmarks/smoke_triton.py --smoke   # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse

from _common import device, low_precision, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402

from deltaflow import delta_rule  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    dev = device(args.smoke)
    # the GPU shape covers a ragged third chunk; the interpreter gets a ragged second one
    B, T, H, D = (1, 70, 1, 16) if args.smoke else (2, 130, 2, 64)
    g = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0
    for dtype in (torch.float32, low_precision(args.smoke)):
        q, k, v = (torch.randn(B, T, H, D, device=dev, generator=g).to(dtype) for _ in range(3))
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
        beta = torch.rand(B, T, H, device=dev, generator=g)
        ld = -0.1 * torch.rand(B, T, H, device=dev, generator=g)
        kw = dict(log_decay=ld, output_final_state=True)
        o, s = delta_rule(q, k, v, beta, backend="triton", **kw)
        o_ref, s_ref = delta_rule(q, k, v, beta, backend="torch", **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        err = ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
        worst = max(worst, err)
        print(dtype, "rel err", f"{err:.2e}")
    if not worst < 2e-2:  # bf16's own rounding is ~4e-3; anything near 1 is a broken kernel
        raise SystemExit(f"smoke_triton: FAILED, rel err {worst:.2e}")
    print(f"smoke_triton: ok (worst rel err {worst:.2e})")


if __name__ == "__main__":
    main()
