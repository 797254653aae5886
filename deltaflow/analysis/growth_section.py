"""Experiments A (key regimes) and B (beta pinned near 1) of the stability study: run, dump to
study.json, and write up as markdown tables and findings (experiment C, the real op on B's
inputs, is :mod:`deltaflow.analysis.op_crosscheck`)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from deltaflow.analysis import growth
from deltaflow.analysis.config import StudyConfig
from deltaflow.analysis.op_crosscheck import op_finding, op_section
from deltaflow.analysis.verdicts import cell, chain_index, fmt, table, verdict


def _run(cfg: StudyConfig, chains: list[growth.Chain], steps: int, progress: bool):
    return growth.simulate(
        chains,
        cfg.precisions,
        steps=steps,
        dk=cfg.dk,
        dv=cfg.dv,
        eps=cfg.eps,
        seed=cfg.seed,
        device=cfg.device,
        progress=progress,
    )


def _dump(res: growth.GrowthResult, experiment: str) -> dict:
    """Per-chain verdicts and thinned curves for study.json."""
    precs = [p.name for p in res.precisions]
    rows = []
    for i, c in enumerate(res.chains):
        for p in precs:
            rows.append(
                {
                    **asdict(c),
                    "experiment": experiment,
                    "precision": p,
                    **asdict(verdict(res, p, i)),
                    "max_abs_mu": float(res.mu_max[p][i]),
                    "frac_abs_mu_gt1": float(res.frac_mu_gt1[p][i]),
                    "final_rel_err_vs_fp64": float(res.rel_err[p][-1, i]),
                }
            )
    stride = max(1, len(res.steps) // 100)

    def short(x: torch.Tensor) -> list:
        # 4 significant digits keep the committed JSON small; inf/nan become strings.
        return [[float(f"{v:.4g}") if math.isfinite(v) else str(v) for v in r] for r in x.tolist()]

    return {
        "steps": int(res.steps[-1]),
        "chains": rows,
        "curves": {
            "t": res.steps[::stride].tolist(),
            "order": [asdict(c) for c in res.chains],
            "norms": {p: short(res.norms[p][::stride].T) for p in precs},
        },
    }


def growth_section(
    cfg: StudyConfig, out: Path, data: dict, findings: list[str], progress: bool
) -> list[str]:
    chains_a = growth.make_chains(
        cfg.rules, cfg.keys, cfg.betas, cfg.seeds, cfg.negative_eigenvalues
    )
    chains_b = growth.make_chains(
        cfg.pinned_rules, cfg.pinned_keys, cfg.pinned_betas, cfg.pinned_seeds, (True,)
    )
    t0 = time.time()
    res_a = _run(cfg, chains_a, cfg.steps, progress)
    res_b = _run(cfg, chains_b, cfg.pinned_steps, progress)
    sim_s = time.time() - t0
    precs = [p.name for p in res_a.precisions]
    data["growth"] = {"simulate_s": sim_s, "A": _dump(res_a, "A"), "B": _dump(res_b, "B")}

    md = [
        "## 2. Long-run growth of ‖S_t‖",
        "",
        f"{len(chains_a) + len(chains_b)} independent chains (Dk = {cfg.dk}, Dv = {cfg.dv}, "
        f"v ~ N(0, I); simulated in {sim_s:.0f} s) in precisions {', '.join(precs)}. "
        "`IN/STATE`: k, v, beta, lam = ‖k‖² and (a, b) rounded to IN, the state rounded to "
        "STATE after every step, arithmetic in float32; fp64 is the reference on the unrounded "
        "inputs. Cells, worst seed first: **inf@t** = first step with a non-finite state entry "
        "(seeds affected); **x exp** = diverging (log‖S‖ against log t steeper than 1.5 over "
        "the last decade of t: exponential growth); x ~t^p = growing like t^p (p = 0.5 is the "
        "random walk of a transition with |mu| = 1, which never forgets along k); a plain "
        "number = bounded, the final ‖S_T‖_F.",
        "",
        f"### A. Key norms (T = {cfg.steps}, beta: {', '.join(cfg.betas)})",
        "",
    ]
    for kr in cfg.keys:
        fn = f"growth_keys_{kr.replace(':', '')}.png"
        growth.plot_growth(
            res_a,
            str(out / fn),
            select={"keys": kr},
            title=f"‖S_t‖, {kr} keys ({growth.KEY_REGIMES.get(kr, kr)}), beta "
            f"{', '.join(cfg.betas)}; [-1,1] = negative eigenvalues",
        )
        md += [f"![growth {kr}]({fn})", ""]
    trows = []
    for rule in cfg.rules:
        for neg in cfg.negative_eigenvalues:
            for kr in cfg.keys:
                for br in cfg.betas:
                    ix = chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr, betas=br)
                    mu = max(float(res_a.mu_max["fp64"][i]) for i in ix)
                    trows.append(
                        [rule, "yes" if neg else "no", kr, br, fmt(mu)]
                        + [cell(res_a, p, ix) for p in precs]
                    )
    md += [
        table(["rule", "neg. eig.", "keys", "beta", "max abs(mu)", *precs], trows),
        "",
    ]
    # Error against the float64 run, where the state is bounded (elsewhere it is meaningless).
    erows = []
    for rule in cfg.rules:
        for neg in cfg.negative_eigenvalues:
            for kr in cfg.keys:
                ix = chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr)
                if any(verdict(res_a, "fp64", i).status != "bounded" for i in ix):
                    continue
                cells = [
                    fmt(float(res_a.rel_err[p][-1, ix].median()), 2) for p in precs if p != "fp64"
                ]
                erows.append([rule, "yes" if neg else "no", kr, *cells])
    md += [
        "Relative error ‖S_T − S_T^fp64‖ / ‖S_T^fp64‖ at T (median over seeds), for the settings",
        "whose fp64 state is bounded:",
        "",
        table(["rule", "neg. eig.", "keys", *[p for p in precs if p != "fp64"]], erows),
        "",
        f"### B. beta pinned near 1 with negative eigenvalues (T = {cfg.pinned_steps})",
        "",
        "Unit keys, fresh every step (`unit`) or drawn from a fixed set of V unit vectors",
        "(`vocab:V`: keys that repeat, like frequent tokens). `near1`: beta = 1 - U(0, 1e-3),",
        "which bf16 rounds to exactly 1, so mu = 1 - 2‖k‖² sits at -1 up to the rounding of",
        "k. Each cell: outcome as above / max abs(mu) of the transition actually applied",
        "(rounded a times the squared norm of the rounded k) and, in brackets, the fraction of",
        "steps with abs(mu) > 1 / for diverging chains, the earliest step at which the state",
        "dtype would overflow if the measured growth rate went on.",
        "",
    ]
    growth.plot_growth(
        res_b,
        str(out / "growth_pinned.png"),
        by="rule+keys+betas" if len(cfg.pinned_rules) > 1 else "keys+betas",
        title="‖S_t‖, negative eigenvalues, unit keys: beta pinned near 1 vs beta <= 0.9",
    )
    md += ["![growth pinned](growth_pinned.png)", ""]
    brows = []
    for rule in cfg.pinned_rules:
        for kr in cfg.pinned_keys:
            for br in cfg.pinned_betas:
                ix = chain_index(res_b, rule=rule, keys=kr, betas=br)
                cells = []
                for p in precs:
                    mu = max(float(res_b.mu_max[p][i]) for i in ix)
                    frac = sum(float(res_b.frac_mu_gt1[p][i]) for i in ix) / len(ix)
                    proj = [verdict(res_b, p, i).projected_overflow for i in ix]
                    proj = [x for x in proj if x is not None]
                    tail = f" / overflow ~{min(proj):.2g}" if proj else ""
                    cells.append(f"{cell(res_b, p, ix)} / {mu:.4f} ({frac:.0%}){tail}")
                brows.append([rule, kr, br, *cells])
    md += [table(["rule", "keys", "beta", *precs], brows), ""]
    findings.extend(_growth_findings(cfg, res_a, res_b, precs))
    if cfg.op_backend != "none":
        md += op_section(cfg, res_b, out, data)
        chk = data["growth"].get("op_crosscheck")
        if chk and chk.get("max_abs_log10_ratio") is not None:
            findings.append(op_finding(cfg, res_b, chk))
    return md


def _summ(res: growth.GrowthResult, precs: list[str], ix: list[int]) -> str:
    """Words for a finding, precisions grouped by outcome, e.g. 'non-finite in fp32 (t=109,
    3/3 seeds), fp16 (t=9, 3/3); bounded in fp64 (‖S_T‖ <= 4.6)'."""
    groups: dict[str, list[str]] = {}
    agg: dict[str, list[float]] = {}
    for p in precs:
        vs = [verdict(res, p, i) for i in ix]
        bad = [v.first_nonfinite for v in vs if v.status == "non-finite"]
        div = [v for v in vs if v.status == "diverging"]
        grow = [v.exponent for v in vs if v.status == "growing"]
        worst = max(v.final_norm for v in vs)
        if bad:
            more = f", {len(div)} more diverging" if div else ""
            groups.setdefault("non-finite in", []).append(
                f"{p} (from t={min(bad)}, {len(bad)}/{len(vs)} seeds{more})"
            )
        elif div:
            proj = [v.projected_overflow for v in div if v.projected_overflow]
            tail = f", overflow projected at t~{min(proj):.2g}" if proj else ""
            groups.setdefault("diverging in", []).append(
                f"{p} ({len(div)}/{len(vs)} seeds, ‖S_T‖ up to {worst:.3g}{tail})"
            )
        elif grow:
            # Listed per precision: the exponent is where bf16 and fp64 differ.
            groups.setdefault("growing in", []).append(
                f"{p} (like t^{max(grow):.1f}, ‖S_T‖ <= {worst:.3g})"
            )
        else:
            groups.setdefault("bounded in", []).append(p)
            agg.setdefault("bounded in", []).append(worst)
    out = []
    for k, names in groups.items():
        who = "all precisions" if len(names) == len(precs) and k in agg else ", ".join(names)
        if k == "bounded in":
            out.append(f"{k} {who} (‖S_T‖ <= {max(agg[k]):.3g})")
        else:
            out.append(f"{k} {who}")
    return "; ".join(out)


def _growth_findings(cfg, res_a, res_b, precs) -> list[str]:
    """Statements computed from the numbers (never hard-coded), one per question."""
    out = []
    # (1) DeltaNet with raw vs normalized keys.
    if "delta" in cfg.rules and False in cfg.negative_eigenvalues:
        parts = []
        for kr in cfg.keys:
            ix = chain_index(res_a, rule="delta", negative_eigenvalues=False, keys=kr)
            parts.append(f"{kr} keys: {_summ(res_a, precs, ix)}")
        out.append(
            f"(1) delta (DeltaNet), beta {'/'.join(cfg.betas)}, T = {cfg.steps}. "
            + ". ".join(parts)
            + "."
        )
    # (3) The other rules with raw keys, every precision.
    raw = [k for k in cfg.keys if k in ("gaussian", "heavy")]
    if raw:
        parts = []
        for rule in cfg.rules:
            if rule == "delta":
                continue
            for neg in cfg.negative_eigenvalues:
                ix = [
                    i
                    for kr in raw
                    for i in chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr)
                ]
                tag = f"{rule}{' with negative eigenvalues' if neg else ''}"
                parts.append(f"{tag}: {_summ(res_a, precs, ix)}")
        if parts:
            head = f"(3) Raw keys ({', '.join(raw)}), T = {cfg.steps}. "
            out.append(head + ". ".join(parts) + ".")
    # (2) Negative eigenvalues with beta near 1.
    for rule in cfg.pinned_rules:
        for kr in cfg.pinned_keys:
            parts = []
            for br in cfg.pinned_betas:
                ix = chain_index(res_b, rule=rule, keys=kr, betas=br)
                parts.append(f"beta {br}: {_summ(res_b, precs, ix)}")
            out.append(
                f"(2) {rule} with negative eigenvalues, {kr} keys, T = {cfg.pinned_steps}. "
                + ". ".join(parts)
                + "."
            )
    return out
