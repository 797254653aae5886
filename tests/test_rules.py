"""Each rule's defining property, checked on the op's output (docs/design.md §2)."""

from __future__ import annotations

import math

import pytest
import torch
from _inputs import make_inputs

from deltaflow import delta_rule
from deltaflow.rules import (
    RULES,
    eigenvalue,
    get_rule,
    register_rule,
    step_coefficients,
    triton_rules,
)

EPS = 1e-6


def mu_closed_form(rule: str, beta: float, lam: float) -> float:
    """μ along k, written from the docs/design.md table independently of deltaflow.rules."""
    h = beta * lam
    return {
        "linear": 1.0,
        "delta": 1 - h,
        "efla": math.exp(-h),
        "gated_efla": math.exp(-h),  # at α = 1 (log_decay = 0) it is EFLA
        "longhorn": 1 / (1 + h),
        "trapezoid": (1 - h / 2) / (1 + h / 2),
        "kaczmarz": 1 - lam / (lam + EPS),
        "relaxed_kaczmarz": 1 - beta * lam / (lam + EPS),
    }[rule]


def one_step(rule, k, v, beta, s0, log_decay=None, negative_eigenvalues=False, backend="torch"):
    """Apply one token to s0 through the public op and return S_1 [Dk, Dv]."""
    Dk, Dv = s0.shape
    q = torch.randn(1, 1, 1, Dk, dtype=torch.float64)
    beta_t = None if beta is None else torch.tensor([[[beta]]], dtype=torch.float64)
    ld = None if log_decay is None else torch.tensor([[[log_decay]]], dtype=torch.float64)
    _, s1 = delta_rule(
        q,
        k.view(1, 1, 1, Dk),
        v.view(1, 1, 1, Dv),
        beta_t,
        rule=rule,
        log_decay=ld,
        negative_eigenvalues=negative_eigenvalues,
        eps=EPS,
        initial_state=s0.view(1, 1, Dk, Dv),
        output_final_state=True,
        backend=backend,
    )
    return s1[0, 0]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("negative_eigenvalues", [False, True])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_eigenvalue_along_k(rule, negative_eigenvalues, backend):
    g = torch.Generator().manual_seed(1)
    Dk, Dv = 6, 4
    # a rule that reads the decay needs one (the op refuses None): α = 1, no decay in effect
    no_decay = 0.0 if RULES[rule].decay_coefficients is not None else None
    for beta, norm in [(0.3, 0.5), (0.9, 1.0), (0.7, 2.5), (2.0, 1.3)]:
        k = torch.randn(Dk, generator=g, dtype=torch.float64)
        k = k / k.norm() * norm
        u = torch.randn(Dv, generator=g, dtype=torch.float64)
        w = torch.randn(Dk, generator=g, dtype=torch.float64)
        w = w - (w @ k) / (k @ k) * k  # w ⊥ k
        zero_v = torch.zeros(Dv, dtype=torch.float64)  # isolate the transition (no write)
        mu = mu_closed_form(rule, beta, norm**2)
        if negative_eigenvalues:
            mu = 2 * mu - 1
        # S_0 = k uᵀ is an eigen-direction with eigenvalue μ; w uᵀ with w ⊥ k has eigenvalue 1.
        s_along = one_step(
            rule, k, zero_v, beta, torch.outer(k, u), no_decay, negative_eigenvalues, backend
        )
        s_perp = one_step(
            rule, k, zero_v, beta, torch.outer(w, u), no_decay, negative_eigenvalues, backend
        )
        torch.testing.assert_close(s_along, mu * torch.outer(k, u), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s_perp, torch.outer(w, u), rtol=1e-12, atol=1e-12)
        lam = torch.tensor(norm**2, dtype=torch.float64)
        mu_lib = eigenvalue(
            rule,
            torch.tensor(beta, dtype=torch.float64),
            lam,
            negative_eigenvalues=negative_eigenvalues,
            eps=EPS,
        )
        assert abs(mu_lib.item() - mu) < 1e-12


# linear has a ≠ b; gated_efla has a ≠ b under a decay (its write strength includes the leak)
@pytest.mark.parametrize("rule", [r for r in sorted(RULES) if r not in ("linear", "gated_efla")])
def test_prediction_interpolates_to_target(rule):
    # a = b rules: kᵀS_t = μ·kᵀ(α S_{t−1}) + (1 − μ)·vᵀ, here with decay and a random state.
    g = torch.Generator().manual_seed(2)
    Dk, Dv, beta, log_decay = 5, 3, 0.6, -0.2
    k = 1.7 * torch.randn(Dk, generator=g, dtype=torch.float64)
    v = torch.randn(Dv, generator=g, dtype=torch.float64)
    s0 = torch.randn(Dk, Dv, generator=g, dtype=torch.float64)
    s1 = one_step(rule, k, v, beta, s0, log_decay)
    mu = mu_closed_form(rule, beta, (k @ k).item())
    alpha = math.exp(log_decay)
    torch.testing.assert_close(
        k @ s1, mu * (k @ (alpha * s0)) + (1 - mu) * v, rtol=1e-10, atol=1e-10
    )


def test_kaczmarz_is_exact_projection():
    g = torch.Generator().manual_seed(3)
    for norm in (0.2, 1.0, 7.0):
        k = torch.randn(8, generator=g, dtype=torch.float64)
        k = k / k.norm() * norm
        v, s0 = (
            torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn(8, 4, generator=g, dtype=torch.float64),
        )
        s1 = one_step("kaczmarz", k, v, None, s0)
        # lands on kᵀS = vᵀ up to the ε regularizer: error = ε/(λ+ε)·|kᵀS̃ − v|
        err = (k @ s1 - v).abs().max().item()
        assert err <= 10 * EPS / norm**2 * (k @ s0 - v).abs().max().item() + 1e-12
        # and moves S only along k (minimal-norm correction)
        w = torch.linalg.svd(k[None]).Vh[1:]  # basis of k's complement
        torch.testing.assert_close(w @ s1, w @ s0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", [0.01, 0.5, 1.0, 3.0])
def test_efla_is_the_exact_flow(beta):
    # Exact solution of dS/dτ = −k kᵀ S + k vᵀ over τ ∈ [0, β], from the augmented system
    # d/dτ [S; I] = [[−kkᵀ, k vᵀ], [0, 0]] [S; I].
    g = torch.Generator().manual_seed(4)
    Dk, Dv = 6, 3
    k = 1.5 * torch.randn(Dk, generator=g, dtype=torch.float64)
    v = torch.randn(Dv, generator=g, dtype=torch.float64)
    s0 = torch.randn(Dk, Dv, generator=g, dtype=torch.float64)
    M = torch.zeros(Dk + Dv, Dk + Dv, dtype=torch.float64)
    M[:Dk, :Dk] = -torch.outer(k, k)
    M[:Dk, Dk:] = torch.outer(k, v)
    flow = torch.linalg.matrix_exp(beta * M) @ torch.cat([s0, torch.eye(Dv, dtype=torch.float64)])
    torch.testing.assert_close(one_step("efla", k, v, beta, s0), flow[:Dk], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("beta", [0.05, 0.8, 3.0])
@pytest.mark.parametrize("log_decay", [-1e-9, -0.1, -1.0, -6.0])
def test_gated_efla_is_the_exact_gated_flow(beta, log_decay):
    # The EFLA paper's gated form (appendix D): the exact solution over τ ∈ [0, 1] of
    # dS/dτ = −(1 − α) S − αβ k kᵀ S + β k vᵀ (whose explicit Euler step is Gated DeltaNet's
    # S_t = α(I − β kkᵀ)S + β kvᵀ), from the augmented linear system and a matrix exponential,
    # independently of deltaflow.rules.
    g = torch.Generator().manual_seed(5)
    Dk, Dv = 6, 3
    k = 1.3 * torch.randn(Dk, generator=g, dtype=torch.float64)
    v = torch.randn(Dv, generator=g, dtype=torch.float64)
    s0 = torch.randn(Dk, Dv, generator=g, dtype=torch.float64)
    alpha = math.exp(log_decay)
    M = torch.zeros(Dk + Dv, Dk + Dv, dtype=torch.float64)
    M[:Dk, :Dk] = -(1 - alpha) * torch.eye(Dk, dtype=torch.float64) - alpha * beta * torch.outer(
        k, k
    )
    M[:Dk, Dk:] = beta * torch.outer(k, v)
    flow = torch.linalg.matrix_exp(M) @ torch.cat([s0, torch.eye(Dv, dtype=torch.float64)])
    for backend in ("reference", "torch"):
        s1 = one_step("gated_efla", k, v, beta, s0, log_decay, backend=backend)
        torch.testing.assert_close(s1, flow[:Dk], rtol=1e-10, atol=1e-10)


def test_gated_efla_maps_onto_the_one_recurrence():
    # Which part of the decay is where: the op's decay is e^{−(1−α)}, a = (1 − e^{−αβλ})/λ,
    # b = β(1 − e^{−η})/η with η = (1 − α) + αβλ (docs/design.md §2); without a decay, EFLA.
    from deltaflow.rules import step_inputs

    beta = torch.tensor([0.3, 0.9, 2.0], dtype=torch.float64)
    lam = torch.tensor([0.5, 4.0, 1e-12], dtype=torch.float64)
    log_decay = torch.tensor([-0.2, -2.0, -0.7], dtype=torch.float64)
    alpha = log_decay.exp()
    a, b, op_log_decay = step_inputs("gated_efla", beta, lam, log_decay)
    eta = (1 - alpha) + alpha * beta * lam
    torch.testing.assert_close(op_log_decay, -(1 - alpha))
    torch.testing.assert_close(a[:2], (-torch.expm1(-alpha * beta * lam) / lam)[:2])
    torch.testing.assert_close(a[2], alpha[2] * beta[2])  # λ → 0: αβ
    torch.testing.assert_close(b, beta * -torch.expm1(-eta) / eta)
    a0, b0, none = step_inputs("gated_efla", beta, lam, None)
    a1, b1 = step_coefficients("efla", beta, lam)
    assert none is None and torch.equal(a0, a1) and torch.equal(b0, b1)
    # gradients reach the decay through a, b and the op's decay, finite at α = 1
    ld = torch.tensor([0.0, -1e-12, -3.0], dtype=torch.float64, requires_grad=True)
    sum(x.sum() for x in step_inputs("gated_efla", beta, lam, ld)).backward()
    assert torch.isfinite(ld.grad).all() and (ld.grad != 0).all()


def test_gated_efla_has_a_triton_form_and_auto_takes_it_on_cuda():
    from deltaflow.ops.delta_rule import resolve_backend

    rule = get_rule("gated_efla")
    assert rule.has_triton and "gated_efla" in triton_rules()
    q = torch.zeros(1, 1, 1, 4, device="meta")  # not CUDA: the torch backend
    assert resolve_backend("auto", q, rule) == "torch"
    with pytest.raises(ValueError, match="built-in"):
        register_rule("gated_efla", lambda beta, lam, eps: (beta, beta))


def test_efla_small_key_limit_is_delta():
    beta = torch.tensor([0.7, 0.7], dtype=torch.float64)
    lam = torch.tensor([0.0, 1e-9], dtype=torch.float64)
    a, b = step_coefficients("efla", beta, lam)
    torch.testing.assert_close(a, beta, rtol=1e-8, atol=0)
    # and its gradient is finite at λ = 0
    lam.requires_grad_(True)
    step_coefficients("efla", beta, lam)[0].sum().backward()
    assert torch.isfinite(lam.grad).all()


def test_rule_lookup_errors():
    with pytest.raises(ValueError, match="unknown rule 'deltanet'.*known rules: delta, efla"):
        get_rule("deltanet")
    with pytest.raises(ValueError, match="built-in"):
        register_rule("delta", lambda beta, lam, eps: (beta, beta))
    with pytest.raises(ValueError, match="beta is None but rule 'efla'"):
        step_coefficients("efla", None, torch.ones(3))
    with pytest.raises(TypeError, match="rule must be"):
        get_rule(3)


def test_all_rules_keep_mu_in_range_for_any_key_norm():
    # The claim of docs/design.md §2: efla, longhorn, trapezoid, kaczmarz keep μ in [−1, 1] for
    # any λ.
    lam = torch.logspace(-4, 4, 200, dtype=torch.float64)
    beta = torch.full_like(lam, 0.9)
    for rule in ("efla", "longhorn", "trapezoid", "kaczmarz", "relaxed_kaczmarz"):
        mu = eigenvalue(rule, beta, lam)
        assert ((mu >= -1) & (mu <= 1)).all(), rule
    assert (eigenvalue("delta", beta, lam) < -1).any()  # delta does not
    inputs = make_inputs(1, 3, 1, 2, 2)  # keep the import used: shared generator sanity
    assert inputs["k"].abs().sum() > 0
