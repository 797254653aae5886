"""The Triton rule table: every built-in rule's in-kernel form, strengths and derivatives in
one place, selected by the ``kernel_id`` its :class:`~deltaflow.rules.StepRule` declares.

Each entry computes, elementwise from ``β``, ``λ = ‖k‖²`` and ``ε``, the erase and write
strengths ``(a, b)`` of ``deltaflow/rules.py`` and their four partial derivatives (the fused
backward's dβ and dλ, docs/design.md §7). A rule whose strengths read the decay (``gated_efla``)
also reads ``g``, the op's log α (the one the kernels' recurrence uses: the host maps the layer's
to it first, :data:`DECAY_MAPS`), and gives ``∂a/∂g``, ``∂b/∂g``, which the backward adds to
d log α; every other entry ignores ``g`` (both zero). The kernels call :func:`strengths` and
:func:`derivatives` with the id as a runtime argument: one compiled kernel per head size and
dtype serves every rule. An id without an entry gives NaN, and :func:`check_kernel_id` refuses
it before any launch, so a forgotten rule can never run another.

Adding a built-in rule: its :class:`StepRule` in ``deltaflow/rules.py`` (with a new
``kernel_id``), its entry here (a function and a branch in :func:`_table`), and tests
(``tests/test_rule_table.py`` checks every entry's derivatives against autograd of the rule's
PyTorch definition; the op tests run every rule of ``RULES``). Nothing else names a rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaflow.rules import (
    EFLA_SERIES_CUTOFF,
    EFLA_SERIES_TERMS,
    RULES,
    gated_efla_op_log_decay,
)


def _id(name: str) -> tl.constexpr:
    return tl.constexpr(RULES[name].kernel_id)


LINEAR = _id("linear")
DELTA = _id("delta")
EFLA = _id("efla")
GATED_EFLA = _id("gated_efla")
LONGHORN = _id("longhorn")
TRAPEZOID = _id("trapezoid")
KACZMARZ = _id("kaczmarz")
RELAXED_KACZMARZ = _id("relaxed_kaczmarz")
# The ids this table implements (what check_kernel_id accepts).
KERNEL_IDS = tuple(
    i.value
    for i in (LINEAR, DELTA, EFLA, GATED_EFLA, LONGHORN, TRAPEZOID, KACZMARZ, RELAXED_KACZMARZ)
)
# The entries whose erase strength a does not read λ (∂a/∂λ = 0 at every β, λ: the backward's
# dk then has no term in kᵀdX), for which the lean key side splits its key block
# (gradients_lean.key_blocks). tests/test_rule_table.py checks this against the definitions.
ERASE_FREE_OF_NORM = (LINEAR.value, DELTA.value)
# The entries that read the decay: the map from the layer's log α to the op's (the rule's own
# definition in deltaflow/rules.py) and its derivative, both applied on the host (triton_backend)
# around the kernels, which see the op's log α only: in the recurrence and in the entry.
DECAY_MAPS = {GATED_EFLA.value: (gated_efla_op_log_decay, torch.exp)}

# EFLA's series: the same cut-off and length as deltaflow.rules.efla_phi (the bound is there).
SERIES_CUTOFF = tl.constexpr(EFLA_SERIES_CUTOFF)
SERIES_TERMS = tl.constexpr(EFLA_SERIES_TERMS)


def check_kernel_id(kernel_id: int | None, name: str, *, reads_decay: bool) -> int:
    """The id to launch with, or a ValueError naming the rule that has no Triton form, or whose
    id's entry reads the decay where the rule does not (``reads_decay``: its
    ``decay_coefficients``), or the other way round: the two backends would run other maths."""
    if kernel_id not in KERNEL_IDS:
        raise ValueError(
            f"rule {name!r} has kernel_id {kernel_id!r}, which the Triton rule table "
            f"(deltaflow/ops/triton/rules.py) does not implement; known ids: {KERNEL_IDS}"
        )
    if (kernel_id in DECAY_MAPS) != reads_decay:
        raise ValueError(
            f"rule {name!r} {'reads' if reads_decay else 'does not read'} the decay, but the "
            f"Triton rule table's entry {kernel_id} {'does not' if reads_decay else 'does'}: "
            "the two backends would compute other strengths"
        )
    return kernel_id


def op_log_decay(kernel_id: int, log_decay: torch.Tensor | None) -> torch.Tensor | None:
    """The recurrence's log α (1) from the layer's: the layer's own, but mapped for an entry
    that reads the decay (:data:`DECAY_MAPS`: gated_efla's ``expm1``), on the host in at least
    fp32. The kernels see the mapped one only, in the recurrence and in the entry; the ops take
    the layer's log α, as the torch backend's ``deltaflow.rules.step_inputs`` does."""
    if log_decay is None or kernel_id not in DECAY_MAPS:
        return log_decay
    op_map, _ = DECAY_MAPS[kernel_id]
    return op_map(log_decay.to(torch.promote_types(log_decay.dtype, torch.float32)))


def layer_log_decay_grad(
    kernel_id: int, dg: torch.Tensor | None, log_decay: torch.Tensor | None
) -> torch.Tensor | None:
    """The gradient of the layer's log α from the kernels' one of the op's (``dg``; the chain
    rule through :func:`op_log_decay`, unchanged for the entries that map nothing)."""
    if dg is None or kernel_id not in DECAY_MAPS:
        return dg
    _, derivative = DECAY_MAPS[kernel_id]
    return dg * derivative(log_decay.to(torch.promote_types(log_decay.dtype, torch.float32)))


# ---------------------------------------------------------------------------------------------
# The entries: (a, b, ∂a/∂β, ∂a/∂λ, ∂b/∂β, ∂b/∂λ), and ∂a/∂g, ∂b/∂g for an entry that reads
# the decay (the table gives the others zeros there). Constant derivatives are written as
# `zero + c` so that every value has β's shape. Unused values cost nothing (the compiler drops
# them: the forward kernels ask for the strengths only).


@triton.jit
def _linear(beta, lam, eps):
    """a = 0, b = β."""
    zero = lam * 0.0
    return zero, beta, zero, zero, zero + 1.0, zero


@triton.jit
def _delta(beta, lam, eps):
    """a = b = β."""
    zero = lam * 0.0
    return beta, beta, zero + 1.0, zero, zero + 1.0, zero


@triton.jit
def _phi_series(h):
    """φ(h) = (1 − e^{−h})/h = 1 − (h/2)(1 − (h/3)(1 − …)), SERIES_TERMS terms."""
    p = h * 0.0 + 1.0
    for n in tl.static_range(SERIES_TERMS - 1, 0, -1):
        p = 1.0 - h * (1.0 / (n + 1)) * p
    return p


@triton.jit
def _dphi_series(h):
    """φ'(h) = −½(1 − h·2/(1·3)(1 − h·3/(2·4)(1 − …))), SERIES_TERMS − 1 terms (the ratio of
    term n to term n − 1 is −h·n/((n − 1)(n + 1)))."""
    p = h * 0.0 + 1.0
    for n in tl.static_range(SERIES_TERMS - 1, 1, -1):
        p = 1.0 - h * (n / ((n - 1) * (n + 1))) * p
    return -0.5 * p


@triton.jit
def _phi_dphi(h):
    """φ(h) and φ'(h) for h ≥ 0: by their series below SERIES_CUTOFF, by the closed forms
    above (error bound: deltaflow/rules.py)."""
    small = h < SERIES_CUTOFF
    h_series = tl.where(small, h, 0.0)
    h_closed = tl.where(small, 1.0, h)
    e = tl.exp(-h_closed)
    phi = tl.where(small, _phi_series(h_series), (1.0 - e) / h_closed)
    dphi_closed = (e * (1.0 + h_closed) - 1.0) / (h_closed * h_closed)
    dphi = tl.where(small, _dphi_series(h_series), dphi_closed)
    return phi, dphi


@triton.jit
def _efla(beta, lam, eps):
    """a = b = β φ(h), h = βλ: ∂a/∂β = φ + hφ' = e^{−h}, ∂a/∂λ = β² φ'(h)."""
    h = beta * lam
    phi, dphi = _phi_dphi(h)
    a = beta * phi
    da_dbeta = tl.exp(-h)
    da_dlam = beta * beta * dphi
    return a, a, da_dbeta, da_dlam, da_dbeta, da_dlam


@triton.jit
def _gated_efla(beta, lam, g, eps):
    """Gated EFLA (docs/design.md §2) from the op's log α ``g = −(1 − α) = expm1(log α)``:
    α = 1 + g, leak 1 − α = −g, step s = αβ, h = sλ, η = −g + h. a = s φ(h), b = β φ(η).
    ∂a/∂β = α e^{−h}, ∂a/∂λ = s² φ'(h), ∂a/∂g = β e^{−h} (∂(sφ(sλ))/∂s = e^{−h});
    ∂b/∂β = φ(η) + h φ'(η) = e^{−η} + g φ'(η) (φ + ηφ' = e^{−η}; both terms ≥ 0, no
    cancellation), ∂b/∂λ = βs φ'(η), ∂b/∂g = β φ'(η) (βλ − 1)."""
    alpha = 1.0 + g
    s = alpha * beta
    h = s * lam
    eta = h - g
    phi_h, dphi_h = _phi_dphi(h)
    phi_eta, dphi_eta = _phi_dphi(eta)
    e_h = tl.exp(-h)
    a = s * phi_h
    b = beta * phi_eta
    da_dbeta = alpha * e_h
    da_dlam = s * s * dphi_h
    db_dbeta = tl.exp(-eta) + g * dphi_eta
    db_dlam = beta * s * dphi_eta
    da_dg = beta * e_h
    db_dg = beta * dphi_eta * (beta * lam - 1.0)
    return a, b, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg


@triton.jit
def _longhorn(beta, lam, eps):
    """a = b = β/(1 + h)."""
    r = 1.0 / (1.0 + beta * lam)
    a = beta * r
    da_dbeta = r * r
    da_dlam = -beta * beta * r * r
    return a, a, da_dbeta, da_dlam, da_dbeta, da_dlam


@triton.jit
def _trapezoid(beta, lam, eps):
    """a = b = β/(1 + h/2)."""
    r = 1.0 / (1.0 + 0.5 * beta * lam)
    a = beta * r
    da_dbeta = r * r
    da_dlam = -0.5 * beta * beta * r * r
    return a, a, da_dbeta, da_dlam, da_dbeta, da_dlam


@triton.jit
def _kaczmarz(beta, lam, eps):
    """a = b = 1/(λ + ε) (β unused)."""
    r = 1.0 / (lam + eps)
    zero = lam * 0.0
    return r, r, zero, -r * r, zero, -r * r


@triton.jit
def _relaxed_kaczmarz(beta, lam, eps):
    """a = b = β/(λ + ε)."""
    r = 1.0 / (lam + eps)
    a = beta * r
    da_dlam = -beta * r * r
    return a, a, r, da_dlam, r, da_dlam


@triton.jit
def _table(beta, lam, g, eps, rule):
    """The entry of kernel id ``rule``: a runtime argument of the kernels, so that one compiled
    kernel serves every rule (a chain of uniform branches, a few instructions per chunk; one
    compile per rule made check_triton's compile phase 7x longer), or a constexpr (then only
    the selected branch is compiled). An id with no entry gives NaN; check_kernel_id refuses
    it before any launch. ``g``: the op's log α, read by the entries of DECAY_MAPS only."""
    zero = lam * 0.0
    da_dg, db_dg = zero, zero
    if rule == LINEAR:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _linear(beta, lam, eps)
    elif rule == DELTA:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _delta(beta, lam, eps)
    elif rule == EFLA:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _efla(beta, lam, eps)
    elif rule == GATED_EFLA:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg = _gated_efla(beta, lam, g, eps)
    elif rule == LONGHORN:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _longhorn(beta, lam, eps)
    elif rule == TRAPEZOID:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _trapezoid(beta, lam, eps)
    elif rule == KACZMARZ:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _kaczmarz(beta, lam, eps)
    elif rule == RELAXED_KACZMARZ:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _relaxed_kaczmarz(beta, lam, eps)
    else:
        nan = zero + float("nan")
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = nan, nan, nan, nan, nan, nan
        da_dg, db_dg = nan, nan
    return a, b, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg


@triton.jit
def reads_decay(rule):
    """Whether the entry of kernel id ``rule`` reads the decay (the ids of DECAY_MAPS): the
    backward adds its ∂/∂g terms to d log α under this (runtime) branch only."""
    return rule == GATED_EFLA


@triton.jit
def strengths(beta, lam, g, eps, rule, neg):
    """Erase and write strengths (a, b) of kernel id ``rule``, elementwise (``g``: the op's log
    α, 0 without a decay). ``neg`` (nonzero: negative eigenvalues): both doubled, μ → 2μ − 1.
    Both runtime values or constexprs."""
    a, b, _, _, _, _, _, _ = _table(beta, lam, g, eps, rule)
    if neg != 0:
        a = 2.0 * a
        b = 2.0 * b
    return a, b


@triton.jit
def derivatives(beta, lam, g, eps, rule, neg):
    """∂a/∂β, ∂a/∂λ, ∂b/∂β, ∂b/∂λ, ∂a/∂g, ∂b/∂g of :func:`strengths`, elementwise (the last
    two zero for an entry that reads no decay)."""
    _, _, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg = _table(beta, lam, g, eps, rule)
    if neg != 0:
        da_dbeta, da_dlam = 2.0 * da_dbeta, 2.0 * da_dlam
        db_dbeta, db_dlam = 2.0 * db_dbeta, 2.0 * db_dlam
        da_dg, db_dg = 2.0 * da_dg, 2.0 * db_dg
    return da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg
