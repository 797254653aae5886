"""Time each launch of the Triton forward separately (prepare vs the fused state pass), under
several launch settings of each (run on the GPU machine).

    python benchmarks/profile_forward.py
"""

from __future__ import annotations

import torch
import triton

from deltaflow.ops.triton import prepare, states
from deltaflow.ops.triton.common import chunk_tables
from deltaflow.rules import RULES


def main() -> None:
    B, T, H, D = 8, 4096, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1)
    k = k.to(torch.bfloat16)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)
    ld = (-0.05 * torch.rand(B, T, H, device="cuda", generator=g)).to(torch.bfloat16)
    tables = chunk_tables(None, B, T, q.device)
    w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v)
    first_bad = torch.empty(tables.n_chunks, H, device="cuda", dtype=torch.int32)
    final_state = torch.empty(B, H, D, D, device="cuda")

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
        ms = triton.testing.do_bench(run_prepare, return_mode="median")
        print(f"prepare warps={warps} low-precision dots={low}: {ms:.3f} ms", flush=True)
    prepare.PREPARE_WARPS, prepare.PREPARE_LOW_PRECISION_DOTS = 2, True
    run_prepare()
    for BV, warps, stages in [(64, 4, 1), (64, 4, 2), (128, 4, 1), (64, 2, 1)]:
        states.FUSED_BV, states.FUSED_WARPS, states.FUSED_STAGES = BV, warps, stages
        ms = triton.testing.do_bench(run_fused, return_mode="median")
        print(f"fused state pass BV={BV} warps={warps} stages={stages}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
