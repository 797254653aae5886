"""Run every step rule on the same random sequence and print what each does.

python examples/all_rules.py
"""

from __future__ import annotations

import torch

from deltaflow import delta_rule
from deltaflow.rules import RULES, eigenvalue

torch.manual_seed(0)
B, T, H, D = 1, 256, 2, 32
q = torch.randn(B, T, H, D)
k = torch.randn(B, T, H, D)  # raw keys: ‖k‖² ≈ 32
k_unit = torch.nn.functional.normalize(k, dim=-1)
v = torch.randn(B, T, H, D)
beta = torch.rand(B, T, H)

print(
    f"{'rule':18s} {'keys':5s} {'mu(beta=0.5, |k|^2=1)':>22s} {'|o|':>10s} {'|S_T|':>10s} "
    f"{'max err vs reference':>21s}"
)
for name, rule in RULES.items():
    keys = k_unit if rule.qk_norm[1] == "l2" else k  # the keys the rule expects (its qk_norm)
    o, s = delta_rule(q, keys, v, beta, rule=name, output_final_state=True)
    o_ref, _ = delta_rule(q, keys, v, beta, rule=name, backend="reference")
    mu = eigenvalue(name, torch.tensor(0.5), torch.tensor(1.0)).item()
    print(
        f"{name:18s} {'unit' if keys is k_unit else 'raw':5s} {mu:22.4f} {o.norm():10.3f} "
        f"{s.norm():10.3f} {(o - o_ref).abs().max():21.2e}"
    )
