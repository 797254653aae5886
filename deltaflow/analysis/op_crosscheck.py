"""Experiment C of the stability study: experiment B's exact inputs through the real op
``deltaflow.delta_rule`` in bf16, to check the emulation and to see the layer's own setting."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from deltaflow.analysis import growth
from deltaflow.analysis.config import StudyConfig
from deltaflow.analysis.verdicts import fmt, table


def op_finding(cfg: StudyConfig, res_b: growth.GrowthResult, chk: dict) -> str:
    """One line: does the real op reproduce the emulation, and what does fp32 beta change."""
    ratio = 10 ** chk["max_abs_log10_ratio"]
    blown = {}
    for variant, per_chain in chk["norms"].items():
        blown[variant] = sum(
            1
            for i, c in enumerate(res_b.chains)
            if c.betas == "near1" and not math.isfinite(per_chain[i][-1])
        )
    big = {
        variant: sum(
            1
            for i, c in enumerate(res_b.chains)
            if c.betas == "near1" and math.isfinite(per_chain[i][-1]) and per_chain[i][-1] > 1e6
        )
        for variant, per_chain in chk["norms"].items()
    }
    n = sum(1 for c in res_b.chains if c.betas == "near1")
    parts = [f"{v}: {blown[v]} non-finite, {big[v]} above 1e6 (of {n} near1 chains)" for v in blown]
    return (
        f"(2, real op) delta_rule (backend {cfg.op_backend}) on the same inputs matches the "
        f"emulated bf16/fp32 run to {ratio - 1:.1e} relative wherever both are finite. At "
        f"T = {cfg.pinned_steps}, " + "; ".join(parts) + "."
    )


def op_crosscheck(
    chains: list[growth.Chain],
    steps: int,
    *,
    dk: int,
    dv: int,
    seed: int,
    backend: str = "torch",
    device: str = "cpu",
    segments: int = 30,
    eps: float = 1e-6,
) -> dict:
    """Feed the same inputs to the real op, `deltaflow.delta_rule`, with bf16 q, k, v (its state
    is float32), in `segments` calls chained through initial_state, and record ||S|| after each.
    Two variants: beta in bf16, and beta in float32 (what DeltaAttention passes: it computes
    the sigmoid in float32). Every chain is one head of a single call."""
    from deltaflow import delta_rule

    n = len(chains)
    ins = [growth.stream_inputs(c, steps, dk, dv, seed=seed) for c in chains]
    k = torch.stack([x[0] for x in ins], 1)[None].to(device)  # [1, T, N, dk]
    v = torch.stack([x[1] for x in ins], 1)[None].to(device)
    beta = torch.stack([x[2] for x in ins], 1)[None].to(device)  # [1, T, N]
    q = torch.randn(k.shape, generator=torch.Generator().manual_seed(seed), dtype=k.dtype)
    q = q.to(device)
    bounds = torch.linspace(0, steps, segments + 1).round().long().unique().tolist()
    out = {"t": bounds[1:]}
    for variant, beta_dtype in (("bf16", torch.bfloat16), ("bf16, fp32 beta", torch.float32)):
        norms = torch.empty(len(bounds) - 1, n, dtype=torch.float64)
        for rule, neg in sorted({(c.rule, c.negative_eigenvalues) for c in chains}):
            hix = torch.tensor(
                [i for i, c in enumerate(chains) if (c.rule, c.negative_eigenvalues) == (rule, neg)]
            )
            S = None
            for j, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
                _, S = delta_rule(
                    q[:, t0:t1, hix].bfloat16(),
                    k[:, t0:t1, hix].bfloat16(),
                    v[:, t0:t1, hix].bfloat16(),
                    beta[:, t0:t1, hix].to(beta_dtype),
                    rule=rule,
                    negative_eigenvalues=neg,
                    eps=eps,
                    initial_state=S,
                    output_final_state=True,
                    backend=backend,
                )
                norms[j, hix] = growth._fro(S[0].double().cpu())
        out[variant] = norms
    return out


def op_section(cfg: StudyConfig, res_b: growth.GrowthResult, out: Path, data: dict) -> list[str]:
    """Experiment B's inputs through the real op, against the emulated 'bf16/fp32' run."""
    chains = res_b.chains
    try:
        chk = op_crosscheck(
            chains,
            cfg.pinned_steps,
            dk=cfg.dk,
            dv=cfg.dv,
            seed=cfg.seed,
            backend=cfg.op_backend,
            device=cfg.device,
            eps=cfg.eps,
        )
    except Exception as e:  # an op/backend failure must not lose the rest of the study
        return [f"Cross-check with the real op failed: `{type(e).__name__}: {e}`", ""]
    emu = "bf16/fp32" if "bf16/fp32" in res_b.norms else None
    data["growth"]["op_crosscheck"] = {
        "backend": cfg.op_backend,
        "t": chk["t"],
        "norms": {k: v.T.tolist() for k, v in chk.items() if k != "t"},
    }
    rows, agree = [], []
    for i, c in enumerate(chains):
        op_bf, op_b32 = float(chk["bf16"][-1, i]), float(chk["bf16, fp32 beta"][-1, i])
        em = float(res_b.norms[emu][-1, i]) if emu else math.nan
        if emu and math.isfinite(op_bf) and math.isfinite(em) and em > 0:
            agree.append(abs(math.log10(op_bf / em)))
        rows.append([c.keys, c.betas, c.seed, fmt(em), fmt(op_bf), fmt(op_b32)])
    data["growth"]["op_crosscheck"]["max_abs_log10_ratio"] = max(agree) if agree else None
    md = [
        f"### C. The same inputs through the real op (`delta_rule`, backend `{cfg.op_backend}`)",
        "",
        "Experiment B's chains as heads of `deltaflow.delta_rule` with bf16 q, k, v (the op keeps",
        f"a float32 state), in {len(chk['t'])} calls chained through `initial_state`. Column",
        "'op, fp32 beta' passes beta in float32, as `DeltaAttention` does (it computes the sigmoid",
        "in float32), so beta = 1 - 1e-3 is not rounded to 1 there. Final ‖S_T‖:",
        "",
    ]
    if agree:
        md += [
            f"The emulated `bf16/fp32` run and the op agree to a relative difference of "
            f"{10 ** max(agree) - 1:.1e} or less on every chain where both are finite.",
            "",
        ]
    md += [
        table(
            ["keys", "beta", "seed", f"emulated {emu or '-'}", "op, bf16 beta", "op, fp32 beta"],
            rows,
        ),
        "",
    ]
    return md
