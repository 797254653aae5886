"""Time each launch of the Triton forward separately (prepare vs sequential kernel), and the
sequential kernel's launch settings.

    python benchmarks/profile_forward.py
"""

from __future__ import annotations

import torch
import triton

from deltaflow.ops import triton_backend as tb
from deltaflow.ops.triton import kernels


def main() -> None:
    B, T, H, D = 8, 4096, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1)
    k = k.to(torch.bfloat16)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)
    ld = (-0.05 * torch.rand(B, T, H, device="cuda", generator=g)).to(torch.bfloat16)
    cu, _, indices, n_chunks = tb._sequences(None, B, T, 64, q.device)
    w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v)
    sT = torch.empty(B, H, D, D, device="cuda")

    def prepare(warps, low=True):
        kernels.chunk_prepare_kernel[(n_chunks, H)](
            k,
            v,
            beta,
            ld,
            w,
            u,
            cu,
            indices,
            1e-6,
            H=H,
            Dk=D,
            Dv=D,
            BK=D,
            BV=D,
            RULE=1,
            NEG=False,
            HAS_BETA=True,
            HAS_DECAY=True,
            PREC="tf32",
            LOW_PRECISION_DOTS=low,
            num_warps=warps,
        )

    def sequential(BV, warps, stages):
        kernels.chunk_forward_kernel[(triton.cdiv(D, BV), B * H)](
            q,
            k,
            w,
            u,
            ld,
            q,
            o,
            sT,
            cu,
            D**-0.5,
            H=H,
            Dk=D,
            Dv=D,
            BK=D,
            BV=BV,
            HAS_DECAY=True,
            HAS_S0=False,
            PREC="tf32",
            num_warps=warps,
            num_stages=stages,
        )

    for warps, low in [(2, True), (1, True), (4, True)]:
        ms = triton.testing.do_bench(lambda a=(warps, low): prepare(*a), return_mode="median")
        print(f"prepare warps={warps} low-precision dots={low}: {ms:.3f} ms", flush=True)
    for BV, warps, stages in [(64, 4, 1), (64, 4, 2), (128, 4, 1), (64, 2, 1)]:
        ms = triton.testing.do_bench(
            lambda a=(BV, warps, stages): sequential(*a), return_mode="median"
        )
        print(f"sequential BV={BV} warps={warps} stages={stages}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
