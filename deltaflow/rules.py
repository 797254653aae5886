"""Step rules: how one online-regression step on ``min_S ½‖Sᵀk − v‖²`` is taken.

Every rule turns the raw gate ``β`` and the squared key norm ``λ = ‖k‖²`` into an erase
strength ``a`` and a write strength ``b`` for the one recurrence (DESIGN.md §1)::

    S_t = α_t (I − a_t k_t k_tᵀ) S_{t−1} + b_t k_t v_tᵀ

The transition has eigenvalue 1 off ``k`` and ``μ = 1 − aλ`` along ``k`` (DESIGN.md §2). For all
built-in rules but ``linear``, ``a = b``, so the new prediction for ``k`` interpolates between the
old one and the target: ``kᵀS_t = μ·kᵀ(αS_{t−1}) + (1 − μ)·vᵀ``.

A user rule is any function ``fn(beta, lam, eps) -> (a, b)`` of tensors; register it with
:func:`register_rule` (or pass a :class:`StepRule` straight to ``delta_rule``) and every backend
that computes coefficients in PyTorch uses it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

CoefficientFn = Callable[[Tensor | None, Tensor, float], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class StepRule:
    """A named step rule: ``coefficients(beta, lam, eps) -> (a, b)``."""

    name: str
    coefficients: CoefficientFn
    needs_beta: bool = True
    description: str = ""
    source: str = ""
    builtin: bool = False  # built-in rules have fused Triton implementations


def _beta_or_one(beta: Tensor | None, lam: Tensor) -> Tensor:
    return torch.ones_like(lam) if beta is None else beta


def _one_minus_exp_neg_over(h: Tensor) -> Tensor:
    """``(1 − e^{−h}) / h`` with its limit 1 at ``h → 0`` and finite gradients everywhere."""
    small = h < 1e-4
    h_safe = torch.where(small, torch.ones_like(h), h)
    series = 1 - h / 2 + h * h / 6  # Taylor expansion, exact to O(h³) near 0
    return torch.where(small, series, -torch.expm1(-h_safe) / h_safe)


def _linear(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.zeros_like(lam), _beta_or_one(beta, lam)


def _delta(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return beta, beta


def _efla(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # a = (1 − e^{−h}) / λ with h = βλ, written as β·(1 − e^{−h})/h so that λ → 0 gives β.
    a = beta * _one_minus_exp_neg_over(beta * lam)
    return a, a


def _longhorn(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    a = beta / (1 + beta * lam)
    return a, a


def _trapezoid(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    a = beta / (1 + beta * lam / 2)
    return a, a


def _kaczmarz(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    a = 1 / (lam + eps)
    return a, a


def _relaxed_kaczmarz(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    a = beta / (lam + eps)
    return a, a


RULES: dict[str, StepRule] = {
    r.name: r
    for r in [
        StepRule(
            "linear",
            _linear,
            False,
            "a = 0, b = β (1 if β is None); μ = 1",
            "linear attention",
            True,
        ),
        StepRule("delta", _delta, True, "a = b = β; μ = 1 − h (explicit Euler)", "DeltaNet", True),
        StepRule(
            "efla",
            _efla,
            True,
            "a = b = (1 − e^{−h})/λ; μ = e^{−h} (exact flow)",
            "EFLA, arXiv 2512.12602",
            True,
        ),
        StepRule(
            "longhorn",
            _longhorn,
            True,
            "a = b = β/(1 + h); μ = 1/(1 + h) (implicit Euler)",
            "Longhorn, arXiv 2407.14207",
            True,
        ),
        StepRule(
            "trapezoid",
            _trapezoid,
            True,
            "a = b = β/(1 + h/2); μ = (1 − h/2)/(1 + h/2) (Crank–Nicolson)",
            "deltaflow (A-stable, reaches (−1, 1))",
            True,
        ),
        StepRule(
            "kaczmarz", _kaczmarz, False, "a = b = 1/(λ + ε); μ ≈ 0 (projection)", "Kaczmarz", True
        ),
        StepRule(
            "relaxed_kaczmarz",
            _relaxed_kaczmarz,
            True,
            "a = b = β/(λ + ε); μ ≈ 1 − β",
            "relaxed Kaczmarz (β = ρ)",
            True,
        ),
    ]
}


def register_rule(
    name: str, coefficients: CoefficientFn, *, needs_beta: bool = True, description: str = ""
) -> StepRule:
    """Add a user rule ``coefficients(beta, lam, eps) -> (a, b)`` under ``name``."""
    if name in RULES and RULES[name].builtin:
        raise ValueError(f"rule name {name!r} is a built-in rule and cannot be replaced")
    rule = StepRule(name, coefficients, needs_beta, description, "user")
    RULES[name] = rule
    return rule


def get_rule(rule: str | StepRule | CoefficientFn) -> StepRule:
    """Resolve a rule name, a :class:`StepRule` or a bare coefficient function."""
    if isinstance(rule, StepRule):
        return rule
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(sorted(RULES))}")
        return RULES[rule]
    if callable(rule):
        name = getattr(rule, "__name__", "custom")
        return StepRule(name, rule, True, "user function", "user")
    raise TypeError(f"rule must be a name, a StepRule or a function, got {type(rule).__name__}")


def step_coefficients(
    rule: str | StepRule | CoefficientFn,
    beta: Tensor | None,
    lam: Tensor,
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Erase and write strengths ``(a, b)`` of ``rule`` for gates ``beta`` and ``lam = ‖k‖²``.

    ``negative_eigenvalues`` doubles both, mapping ``μ`` to ``2μ − 1`` (arXiv 2411.12537).
    """
    step_rule = get_rule(rule)
    if beta is None and step_rule.needs_beta:
        raise ValueError(f"beta is None but rule {step_rule.name!r} needs beta of shape [B, T, H]")
    a, b = step_rule.coefficients(beta, lam, eps)
    if negative_eigenvalues:
        a, b = 2 * a, 2 * b
    return a, b


def eigenvalue(
    rule: str | StepRule | CoefficientFn,
    beta: Tensor | None,
    lam: Tensor,
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Eigenvalue ``μ = 1 − aλ`` of the one-step transition along ``k``."""
    a, _ = step_coefficients(rule, beta, lam, negative_eigenvalues=negative_eigenvalues, eps=eps)
    return 1 - a * lam
