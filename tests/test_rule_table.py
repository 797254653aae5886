"""The Triton rule table (deltaflow/ops/triton/rules.py) against the rules' one definition.

Every entry's strengths and derivatives are checked against deltaflow/rules.py and its autograd,
in float64, on a grid of β and λ from h = βλ = 0 to h = 8·10⁵ (both sides of EFLA's series
cut-off), and of the op's log α (read by gated_efla's entry, ignored by the others). A kernel
id without an entry fails loudly. And a new built-in rule is added the way the table's
docstring says, touching only RULES, the table and this file, and runs everywhere.
"""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow import delta_rule
from deltaflow.layers import DeltaAttention
from deltaflow.rules import (
    EFLA_SERIES_CUTOFF,
    RAW_KEYS,
    RULES,
    StepRule,
    step_inputs,
    triton_rules,
)

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deltaflow.ops.triton import rules as rule_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
N = 512  # grid points, padded (a power of two for tl.arange)


@triton.jit(do_not_specialize=["rule"])
def _table_kernel(beta_ptr, lam_ptr, g_ptr, out_ptr, eps, rule, N: tl.constexpr):
    """The rule table's eight values at N (β, λ, g) points: a, b and the six derivatives, with
    the kernel id a runtime argument as the op's kernels pass it (g: the op's log α)."""
    offs = tl.arange(0, N)
    beta = tl.load(beta_ptr + offs)
    lam = tl.load(lam_ptr + offs)
    g = tl.load(g_ptr + offs)
    a, b = rule_table.strengths(beta, lam, g, eps, rule, 0)
    derivatives = rule_table.derivatives(beta, lam, g, eps, rule, 0)
    tl.store(out_ptr + offs, a)
    tl.store(out_ptr + N + offs, b)
    for i in tl.static_range(6):
        tl.store(out_ptr + (2 + i) * N + offs, derivatives[i])


def grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """β powers of two, so h = βλ is exact in float32 and only the table's arithmetic is
    measured; λ from 0 to 10⁵, with points just below and above EFLA's cut-off h = 1; the op's
    log α g = α − 1 (gated_efla's expm1 of the layer's) with α a power of two (exact steps αβ)
    or just below 1."""
    betas = torch.tensor([2.0**-10, 0.125, 0.5, 1.0, 2.0, 8.0])
    lams = torch.tensor([0.0, 1e-7, 3e-4, 0.02, 0.3, 0.999, 1.0, 1.001, 3.7, 50.0, 1e3, 1e5])
    gs = torch.tensor([0.0, -(2.0**-12), -0.5, -0.75, -1 + 2.0**-10])
    assert EFLA_SERIES_CUTOFF == 1.0  # the points around 1 straddle the cut-off
    beta, lam, g = torch.cartesian_prod(betas, lams, gs).unbind(-1)
    pad = N - beta.numel()
    return tuple(
        torch.cat([x, torch.full((pad,), fill)]) for x, fill in ((beta, 1), (lam, 1), (g, 0))
    )


def table_values(kernel_id: int) -> torch.Tensor:
    """[8, N]: a, b, ∂a/∂β, ∂a/∂λ, ∂b/∂β, ∂b/∂λ, ∂a/∂g, ∂b/∂g from the rule table (float32)."""
    beta, lam, g = (x.to(DEVICE) for x in grid())
    out = torch.empty(8 * N, device=DEVICE)
    _table_kernel[(1,)](
        beta_ptr=beta, lam_ptr=lam, g_ptr=g, out_ptr=out, eps=EPS, rule=kernel_id, N=N
    )
    return out.view(8, N).cpu().double()


def definition_values(rule: StepRule) -> torch.Tensor:
    """[8, N]: the same from the rule's PyTorch definition and autograd, in float64: the
    strengths step_inputs gives for the layer's log α = log1p(g), so that a rule reading the
    decay is differentiated with respect to the op's log α g, as its entry is (and its op
    log α checked to be g again)."""
    beta, lam, g = (x.double().requires_grad_(True) for x in grid())
    a, b, op_g = step_inputs(rule, beta, lam, torch.log1p(g), eps=EPS)
    torch.testing.assert_close(op_g, g if rule.decay_coefficients else torch.log1p(g))

    def grads(y: torch.Tensor) -> list[torch.Tensor]:  # elementwise: each y_i of (β_i, λ_i, g_i)
        if not y.requires_grad:  # a constant (linear's a = 0)
            return [torch.zeros_like(beta) for _ in range(3)]
        dy = torch.autograd.grad(y.sum(), (beta, lam, g), allow_unused=True, retain_graph=True)
        return [torch.zeros_like(beta) if d is None else d for d in dy]

    (da_dbeta, da_dlam, da_dg), (db_dbeta, db_dlam, db_dg) = grads(a), grads(b)
    return torch.stack([a.detach(), b.detach(), da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg])


def assert_table_matches_definition(rule: StepRule) -> None:
    got, want = table_values(rule.kernel_id), definition_values(rule)
    beta, lam, g = (x.double() for x in grid())
    a, b = want[0].abs(), want[1].abs()
    # A few float32 ulp of each value (the grid's exact h leaves only the table's rounding; an
    # exp on the GPU, ex2.approx, needs somewhat more), plus float64's own rounding of the
    # definition: its autograd sums terms of size a/β (β-derivatives) and a/(λ + ε) or aβ
    # (λ-derivatives) that cancel where h is large (EFLA's ∂a/∂β = e^{−h}), and a/(1 + g),
    # b(1 + βλ) (g-derivatives, through log1p); and values under float32's smallest normal
    # number (1.2e-38) may flush to 0.
    rtol = 4e-6 if DEVICE == "cpu" else 3e-5
    lam_scale = beta + 1 / (lam + EPS)
    g_scale = 1 / (1 + g) + 1 + beta * lam
    floors = [0 * a, 0 * b, a / beta, a * lam_scale, b / beta, b * lam_scale]
    floors += [(a + b) * g_scale, (a + b) * g_scale]
    names = ["a", "b", "da/dbeta", "da/dlam", "db/dbeta", "db/dlam", "da/dg", "db/dg"]
    for name, got_x, w, floor in zip(names, got, want, floors):
        err = (got_x - w).abs() / (rtol * w.abs() + 1e-14 * floor + 1.2e-38)
        worst = int(err.argmax())
        assert err.max() <= 1, (
            f"{rule.name} {name}: table {got_x[worst]:.9g} vs definition {w[worst]:.9g} at "
            f"beta={beta[worst]:g}, lam={lam[worst]:g}, g={g[worst]:g}"
        )


@pytest.mark.parametrize("name", triton_rules())
def test_every_entry_matches_the_rules_definition_and_its_autograd(name):
    assert_table_matches_definition(RULES[name])


@pytest.mark.parametrize("name", triton_rules())
def test_the_entries_free_of_the_norm_are_those_whose_erase_ignores_it(name):
    """rule_table.ERASE_FREE_OF_NORM (the lean key side splits its key block for these: their
    dk has no kᵀdX term) holds exactly the rules whose a has ∂a/∂λ = 0 on the whole grid."""
    rule = RULES[name]
    da_dlam = definition_values(rule)[3]
    free = bool((da_dlam == 0).all())
    assert free == (rule.kernel_id in rule_table.ERASE_FREE_OF_NORM), (name, free)


def test_every_builtin_rule_has_an_entry_and_no_entry_is_orphaned():
    builtin = {r.kernel_id for r in RULES.values() if r.has_triton}
    assert builtin == set(rule_table.KERNEL_IDS)
    assert len(builtin) == sum(r.has_triton for r in RULES.values())  # ids are unique


def test_a_forgotten_id_fails_loudly():
    orphan = StepRule("orphan", RULES["delta"].coefficients, kernel_id=99)
    x = {n: None if t is None else t.to(DEVICE) for n, t in make_inputs(1, 5, 1, 16, 16).items()}
    with pytest.raises(ValueError, match="rule 'orphan' has kernel_id 99, which the Triton rule"):
        delta_rule(**x, rule=orphan, backend="triton")
    with pytest.raises(ValueError, match="kernel_id 99"):
        triton_backend.kernel_id_of(orphan)
    # past the host check, the table gives NaN for it: no fall-through to another rule's entry
    assert table_values(99).isnan().all()


# ---------------------------------------------------------------------------------------------
# A new built-in rule, "damped_delta": a = b = β e^{−h}, μ = 1 − h e^{−h} ∈ [1 − 1/e, 1].
# What adding it takes: the StepRule (in deltaflow/rules.py's RULES), an entry in the Triton
# table (below: the function, and the branch and id the table's _table and KERNEL_IDS would
# gain), and tests. The kernels, the backend, the op and the layer are untouched.

DAMPED_ID = tl.constexpr(100)
_builtin_table = rule_table._table


def _damped_delta_coefficients(beta, lam, eps):
    a = beta * torch.exp(-beta * lam)
    return a, a


@triton.jit
def _damped_delta(beta, lam, eps):
    """a = b = β e^{−h}: ∂a/∂β = e^{−h}(1 − h), ∂a/∂λ = −β² e^{−h}."""
    e = tl.exp(-beta * lam)
    a = beta * e
    da_dbeta = e * (1.0 - beta * lam)
    da_dlam = -beta * beta * e
    return a, a, da_dbeta, da_dlam, da_dbeta, da_dlam


@triton.jit
def _table_with_damped_delta(beta, lam, g, eps, rule):
    zero = lam * 0.0
    if rule == DAMPED_ID:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam = _damped_delta(beta, lam, eps)
        da_dg, db_dg = zero, zero
    else:
        a, b, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg = _builtin_table(
            beta, lam, g, eps, rule
        )
    return a, b, da_dbeta, da_dlam, db_dbeta, db_dlam, da_dg, db_dg


@pytest.fixture
def damped_delta(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip(
            "swaps the table at run time: the CPU interpreter only (compiled kernels cache)"
        )
    rule = StepRule(
        "damped_delta",
        _damped_delta_coefficients,
        qk_norm=RAW_KEYS,
        kernel_id=DAMPED_ID.value,
        description="a = b = β e^{−h}; μ = 1 − h e^{−h}",
        source="tests/test_rule_table.py",
    )
    monkeypatch.setitem(RULES, rule.name, rule)
    monkeypatch.setattr(rule_table, "_table", _table_with_damped_delta)
    monkeypatch.setattr(rule_table, "KERNEL_IDS", (*rule_table.KERNEL_IDS, DAMPED_ID.value))
    return rule


def test_a_new_builtin_rule_needs_only_rules_the_table_and_tests(damped_delta):
    assert damped_delta.has_triton
    assert_table_matches_definition(damped_delta)
    # forward and the fused backward against the float64 reference, by name like any rule
    x = make_inputs(1, 70, 2, 16, 24, rule="damped_delta", dtype=torch.float32, seed=3)
    ref = _outputs_and_grads(x, "reference")
    got = _outputs_and_grads(x, "triton")
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all() and rel_err(g, r) <= 1e-4
    # decode: three tokens into the state, in place
    first = {n: t if n == "initial_state" else t[:, :3] for n, t in x.items()}
    state = first["initial_state"].clone()
    o = triton_backend.delta_rule_step(
        *(first[n] for n in ("q", "k", "v", "beta")),
        state,
        rule="damped_delta",
        log_decay=first["log_decay"],
        negative_eigenvalues=False,
        eps=1e-6,
        scale=16**-0.5,
    )
    o_ref, s_ref = delta_rule(
        **first, rule="damped_delta", output_final_state=True, backend="reference"
    )
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(state, s_ref) <= 1e-4
    # the layer picks up the rule's declared key normalization
    assert DeltaAttention(32, num_heads=2, rule="damped_delta").k_norm == "none"


def _outputs_and_grads(x: dict, backend: str) -> list[torch.Tensor]:
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, s = delta_rule(**leaves, rule="damped_delta", output_final_state=True, backend=backend)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [leaves[n].grad for n in ("q", "k", "v", "beta", "log_decay")]
