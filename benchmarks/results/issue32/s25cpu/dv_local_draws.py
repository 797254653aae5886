"""Session 25 (CPU): what rounding scale·Pᵀ dO to bf16 on its own costs the gradients, as fla's
reverse pass does (chunk_bwd_dv_local stores it in bf16 before bwd_dhu adds K G) and ours does
not (the reverse pass accumulates Pᵀ dO and K̃ G in fp32 and rounds dU once): the float64
emulation (benchmarks/bf16_floor.emulate) with the knob ``dv_local`` added to the bf16 floor and
to the Triton kernels' roundings, over seeded draws of check_triton-like inputs. A reverse pass
in fla's form (Pᵀ dO from a parallel kernel, 32 value columns) needs this to stay within the
floor.

    PYTHONPATH=benchmarks python benchmarks/results/issue32/s25cpu/dv_local_draws.py [--draws N]
"""

from __future__ import annotations

import argparse
import statistics

import _check_cases as ct
import bf16_floor as bf
import torch

# (B, T, Dk, Dv, rule, negative eigenvalues): check_triton's op shapes, shortened
SHAPES = [
    (1, 256, 128, 128, "delta", False),
    (1, 200, 64, 64, "gated_efla", True),
    (1, 256, 128, 128, "kaczmarz", True),
    (1, 130, 256, 256, "delta", True),
]
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
VARIANTS = {
    "floor": bf.FLOOR,
    "floor + dv_local": (*bf.FLOOR, "dv_local"),
    "triton": bf.TRITON,
    "triton + dv_local": (*bf.TRITON, "dv_local"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(2)
    print("| shape, rule | gradient | " + " | ".join(VARIANTS) + " | +dv_local / floor (max) |")
    print("| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " | --- |")
    ratios = []
    for B, T, Dk, Dv, rule, ne in SHAPES:
        errs = {v: {n: [] for n in NAMES} for v in VARIANTS}
        for seed in range(args.draws):
            x = ct.make(B, T, Dk, Dv, rule, torch.bfloat16, "cpu", None, seed)
            kw = {"rule": rule, "negative_eigenvalues": ne}
            o, s, g_ref = ct.run(x, "torch", dtype=torch.float64, **kw)
            do, ds = ct.output_grads(o, s, torch.bfloat16)
            for variant, knobs in VARIANTS.items():
                g = bf.emulate(x, rule, ne, do, ds, knobs=knobs)
                for n in NAMES:
                    errs[variant][n].append(ct.rel(g[n], g_ref[n]))
        for n in NAMES:
            mean = {v: statistics.fmean(errs[v][n]) for v in VARIANTS}
            if mean["floor"] == 0:
                continue
            worst = max(a / b for a, b in zip(errs["floor + dv_local"][n], errs["floor"][n]))
            ratios.append(worst)
            cells = " | ".join(f"{mean[v]:.2e}" for v in VARIANTS)
            print(f"| ({B}, {T}, {Dk}, {Dv}) {rule} ne={ne} | {n} | {cells} | {worst:.3f} |")
    print(f"\nworst floor + dv_local against the floor, draw by draw: {max(ratios):.3f}x")


if __name__ == "__main__":
    main()
