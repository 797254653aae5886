"""The stability study: spectrum, long-run growth, discretization; markdown summary and PNGs.

`run_study(StudyConfig(...), out_dir)` writes into out_dir:
  summary.md          the tables and the findings, with the numbers, linking the plots
  study.json          every number behind the tables (rows per rule/regime/precision)
  spectrum.png        mu against h and against ‖k‖, every rule, with and without neg. eigenvalues
  growth_keys_*.png   ‖S_t‖ per rule and precision for each key regime (experiment A)
  growth_pinned.png   ‖S_t‖ for beta pinned near 1 with negative eigenvalues (experiment B)
  discretization.png  one-step error against exp(-beta kk^T), log-log, with fitted orders
  layer_mu.png        (only with a checkpoint) mu per head of a trained model's layers

Two growth experiments, each one batched simulation (one loop over t for all its chains):
  A "keys":   every rule, with and without negative eigenvalues, unit / raw Gaussian /
              heavy-tailed keys, beta ~ U(0, 1): questions 1 (DeltaNet needs normalized keys)
              and 3 (EFLA, Longhorn, trapezoid and Kaczmarz do not).
  B "pinned": delta with negative eigenvalues, unit keys that change every step or repeat (a
              small vocabulary of keys), beta pinned near 1 against beta <= 0.9: question 2.
  C:          B's exact inputs through the real op `deltaflow.delta_rule` in bf16, to check the
              emulation and to see the layer's own setting (beta in float32).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deltaflow.analysis import discretization as disc
from deltaflow.analysis import growth, spectrum

OVERFLOW = {"fp16": 65504.0}  # largest finite state entry per state dtype; others ~3.4e38
FP32_MAX = 3.4028234663852886e38


@dataclass
class StudyConfig:
    rules: list[str] = field(default_factory=spectrum.default_rules)  # derived from RULES
    precisions: list[str] = field(
        default_factory=lambda: ["fp32", "bf16", "bf16/fp32", "fp32/bf16", "fp16"]
    )
    steps: int = 10_000
    dk: int = 32
    dv: int = 16
    seeds: int = 3
    keys: list[str] = field(default_factory=lambda: ["unit", "gaussian", "heavy"])
    betas: list[str] = field(default_factory=lambda: ["uniform"])
    negative_eigenvalues: list[bool] = field(default_factory=lambda: [False, True])
    pinned_rules: list[str] = field(default_factory=lambda: ["delta"])
    pinned_keys: list[str] = field(default_factory=lambda: ["unit", "vocab:16", "vocab:1"])
    pinned_betas: list[str] = field(default_factory=lambda: ["near1", "uniform:0.9"])
    pinned_seeds: int = 8
    pinned_steps: int = 30_000
    op_backend: str = "torch"  # backend of the real-op cross-check of experiment B; "none": skip
    eps: float = 1e-6
    seed: int = 0
    device: str = "cpu"
    parts: list[str] = field(default_factory=lambda: ["spectrum", "growth", "discretization"])
    checkpoint: str | None = None
    text: str | None = None
    tokenizer: str = "byte"
    max_tokens: int = 2048


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + os.replace: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be shared
    os.replace(tmp, path)


def _fmt(x: float | None, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.{nd}g}"


def _table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


@dataclass
class Verdict:
    """How one chain's ‖S_t‖ behaved in one precision."""

    status: str  # "non-finite" | "diverging" | "growing" | "bounded"
    first_nonfinite: int | None
    final_norm: float
    exponent: float  # d log‖S‖ / d log t over the second half: 0 bounded, 0.5 sqrt(t)
    dec_per_10k: float  # decades of growth per 10k steps over the second half
    projected_overflow: float | None  # step where the state dtype would overflow, if diverging


def verdict(res: growth.GrowthResult, prec: str, i: int) -> Verdict:
    """Classify chain i: non-finite; diverging (faster than t^1.5 over the last decade of t, i.e.
    exponential: a random walk with |mu| = 1 grows like t^0.5); growing (faster than t^0.2);
    bounded. A diverging chain gets the step at which its growth rate would overflow the state
    dtype (fp16: 65504, others: 3.4e38)."""
    fb = int(res.first_nonfinite[prec][i])
    if fb >= 0:
        return Verdict("non-finite", fb, math.inf, math.nan, math.nan, None)
    y = res.norms[prec][:, i]
    t = res.steps.double()
    y1, t1 = float(y[-1]), float(t[-1])
    # Slope of log‖S‖ on log t over the last decade of the run: robust to the fluctuations of
    # a bounded state (slope ~0) where a two-point ratio is not.
    m = (t >= t1 / 10) & (y > 0)
    if int(m.sum()) < 3:
        return Verdict("bounded", None, y1, math.nan, math.nan, None)
    x, ly = t[m].log(), y[m].log()
    x0 = x - x.mean()
    expo = float((x0 * (ly - ly.mean())).sum() / (x0 * x0).sum())
    half = t >= t1 / 2
    rate = float((y[half][-1] / y[half][0]).log10() / (t[half][-1] - t[half][0]).clamp_min(1)) * 1e4
    if expo > 1.5:
        limit = OVERFLOW.get(prec.split("/")[-1], FP32_MAX)
        proj = t1 + (math.log10(limit) - math.log10(y1)) / rate * 1e4 if rate > 0 else None
        return Verdict("diverging", None, y1, expo, rate, proj)
    return Verdict("growing" if expo > 0.2 else "bounded", None, y1, expo, rate, None)


def cell(res: growth.GrowthResult, prec: str, ix: list[int]) -> str:
    """Markdown table cell for chains ix (the seeds of one setting), worst case first:
    '**inf@81** (3/3)', '**1.2e+14 exp**' (diverging), '182 ~t^0.5' (growing) or '16.5'."""
    vs = [verdict(res, prec, i) for i in ix]
    bad = [v for v in vs if v.status == "non-finite"]
    if bad:
        return f"**inf@{min(v.first_nonfinite for v in bad)}** ({len(bad)}/{len(vs)})"
    worst = max(v.final_norm for v in vs)
    div = [v for v in vs if v.status == "diverging"]
    if div:
        return f"**{worst:.3g} exp** ({len(div)}/{len(vs)})"
    grow = [v.exponent for v in vs if v.status == "growing"]
    if grow:
        return f"{worst:.3g} ~t^{max(grow):.1f}"
    return f"{worst:.3g}"


def _chain_index(res: growth.GrowthResult, **attrs) -> list[int]:
    return [
        i for i, c in enumerate(res.chains) if all(getattr(c, k) == v for k, v in attrs.items())
    ]


def run_study(
    cfg: StudyConfig, out_dir: str | Path, *, progress: bool = True, command: str | None = None
) -> dict:
    """Run the selected parts, write summary.md, study.json and the PNGs; return the numbers.
    `command` is recorded in the summary (the CLI passes the command line that ran it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    data: dict = {"config": asdict(cfg), "command": command}
    md: list[str] = []
    findings: list[str] = []

    if "spectrum" in cfg.parts:
        spectrum.plot_spectrum(cfg.rules, str(out / "spectrum.png"), eps=cfg.eps)
        regimes = {
            "unit keys, beta in [0,1]": ((0.0, 1.0), (1.0, 1.0)),
            "‖k‖ in [0.1,10], beta in [0,1]": ((0.0, 1.0), (0.1, 10.0)),
            "‖k‖ in [0.1,10], beta in [0,5] (softplus)": ((0.0, 5.0), (0.1, 10.0)),
        }
        rows = spectrum.spectrum_table(cfg.rules, regimes, eps=cfg.eps)
        data["spectrum"] = rows
        md += [
            "## 1. Spectrum: the eigenvalue mu along k",
            "",
            "![spectrum](spectrum.png)",
            "",
            "mu = 1 - a*‖k‖² is the transition's only eigenvalue that is not 1; the state is",
            "stable over long products only if |mu| <= 1. Left: against h = beta*‖k‖² at",
            "‖k‖ = 1 (kaczmarz and relaxed_kaczmarz depend on beta, not h: there they read",
            "beta = h). Right: against ‖k‖ at beta = 0.9. Range of mu over each regime",
            "(**bold** = leaves [-1, 1]):",
            "",
        ]
        names = list(regimes)
        trows = []
        for rule in cfg.rules:
            for neg in (False, True):
                cells = []
                for nm in names:
                    r = next(
                        x
                        for x in rows
                        if (x["rule"], x["negative_eigenvalues"], x["regime"]) == (rule, neg, nm)
                    )
                    cell = f"[{r['mu_min']:.3g}, {r['mu_max']:.3g}]"
                    cells.append(cell if r["stable"] else f"**{cell}**")
                trows.append([rule, "yes" if neg else "no", *cells])
        md += [_table(["rule", "neg. eig.", *names], trows), ""]

    if "growth" in cfg.parts:
        md += _growth_section(cfg, out, data, findings, progress)

    if "discretization" in cfg.parts:
        h, errs, rows = disc.discretization_study(cfg.rules)
        disc.plot_discretization(h, errs, rows, str(out / "discretization.png"))
        data["discretization"] = rows
        md += [
            "## 3. Discretization: one token against the exact flow exp(-beta kk^T)",
            "",
            "![discretization](discretization.png)",
            "",
            "Spectral-norm error of I - a kk^T against torch.linalg.matrix_exp(-beta kk^T)",
            "(float64, ‖k‖² = 2, h = beta*‖k‖²). Local error O(h^p) means a method of order",
            "p - 1; slope fitted on h <= 0.1. negative_eigenvalues is not a step of this flow,",
            "and the kaczmarz rules step a normalized flow, so they are not consistent here.",
            "",
            _table(
                ["rule", "local slope p", "method order", "error at h=0.01", "max error"],
                [
                    [
                        r["rule"],
                        "exact" if r["exact"] else f"{r['local_order']:.2f}",
                        "exact" if r["exact"] else f"{r['method_order']:.2f}",
                        _fmt(r["err_at_h=0.01"]),
                        _fmt(r["max_err"]),
                    ]
                    for r in rows
                ],
            ),
            "",
        ]
        by = {r["rule"]: r for r in rows}
        bits = []
        for rule in ("efla", "delta", "longhorn", "trapezoid"):
            if rule in by:
                r = by[rule]
                bits.append(
                    f"{rule} exact (max error {r['max_err']:.1e})"
                    if r["exact"]
                    else f"{rule} order {r['method_order']:.2f}"
                )
        if bits:
            findings.append("Discretization of exp(-beta kk^T): " + "; ".join(bits) + ".")

    if "layer" in cfg.parts or cfg.checkpoint:
        md += _layer_section(cfg, out, data)

    elapsed = time.time() - t_start
    data["elapsed_s"] = elapsed
    data["findings"] = findings
    head = [
        "# deltaflow stability study",
        "",
        f"Command: `{command or 'deltaflow.analysis.run_study(...)'}`  ",
        f"Runtime {elapsed:.0f} s on {cfg.device} ({platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads).",
        "",
        "## Findings",
        "",
        *[f"- {f}" for f in findings],
        "",
    ]
    atomic_write_text(out / "summary.md", "\n".join(head + md) + "\n")
    text = json.dumps(_finite(data), separators=(",", ":"), default=_json_default, allow_nan=False)
    atomic_write_text(out / "study.json", text)
    if command:  # the same convention as the other result directories
        atomic_write_text(out / "command.txt", command + "\n")
    return data


def _finite(x):
    """Replace inf/nan floats by the strings 'inf'/'nan' so study.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, torch.dtype):
        return str(x)
    return str(x)


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


def _growth_section(
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
                    ix = _chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr, betas=br)
                    mu = max(float(res_a.mu_max["fp64"][i]) for i in ix)
                    trows.append(
                        [rule, "yes" if neg else "no", kr, br, _fmt(mu)]
                        + [cell(res_a, p, ix) for p in precs]
                    )
    md += [
        _table(["rule", "neg. eig.", "keys", "beta", "max abs(mu)", *precs], trows),
        "",
    ]
    # Error against the float64 run, where the state is bounded (elsewhere it is meaningless).
    erows = []
    for rule in cfg.rules:
        for neg in cfg.negative_eigenvalues:
            for kr in cfg.keys:
                ix = _chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr)
                if any(verdict(res_a, "fp64", i).status != "bounded" for i in ix):
                    continue
                cells = [
                    _fmt(float(res_a.rel_err[p][-1, ix].median()), 2) for p in precs if p != "fp64"
                ]
                erows.append([rule, "yes" if neg else "no", kr, *cells])
    md += [
        "Relative error ‖S_T − S_T^fp64‖ / ‖S_T^fp64‖ at T (median over seeds), for the settings",
        "whose fp64 state is bounded:",
        "",
        _table(["rule", "neg. eig.", "keys", *[p for p in precs if p != "fp64"]], erows),
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
                ix = _chain_index(res_b, rule=rule, keys=kr, betas=br)
                cells = []
                for p in precs:
                    mu = max(float(res_b.mu_max[p][i]) for i in ix)
                    frac = sum(float(res_b.frac_mu_gt1[p][i]) for i in ix) / len(ix)
                    proj = [verdict(res_b, p, i).projected_overflow for i in ix]
                    proj = [x for x in proj if x is not None]
                    tail = f" / overflow ~{min(proj):.2g}" if proj else ""
                    cells.append(f"{cell(res_b, p, ix)} / {mu:.4f} ({frac:.0%}){tail}")
                brows.append([rule, kr, br, *cells])
    md += [_table(["rule", "keys", "beta", *precs], brows), ""]
    findings.extend(_growth_findings(cfg, res_a, res_b, precs))
    if cfg.op_backend != "none":
        md += _op_section(cfg, res_b, out, data)
        chk = data["growth"].get("op_crosscheck")
        if chk and chk.get("max_abs_log10_ratio") is not None:
            findings.append(_op_finding(cfg, res_b, chk))
    return md


def _op_finding(cfg: StudyConfig, res_b: growth.GrowthResult, chk: dict) -> str:
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


def _op_section(cfg: StudyConfig, res_b: growth.GrowthResult, out: Path, data: dict) -> list[str]:
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
        rows.append([c.keys, c.betas, c.seed, _fmt(em), _fmt(op_bf), _fmt(op_b32)])
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
        _table(
            ["keys", "beta", "seed", f"emulated {emu or '-'}", "op, bf16 beta", "op, fp32 beta"],
            rows,
        ),
        "",
    ]
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
            ix = _chain_index(res_a, rule="delta", negative_eigenvalues=False, keys=kr)
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
                    for i in _chain_index(res_a, rule=rule, negative_eigenvalues=neg, keys=kr)
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
                ix = _chain_index(res_b, rule=rule, keys=kr, betas=br)
                parts.append(f"beta {br}: {_summ(res_b, precs, ix)}")
            out.append(
                f"(2) {rule} with negative eigenvalues, {kr} keys, T = {cfg.pinned_steps}. "
                + ". ".join(parts)
                + "."
            )
    return out


def _layer_section(cfg: StudyConfig, out: Path, data: dict) -> list[str]:
    """mu per head of a trained checkpoint on a text. Guarded: any failure becomes a note."""
    md = ["## 4. A trained model's actual mu per head", ""]
    if not (cfg.checkpoint and cfg.text):
        return md + ["Skipped: pass --checkpoint DIR and --text FILE.", ""]
    try:
        from deltaflow.models import DeltaFlowForCausalLM
        from deltaflow.tasks.language import get_tokenizer

        model = DeltaFlowForCausalLM.from_pretrained(cfg.checkpoint).eval()
        tok = get_tokenizer(cfg.tokenizer)
        text = Path(cfg.text).read_text(encoding="utf-8", errors="replace")
        ids = torch.tensor([tok.encode(text)[: cfg.max_tokens]], dtype=torch.long)
        if ids.shape[1] == 0:
            raise ValueError(f"text file {cfg.text} produced no tokens")
        layers = spectrum.layer_eigenvalues(model, ids)
    except Exception as e:  # a broken checkpoint must not lose the rest of the study
        return md + [f"Failed: `{type(e).__name__}: {e}`", ""]
    rows = spectrum.layer_mu_table(layers)
    spectrum.plot_layer_mu(layers, str(out / "layer_mu.png"))
    data["layer"] = rows
    return md + [
        f"Checkpoint `{cfg.checkpoint}`, {ids.shape[1]} tokens of `{cfg.text}`. mu excludes the",
        "decay alpha (which only shrinks it).",
        "",
        "![layer mu](layer_mu.png)",
        "",
        _table(
            [
                "layer",
                "head",
                "rule",
                "min",
                "p01",
                "median",
                "p99",
                "max",
                "frac abs>1",
                "median ‖k‖",
            ],
            [
                [
                    r["layer"],
                    r["head"],
                    r["rule"],
                    _fmt(r["mu_min"]),
                    _fmt(r["mu_p01"]),
                    _fmt(r["mu_median"]),
                    _fmt(r["mu_p99"]),
                    _fmt(r["mu_max"]),
                    _fmt(r["frac_unstable"]),
                    _fmt(r["key_norm_median"]),
                ]
                for r in rows
            ],
        ),
        "",
    ]
