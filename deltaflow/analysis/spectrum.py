"""Eigenvalue of each step rule's transition along k, and of a trained layer's real inputs.

The transition `I - a kk^T` has eigenvalue 1 on the complement of k and mu = 1 - a*lam along k
(lam = ||k||^2). The state stays bounded over long products only if |mu| <= 1, so mu is the one
number that decides stability. Everything here goes through `deltaflow.rules`, so a rule
registered by the user is analysed exactly like the built-in ones.

Parametrization. delta, efla, longhorn and trapezoid depend on (beta, lam) only through the step
h = beta*lam; kaczmarz and relaxed_kaczmarz normalize by lam, so their mu depends on beta alone
(and on lam only through eps). `mu_of_h` therefore evaluates every rule at lam = 1, beta = h (where
both views coincide), and `mu_of_norm` sweeps ||k|| at fixed beta, which is the view that shows
why raw keys break DeltaNet but not the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from deltaflow.rules import RULES, eigenvalue

# Rules whose mu depends on beta*lam (ODE steppers) rather than on beta alone (normalized steps).
H_RULES = ("delta", "efla", "longhorn", "trapezoid")


def default_rules() -> list[str]:
    """The rules the stability study compares, from :data:`RULES`: every registered rule but
    ``linear`` (mu = 1 always: nothing to see) and the rules that read the decay (the study runs
    without one, where ``gated_efla`` is ``efla``: the same rows twice)."""
    return [
        name for name, rule in RULES.items() if name != "linear" and rule.decay_coefficients is None
    ]


def rule_mu(
    rule,
    beta: torch.Tensor | float,
    lam: torch.Tensor | float,
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """mu = 1 - a*lam for `rule` (a name or a StepRule) at (beta, lam), broadcast, in float64."""
    beta_t = torch.as_tensor(beta, dtype=torch.float64)
    lam_t = torch.as_tensor(lam, dtype=torch.float64)
    if (lam_t < 0).any():
        raise ValueError("lam (= ||k||^2) must be >= 0")
    beta_t, lam_t = torch.broadcast_tensors(beta_t, lam_t)
    return eigenvalue(rule, beta_t, lam_t, negative_eigenvalues=negative_eigenvalues, eps=eps)


def mu_of_h(
    rule: str, h: torch.Tensor, *, negative_eigenvalues: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """mu as a function of the step h = beta*lam, evaluated at lam = 1 (so beta = h)."""
    h = torch.as_tensor(h, dtype=torch.float64)
    if (h < 0).any():
        raise ValueError("h = beta*||k||^2 must be >= 0")
    return rule_mu(rule, h, torch.ones_like(h), negative_eigenvalues=negative_eigenvalues, eps=eps)


def mu_of_norm(
    rule: str,
    norm: torch.Tensor,
    beta: float,
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """mu as a function of the key norm ||k|| (lam = norm^2) at a fixed beta."""
    norm = torch.as_tensor(norm, dtype=torch.float64)
    return rule_mu(
        rule,
        torch.full_like(norm, beta),
        norm**2,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
    )


def mu_range(
    rule: str,
    beta_range: tuple[float, float] = (0.0, 1.0),
    norm_range: tuple[float, float] = (1.0, 1.0),
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
    points: int = 401,
) -> tuple[float, float]:
    """(min mu, max mu) over a dense grid of beta in beta_range and ||k|| in norm_range.

    The grid includes both ends of each range, so for the monotone rules here the extremes are
    exact; the norm axis is log-spaced when the range spans more than a factor of 10.
    """
    b0, b1 = beta_range
    n0, n1 = norm_range
    if not (b0 <= b1 and n0 <= n1 and b0 >= 0 and n0 >= 0):
        raise ValueError(
            f"need 0 <= lo <= hi, got beta_range={beta_range}, norm_range={norm_range}"
        )
    betas = torch.linspace(b0, b1, points, dtype=torch.float64)
    if n0 > 0 and n1 / n0 > 10:
        norms = torch.logspace(math.log10(n0), math.log10(n1), points, dtype=torch.float64)
    else:
        norms = torch.linspace(n0, n1, points, dtype=torch.float64)
    mu = rule_mu(
        rule,
        betas[:, None],
        norms[None, :] ** 2,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
    )
    return float(mu.min()), float(mu.max())


def spectrum_table(
    rules: Sequence[str],
    regimes: dict[str, tuple[tuple[float, float], tuple[float, float]]],
    *,
    eps: float = 1e-6,
) -> list[dict]:
    """One row per (rule, negative_eigenvalues, regime): mu range and whether it is in [-1, 1].

    `regimes` maps a name to (beta_range, norm_range).
    """
    rows = []
    for rule in rules:
        for neg in (False, True):
            for name, (br, nr) in regimes.items():
                lo, hi = mu_range(rule, br, nr, negative_eigenvalues=neg, eps=eps)
                rows.append(
                    {
                        "rule": rule,
                        "negative_eigenvalues": neg,
                        "regime": name,
                        "beta_range": list(br),
                        "norm_range": list(nr),
                        "mu_min": lo,
                        "mu_max": hi,
                        # Tiny slack: mu = -1 exactly (a pure reflection) counts as in range.
                        "stable": lo >= -1 - 1e-12 and hi <= 1 + 1e-12,
                    }
                )
    return rows


def plot_spectrum(
    rules: Sequence[str],
    path: str,
    *,
    h_max: float = 4.0,
    norm_range: tuple[float, float] = (0.1, 10.0),
    beta_for_norm: float = 0.9,
    eps: float = 1e-6,
) -> None:
    """2x2 PNG: mu against h (lam = 1) and against ||k|| (beta fixed), with and without
    negative eigenvalues; the stable band [-1, 1] shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = torch.linspace(0, h_max, 801, dtype=torch.float64)
    norms = torch.logspace(math.log10(norm_range[0]), math.log10(norm_range[1]), 801)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharey=True)
    for row, neg in enumerate((False, True)):
        for col in range(2):
            ax = axes[row, col]
            for rule in rules:
                if col == 0:
                    x, mu = h, mu_of_h(rule, h, negative_eigenvalues=neg, eps=eps)
                else:
                    x = norms
                    mu = mu_of_norm(rule, norms, beta_for_norm, negative_eigenvalues=neg, eps=eps)
                style = "-" if rule in H_RULES else "--"
                ax.plot(x.numpy(), mu.clamp(-3.5, 1.5).numpy(), style, label=rule, lw=1.8)
            ax.axhspan(-1, 1, color="tab:green", alpha=0.08)
            ax.axhline(1, color="k", lw=0.6)
            ax.axhline(-1, color="k", lw=0.6)
            ax.set_ylim(-3.2, 1.3)
            tag = "negative_eigenvalues=True (mu -> 2mu-1)" if neg else "negative_eigenvalues=False"
            if col == 0:
                ax.set_xlabel("h = beta * ||k||^2   (evaluated at ||k|| = 1, beta = h)")
                ax.set_title(f"mu vs step h; {tag}", fontsize=10)
                ax.set_ylabel("mu (eigenvalue along k)")
            else:
                ax.set_xscale("log")
                ax.set_xlabel(f"||k||   (beta = {beta_for_norm})")
                ax.set_title(f"mu vs key norm; {tag}", fontsize=10)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower left")
    fig.suptitle(
        "Eigenvalue of I - a kk^T along k (shaded: stable band [-1, 1]; curves clipped at -3.5).\n"
        "Dashed rules (kaczmarz family) depend on beta, not on h: at ||k|| = 1 they read beta = h.",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# A trained layer's real inputs. Kept small and guarded: it only needs a model whose layers call
# the public op `deltaflow.delta_rule`; we intercept those calls and read (k, beta) off them.
# ---------------------------------------------------------------------------------------------


class _OpRecorder:
    """Context manager that wraps `delta_rule` wherever deltaflow.layers imported it, recording
    (rule, k, beta, negative_eigenvalues, eps) of every call, in call order (= layer order)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._patched: list[tuple[object, object]] = []

    def __enter__(self) -> _OpRecorder:
        import sys

        import deltaflow

        original = deltaflow.delta_rule

        def recording(q, k, v, beta=None, **kw):
            self.calls.append(
                {
                    "rule": kw.get("rule", "delta"),
                    "k": k.detach().float().cpu(),
                    "beta": None if beta is None else beta.detach().float().cpu(),
                    "negative_eigenvalues": kw.get("negative_eigenvalues", False),
                    "eps": kw.get("eps", 1e-6),
                }
            )
            return original(q, k, v, beta, **kw)

        # Patch every deltaflow module that holds a reference to the op under its public name.
        for name, mod in list(sys.modules.items()):
            if name.startswith("deltaflow") and getattr(mod, "delta_rule", None) is original:
                self._patched.append((mod, original))
                mod.delta_rule = recording
        return self

    def __exit__(self, *exc) -> None:
        for mod, original in self._patched:
            mod.delta_rule = original


@torch.no_grad()
def layer_eigenvalues(model: torch.nn.Module, input_ids: torch.Tensor) -> list[dict]:
    """Run `model(input_ids)` and return, per delta-rule layer (in call order), the rule and the
    per-head eigenvalues mu [T*B, H] of every token's transition, computed from the layer's
    actual k and beta (float64)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    with _OpRecorder() as rec:
        model(input_ids)
    if not rec.calls:
        raise RuntimeError(
            "the model made no call to deltaflow.delta_rule; cannot read its (k, beta)"
        )
    out = []
    for i, c in enumerate(rec.calls):
        k = c["k"].double()  # [B, T, H, Dk]
        lam = (k * k).sum(-1)
        beta = torch.ones_like(lam) if c["beta"] is None else c["beta"].double()
        mu = rule_mu(c["rule"], beta, lam, negative_eigenvalues=c["negative_eigenvalues"])
        out.append(
            {
                "layer": i,
                "rule": getattr(c["rule"], "name", c["rule"]),  # layers may pass a StepRule
                "negative_eigenvalues": bool(c["negative_eigenvalues"]),
                "mu": mu.reshape(-1, mu.shape[-1]),
                "key_norm": lam.sqrt().reshape(-1, lam.shape[-1]),
            }
        )
    return out


def layer_mu_table(layers: list[dict]) -> list[dict]:
    """Quantiles of mu per (layer, head) and the fraction of tokens with |mu| > 1."""
    qs = torch.tensor([0.0, 0.01, 0.5, 0.99, 1.0], dtype=torch.float64)
    rows = []
    for lay in layers:
        mu = lay["mu"]
        for hd in range(mu.shape[1]):
            m = mu[:, hd]
            q = torch.quantile(m, qs).tolist()
            rows.append(
                {
                    "layer": lay["layer"],
                    "head": hd,
                    "rule": lay["rule"],
                    "mu_min": q[0],
                    "mu_p01": q[1],
                    "mu_median": q[2],
                    "mu_p99": q[3],
                    "mu_max": q[4],
                    "frac_unstable": float((m.abs() > 1).double().mean()),
                    "key_norm_median": float(lay["key_norm"][:, hd].median()),
                }
            )
    return rows


def plot_layer_mu(layers: list[dict], path: str) -> None:
    """Violin plot of mu per head, one panel per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(layers)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n), squeeze=False)
    for ax, lay in zip(axes[:, 0], layers):
        mu = lay["mu"].float().numpy()
        ax.violinplot([mu[:, h] for h in range(mu.shape[1])], showextrema=True, showmedians=True)
        ax.axhspan(-1, 1, color="tab:green", alpha=0.08)
        ax.set_ylabel("mu")
        ax.set_title(f"layer {lay['layer']} ({lay['rule']}): mu per head", fontsize=10)
        ax.set_xlabel("head")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
