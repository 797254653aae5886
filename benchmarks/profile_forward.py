"""Time each launch of the Triton forward separately (prepare vs sequential kernel).

python benchmarks/profile_forward.py
"""

from __future__ import annotations

import torch
import triton

from deltaflow.ops import triton_backend as tb
from deltaflow.ops.triton import kernels


def main() -> None:
    B, T, H, D = 8, 4096, 16, 128
    C = 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1)
    k = k.to(torch.bfloat16)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)
    ld = (-0.05 * torch.rand(B, T, H, device="cuda", generator=g)).to(torch.bfloat16)
    cu, offsets, indices, n_chunks = tb._sequences(None, B, T, C, q.device)
    flags = dict(RULE=1, NEG=False, HAS_BETA=True, HAS_DECAY=True)
    T_mat = torch.empty(n_chunks, H, C, C, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(v)
    sT = torch.empty(B, H, D, D, device="cuda")

    def prepare():
        kernels.chunk_prepare_kernel[(n_chunks, H)](
            k,
            beta,
            ld,
            T_mat,
            cu,
            indices,
            1e-6,
            H=H,
            Dk=D,
            BK=128,
            C=C,
            DOT_PRECISION="tf32",
            num_warps=4,
            **flags,
        )

    def sequential(BV, warps):
        kernels.chunk_forward_kernel[(triton.cdiv(D, BV), B * H)](
            q,
            k,
            v,
            beta,
            ld,
            T_mat,
            q,
            o,
            sT,
            cu,
            offsets,
            D**-0.5,
            1e-6,
            H=H,
            Dk=D,
            Dv=D,
            BK=128,
            BV=BV,
            C=C,
            HAS_S0=False,
            DOT_PRECISION="tf32",
            num_warps=warps,
            num_stages=1,
            **flags,
        )

    prepare()
    print(f"prepare: {triton.testing.do_bench(prepare, return_mode='median'):.3f} ms")
    for BV in (16, 32, 64):
        for warps in (4, 8):
            ms = triton.testing.do_bench(
                lambda BV=BV, warps=warps: sequential(BV, warps), return_mode="median"
            )
            print(f"sequential BV={BV} warps={warps}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
