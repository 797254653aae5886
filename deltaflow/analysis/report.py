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
from dataclasses import asdict
from pathlib import Path

import torch

from deltaflow.analysis import discretization as disc
from deltaflow.analysis import spectrum
from deltaflow.analysis.config import StudyConfig
from deltaflow.analysis.growth_section import growth_section
from deltaflow.analysis.layer_section import layer_section
from deltaflow.analysis.op_crosscheck import op_crosscheck
from deltaflow.analysis.verdicts import Verdict, fmt, table, verdict

# StudyConfig, op_crosscheck, verdict and Verdict were defined here: their old home still works
__all__ = ["StudyConfig", "Verdict", "op_crosscheck", "run_study", "verdict"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + os.replace: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be shared
    os.replace(tmp, path)


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
        md += [table(["rule", "neg. eig.", *names], trows), ""]

    if "growth" in cfg.parts:
        md += growth_section(cfg, out, data, findings, progress)

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
            table(
                ["rule", "local slope p", "method order", "error at h=0.01", "max error"],
                [
                    [
                        r["rule"],
                        "exact" if r["exact"] else f"{r['local_order']:.2f}",
                        "exact" if r["exact"] else f"{r['method_order']:.2f}",
                        fmt(r["err_at_h=0.01"]),
                        fmt(r["max_err"]),
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
        md += layer_section(cfg, out, data)

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
