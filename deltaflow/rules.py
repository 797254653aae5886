"""Step rules: how one online-regression step on ``min_S ½‖Sᵀk − v‖²`` is taken.

Every rule turns the raw gate ``β`` and the squared key norm ``λ = ‖k‖²`` into an erase
strength ``a`` and a write strength ``b`` for the one recurrence (docs/design.md §1)::

    S_t = α_t (I − a_t k_t k_tᵀ) S_{t−1} + b_t k_t v_tᵀ

The transition has eigenvalue 1 off ``k`` and ``μ = 1 − aλ`` along ``k`` (docs/design.md §2).
For all built-in rules but ``linear``, ``a = b``, so the new prediction for ``k`` interpolates
between the old one and the target: ``kᵀS_t = μ·kᵀ(αS_{t−1}) + (1 − μ)·vᵀ``.

A rule may also read the decay: the paper form of gated EFLA (``gated_efla``) solves the gated
ODE exactly, so its ``(a, b)`` depend on ``α`` and it hands the op a transformed decay. Such a
rule has ``decay_coefficients(beta, lam, log_decay, eps) -> (a, b, op_log_decay)``;
:func:`step_inputs` is what every PyTorch backend calls and covers both kinds.

A user rule is any function ``fn(beta, lam, eps) -> (a, b)`` of tensors; register it with
:func:`register_rule` (or pass a :class:`StepRule` straight to ``delta_rule``) and every backend
that computes coefficients in PyTorch uses it unchanged. A built-in rule is defined here once
(coefficients, the q/k normalization it expects, the id of its in-kernel form) and has one entry
in the Triton rule table, ``deltaflow/ops/triton/rules.py``; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

CoefficientFn = Callable[[Tensor | None, Tensor, float], tuple[Tensor, Tensor]]
# (beta, lam, log_decay, eps) -> (a, b, the op's log decay): rules whose strengths read the decay
DecayCoefficientFn = Callable[[Tensor | None, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]
QK_NORMS = ("l2", "none")


@dataclass(frozen=True)
class StepRule:
    """A step rule, defined in one place.

    Attributes:
        name: the name ``delta_rule(rule=...)`` and the configs use.
        coefficients: ``(beta, lam, eps) -> (a, b)`` on tensors: the rule's definition, used by
            every PyTorch backend (and, through autograd, for its derivatives).
        needs_beta: whether ``beta`` is read (``linear`` and ``kaczmarz`` accept ``None``).
        qk_norm: the ``(q, k)`` normalization ``DeltaAttention`` applies by default, ``'l2'``
            or ``'none'`` each: rules whose ``μ`` leaves ``[−1, 1]`` for large ``λ`` (``delta``,
            ``linear``) expect unit keys; the others keep ``‖k‖`` (docs/design.md §4).
        kernel_id: the id of the rule's in-kernel form in the Triton rule table
            (``deltaflow/ops/triton/rules.py``); ``None`` for rules that run in PyTorch only.
            The table's entry reads the decay exactly where the rule does (its ``DECAY_MAPS``;
            a mismatch is refused at launch).
        decay_coefficients: for rules whose strengths read the decay (``gated_efla``):
            ``(beta, lam, log_decay, eps) -> (a, b, op_log_decay)``, where ``log_decay`` is the
            layer's gate and ``op_log_decay`` the ``log α`` of the op's recurrence (1). Used
            whenever a decay is given; ``coefficients`` is the rule at ``α = 1``.
        description, source: one line each, for tables and ``--help``.
        negative_mu: whether the rule's own ``μ`` goes below 0 for large ``h`` (``trapezoid``:
            ``μ → −1``); ``negative_eigenvalues`` (``μ → 2μ − 1``) then leaves ``[−1, 1]``, and
            the op warns. Tested against the rule's maths (tests/test_one_source.py).
    """

    name: str
    coefficients: CoefficientFn
    needs_beta: bool = True
    qk_norm: tuple[str, str] = ("l2", "l2")
    kernel_id: int | None = None
    description: str = ""
    source: str = ""
    decay_coefficients: DecayCoefficientFn | None = None
    negative_mu: bool = False

    def check_decay(self, has_decay: bool, fix: str) -> None:
        """The one answer, for the op and the layer alike, to a rule that reads the decay
        (``decay_coefficients``) given none: refused with ``fix`` (what the caller must set).
        Without a decay it would run as another rule (``gated_efla`` at α = 1 is ``efla``),
        so results named after it would be that other rule's."""
        if self.decay_coefficients is not None and not has_decay:
            raise ValueError(
                f"rule {self.name!r} reads the decay: {fix} (without a decay it is another "
                "rule: gated_efla at alpha = 1 is rule 'efla')"
            )

    @property
    def has_triton(self) -> bool:
        """Whether the rule has a fused Triton form (a ``kernel_id``): the Triton backend runs
        exactly these (see :func:`triton_rules`)."""
        return self.kernel_id is not None


def _beta_or_one(beta: Tensor | None, lam: Tensor) -> Tensor:
    return torch.ones_like(lam) if beta is None else beta


# EFLA's strength is a = β·φ(h), φ(h) = (1 − e^{−h})/h, h = βλ. The closed form is 0/0 at h = 0,
# and its derivative φ'(h) = (e^{−h}(1 + h) − 1)/h² cancels for small h. So below one cut-off
# φ (and φ', in the Triton table) is a Taylor series, above it the closed form. The bound that
# fixes both numbers: for 0 ≤ h < 1 both series alternate with decreasing terms, so cutting φ
# after 20 terms errs by less than the first dropped term, h^20/21! < 2e-20, and φ' after 19 by
# less than 20·h^19/21! < 4e-19 (φ ≥ 0.63 and |φ'| ≥ 0.26 there): below float64's 1.1e-16.
# Above the cut-off, -expm1 is exact to an ulp, and what cancellation is left costs at most
# ~ε/h in φ and ~4ε/h² in φ': at h ≥ 1 a few ulp (float32: ≤ 1.2e-7 and 4.8e-7). A lower
# cut-off would need fewer terms but leave float32's φ' up to 4ε/h² = 4.8e-5 at h = 0.1.
EFLA_SERIES_CUTOFF = 1.0
EFLA_SERIES_TERMS = 20


def efla_phi(h: Tensor) -> Tensor:
    """``φ(h) = (1 − e^{−h})/h`` with ``φ(0) = 1``, accurate (value and autograd derivative)
    for every ``h ≥ 0``: the Taylor series below :data:`EFLA_SERIES_CUTOFF`, else the closed
    form. ``φ = 1 − (h/2)(1 − (h/3)(1 − …))``, the ratio of term n to term n − 1 being −h/(n+1)."""
    small = h < EFLA_SERIES_CUTOFF
    h_series = torch.where(small, h, torch.zeros_like(h))  # finite gradients on both branches
    h_closed = torch.where(small, torch.ones_like(h), h)
    series = torch.ones_like(h)
    for n in range(EFLA_SERIES_TERMS - 1, 0, -1):
        series = 1 - h_series / (n + 1) * series
    return torch.where(small, series, -torch.expm1(-h_closed) / h_closed)


def _linear(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.zeros_like(lam), _beta_or_one(beta, lam)


def _delta(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return beta, beta


def _efla(beta: Tensor | None, lam: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # a = (1 − e^{−h}) / λ with h = βλ, written as β·φ(h) so that λ → 0 gives β.
    a = beta * efla_phi(beta * lam)
    return a, a


def gated_efla_op_log_decay(log_decay: Tensor) -> Tensor:
    """Gated EFLA's decay in the one recurrence (1): ``log α_op = −(1 − α) = expm1(log α)`` of
    the layer's ``log α``. The Triton backend applies it on the host (the rule table's entry
    reads its result: deltaflow/ops/triton/rules.py, ``DECAY_MAPS``)."""
    return torch.expm1(log_decay)


def _gated_efla(
    beta: Tensor | None, lam: Tensor, log_decay: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    # The EFLA paper's gated form (appendix D): the gated delta step
    # S_t = α(I − β kkᵀ)S + β kvᵀ is one explicit Euler step of
    # dS/dτ = −(1 − α)S − αβ kkᵀS + β kvᵀ; its exact solution over τ ∈ [0, 1] is
    # S_t = e^{−(1−α)} (I − (1 − e^{−αβλ})/λ · kkᵀ) S_{t−1} + β(1 − e^{−η})/η · k vᵀ,
    # η = (1 − α) + αβλ. In the one recurrence (1): the op's decay is e^{−(1−α)}, the erase
    # strength is EFLA's at step αβ, the write strength β·φ(η) (docs/design.md §2).
    alpha = torch.exp(log_decay)
    op_log_decay = gated_efla_op_log_decay(log_decay)
    leak = -op_log_decay  # 1 − α, exact for α near 1
    step = alpha * beta
    a = step * efla_phi(step * lam)
    b = beta * efla_phi(leak + step * lam)
    return a, b, op_log_decay


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


UNIT_KEYS = ("l2", "l2")  # q and k L2-normalized by the layer
RAW_KEYS = ("l2", "none")  # q normalized, k's norm kept: the rule uses it

# The built-in rules. Each one's in-kernel form is the entry of the same kernel_id in
# deltaflow/ops/triton/rules.py; a new built-in rule is a line here, an entry there, and tests.
RULES: dict[str, StepRule] = {
    r.name: r
    for r in [
        StepRule(
            "linear",
            _linear,
            needs_beta=False,
            qk_norm=UNIT_KEYS,
            kernel_id=0,
            description="a = 0, b = β (1 if β is None); μ = 1",
            source="linear attention",
        ),
        StepRule(
            "delta",
            _delta,
            qk_norm=UNIT_KEYS,
            kernel_id=1,
            description="a = b = β; μ = 1 − h (explicit Euler)",
            source="DeltaNet",
        ),
        StepRule(
            "efla",
            _efla,
            qk_norm=RAW_KEYS,
            kernel_id=2,
            description="a = b = (1 − e^{−h})/λ; μ = e^{−h} (exact flow)",
            source="EFLA, arXiv 2512.12602",
        ),
        StepRule(
            "gated_efla",
            _efla,  # at α = 1 (no decay) it is EFLA
            qk_norm=RAW_KEYS,
            kernel_id=7,  # its entry reads the op's decay (the table's DECAY_MAPS)
            description=(
                "gated EFLA, paper form: decay e^{−(1−α)}, a = (1 − e^{−αh})/λ, "
                "b = β(1 − e^{−η})/η, η = 1 − α + αh"
            ),
            source="EFLA, arXiv 2512.12602, appendix D",
            decay_coefficients=_gated_efla,
        ),
        StepRule(
            "longhorn",
            _longhorn,
            qk_norm=RAW_KEYS,
            kernel_id=3,
            description="a = b = β/(1 + h); μ = 1/(1 + h) (implicit Euler)",
            source="Longhorn, arXiv 2407.14207",
        ),
        StepRule(
            "trapezoid",
            _trapezoid,
            qk_norm=RAW_KEYS,
            kernel_id=4,
            description="a = b = β/(1 + h/2); μ = (1 − h/2)/(1 + h/2) (Crank–Nicolson)",
            source="deltaflow (A-stable, reaches (−1, 1))",
            negative_mu=True,
        ),
        StepRule(
            "kaczmarz",
            _kaczmarz,
            needs_beta=False,
            qk_norm=RAW_KEYS,
            kernel_id=5,
            description="a = b = 1/(λ + ε); μ ≈ 0 (projection)",
            source="Kaczmarz",
        ),
        StepRule(
            "relaxed_kaczmarz",
            _relaxed_kaczmarz,
            qk_norm=RAW_KEYS,
            kernel_id=6,
            description="a = b = β/(λ + ε); μ ≈ 1 − β",
            source="relaxed Kaczmarz (β = ρ)",
        ),
    ]
}


def register_rule(
    name: str,
    coefficients: CoefficientFn,
    *,
    needs_beta: bool = True,
    qk_norm: tuple[str, str] = UNIT_KEYS,
    description: str = "",
) -> StepRule:
    """Add a user rule ``coefficients(beta, lam, eps) -> (a, b)`` under ``name`` (it runs on the
    PyTorch backends; ``qk_norm`` is the layer's default (q, k) normalization for it)."""
    if name in RULES and RULES[name].source != "user":
        raise ValueError(f"rule name {name!r} is a built-in rule and cannot be replaced")
    if len(qk_norm) != 2 or any(n not in QK_NORMS for n in qk_norm):
        raise ValueError(f"qk_norm must be a (q, k) pair of {QK_NORMS}, got {qk_norm!r}")
    rule = StepRule(
        name,
        coefficients,
        needs_beta=needs_beta,
        qk_norm=tuple(qk_norm),
        description=description,
        source="user",
    )
    RULES[name] = rule
    return rule


def triton_rules() -> list[str]:
    """The names of the rules the Triton backend runs, sorted: every script and test that loops
    over Triton rules asks here instead of assuming all of :data:`RULES`."""
    return sorted(name for name, rule in RULES.items() if rule.has_triton)


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
        return StepRule(name, rule, description="user function", source="user")
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
    if step_rule.source == "user":
        _check_user_coefficients(step_rule.name, a, b, lam)
    if negative_eigenvalues:
        a, b = 2 * a, 2 * b
    return a, b


def _check_user_coefficients(name: str, a: Tensor, b: Tensor, lam: Tensor) -> None:
    """What a user's rule function returns: two tensors of ``lam``'s shape [B, T, H], finite
    (a NaN would spread through the state silently). Built-in rules are tested instead."""
    for label, x in (("a", a), ("b", b)):
        if not isinstance(x, Tensor) or x.shape != lam.shape:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"rule {name!r} must return (a, b) tensors of shape {list(lam.shape)} "
                f"([B, T, H], like beta), got {label} {got}"
            )
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"rule {name!r} returned NaN or inf in {label}")


def step_inputs(
    rule: str | StepRule | CoefficientFn,
    beta: Tensor | None,
    lam: Tensor,
    log_decay: Tensor | None,
    *,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(a, b, log α)`` of the op's recurrence (1) for the layer's gates ``beta`` and
    ``log_decay`` (None: no decay) and ``lam = ‖k‖²``: what every PyTorch backend computes.

    For most rules the decay passes through unchanged and ``(a, b)`` is
    :func:`step_coefficients`; a rule with ``decay_coefficients`` (``gated_efla``) maps the
    layer's decay to its own ``(a, b, log α)``. ``negative_eigenvalues`` doubles ``a`` and ``b``.
    """
    step_rule = get_rule(rule)
    if log_decay is None or step_rule.decay_coefficients is None:
        a, b = step_coefficients(
            step_rule, beta, lam, negative_eigenvalues=negative_eigenvalues, eps=eps
        )
        return a, b, log_decay
    if beta is None and step_rule.needs_beta:
        raise ValueError(f"beta is None but rule {step_rule.name!r} needs beta of shape [B, T, H]")
    a, b, op_log_decay = step_rule.decay_coefficients(beta, lam, log_decay, eps)
    if negative_eigenvalues:
        a, b = 2 * a, 2 * b
    return a, b, op_log_decay


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
