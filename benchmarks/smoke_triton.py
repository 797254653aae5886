"""Smallest GPU smoke test of the Triton forward (for compute-sanitizer runs).

compute-sanitizer python benchmarks/smoke_triton.py
"""

from __future__ import annotations

import torch

from deltaflow import delta_rule

g = torch.Generator(device="cuda").manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    B, T, H, D = 2, 130, 2, 64
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    ld = -0.1 * torch.rand(B, T, H, device="cuda", generator=g)
    o, s = delta_rule(q, k, v, beta, log_decay=ld, output_final_state=True, backend="triton")
    o_ref, s_ref = delta_rule(q, k, v, beta, log_decay=ld, output_final_state=True, backend="torch")
    torch.cuda.synchronize()
    err = ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
    print(dtype, "rel err", f"{err:.2e}")
