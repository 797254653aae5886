"""How well each rule's one-token transition approximates the exact flow exp(-beta kk^T).

delta, efla, longhorn and trapezoid all step the ODE dS/dtau = -kk^T S + k v^T through a "time"
beta. Per token, the homogeneous part of the exact solution is exp(-beta kk^T); each rule replaces
it with I - a kk^T. We build both matrices in float64 for a key of chosen norm, sweep the step
h = beta*||k||^2, and fit the slope p of log(error) against log(h) for small h: the local error
is O(h^p), so the method is of order p - 1 (delta and longhorn: first order, trapezoid: second,
efla: exact). The kaczmarz rules normalize the step by ||k||^2, so they are not consistent
discretizations of this ODE (error O(1) or O(h)); we report their slope all the same.
negative_eigenvalues is left out on purpose: it doubles a, which is not a step of this flow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from deltaflow.rules import step_coefficients

# Errors below this are float64 round-off, not discretization error: excluded from the fit.
ROUNDOFF = 1e-13


def transition_errors(
    rule: str,
    h: torch.Tensor,
    *,
    dk: int = 8,
    lam: float = 2.0,
    eps: float = 1e-6,
    seed: int = 0,
) -> torch.Tensor:
    """Spectral-norm error ||(I - a kk^T) - matrix_exp(-beta kk^T)||_2 for each h (float64).

    k is a random direction scaled to ||k||^2 = lam (lam != 1 so that relaxed_kaczmarz, which
    divides by lam, is distinguishable from delta); beta = h / lam.
    """
    if lam <= 0:
        raise ValueError(f"lam (= ||k||^2) must be > 0, got {lam}")
    h = torch.as_tensor(h, dtype=torch.float64).reshape(-1)
    if (h <= 0).any():
        raise ValueError("h must be > 0")
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(dk, generator=g, dtype=torch.float64)
    k = k / k.norm() * math.sqrt(lam)
    kk = torch.outer(k, k)
    eye = torch.eye(dk, dtype=torch.float64)
    beta = h / lam
    a, _ = step_coefficients(rule, beta, torch.full_like(beta, lam), eps=eps)
    approx = eye - a[:, None, None] * kk  # [n, dk, dk]
    exact = torch.linalg.matrix_exp(-beta[:, None, None] * kk)
    return torch.linalg.matrix_norm(approx - exact, ord=2)


def fit_order(h: torch.Tensor, err: torch.Tensor, h_max: float = 0.1) -> float:
    """Least-squares slope of log(err) against log(h) over h <= h_max and err > ROUNDOFF;
    nan if fewer than 3 points qualify (e.g. an exact rule)."""
    h = torch.as_tensor(h, dtype=torch.float64)
    err = torch.as_tensor(err, dtype=torch.float64)
    m = (h <= h_max) & (err > ROUNDOFF)
    if int(m.sum()) < 3:
        return math.nan
    x, y = h[m].log(), err[m].log()
    x0, y0 = x - x.mean(), y - y.mean()
    return float((x0 * y0).sum() / (x0 * x0).sum())


def discretization_study(
    rules: Sequence[str],
    *,
    h_min: float = 1e-3,
    h_max: float = 10.0,
    points: int = 41,
    fit_h_max: float = 0.1,
    dk: int = 8,
    lam: float = 2.0,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict]]:
    """Errors for every rule on a log grid of h, and one summary row per rule."""
    h = torch.logspace(math.log10(h_min), math.log10(h_max), points, dtype=torch.float64)
    errs, rows = {}, []
    for rule in rules:
        e = transition_errors(rule, h, dk=dk, lam=lam, seed=seed)
        errs[rule] = e
        p = fit_order(h, e, fit_h_max)
        i_small = int((h - 1e-2).abs().argmin())
        rows.append(
            {
                "rule": rule,
                "local_order": p,
                "method_order": p - 1 if not math.isnan(p) else math.nan,
                "max_err": float(e.max()),
                "err_at_h=0.01": float(e[i_small]),
                "exact": bool(e.max() <= ROUNDOFF),
            }
        )
    return h, errs, rows


def plot_discretization(
    h: torch.Tensor, errs: dict[str, torch.Tensor], rows: list[dict], path: str
) -> None:
    """Log-log error against h with the fitted local orders in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {r["rule"]: r for r in rows}
    fig, ax = plt.subplots(figsize=(7, 5))
    for rule, e in errs.items():
        r = order[rule]
        tag = "exact" if r["exact"] else f"slope {r['local_order']:.2f}"
        ax.loglog(h.numpy(), e.clamp_min(1e-17).numpy(), "o-", ms=3, label=f"{rule} ({tag})")
    for p, ls in ((2, ":"), (3, "--")):
        ref = h**p * 0.5
        ax.loglog(h.numpy(), ref.numpy(), ls, color="gray", lw=0.8, label=f"h^{p}")
    ax.axhline(ROUNDOFF, color="k", lw=0.5)
    ax.set_ylim(1e-17, 10)
    ax.set_xlabel("h = beta * ||k||^2")
    ax.set_ylabel("||(I - a kk^T) - exp(-beta kk^T)||_2")
    ax.set_title(
        "One-token transition vs exact flow (local error O(h^p): method order p - 1)", fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
