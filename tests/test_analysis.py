"""Tests of deltaflow.analysis (the stability lab) on cases with known answers."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from deltaflow import delta_rule
from deltaflow.analysis import discretization as disc
from deltaflow.analysis import growth, spectrum
from deltaflow.analysis.cli import add_stability_parser, main
from deltaflow.rules import register_rule

EPS = 1e-6

# mu at lam = 1, beta = h = 0.5, from the closed forms in docs/design.md §2.
MU_AT_HALF = {
    "delta": 0.5,
    "efla": math.exp(-0.5),
    "longhorn": 1 / 1.5,
    "trapezoid": 0.75 / 1.25,
    "kaczmarz": EPS / (1 + EPS),
    "relaxed_kaczmarz": 1 - 0.5 / (1 + EPS),
    "linear": 1.0,
}


@pytest.mark.parametrize("rule", list(MU_AT_HALF))
@pytest.mark.parametrize("neg", [False, True])
def test_mu_of_h_known_values(rule, neg):
    mu = spectrum.mu_of_h(rule, torch.tensor([0.5]), negative_eigenvalues=neg, eps=EPS)
    want = MU_AT_HALF[rule]
    if neg and rule != "linear":  # doubling a maps mu to 2mu - 1 (linear has a = 0)
        want = 2 * want - 1
    assert mu.dtype == torch.float64
    assert mu.item() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_mu_of_norm_and_range():
    # delta at beta = 0.9, ||k|| = 2: mu = 1 - 0.9 * 4; efla: exp(-3.6).
    n = torch.tensor([2.0])
    assert spectrum.mu_of_norm("delta", n, 0.9).item() == pytest.approx(1 - 3.6)
    assert spectrum.mu_of_norm("efla", n, 0.9).item() == pytest.approx(math.exp(-3.6))
    # Unit keys, sigmoid beta: delta in [0, 1], with negative eigenvalues [-1, 1].
    assert spectrum.mu_range("delta") == pytest.approx((0.0, 1.0))
    assert spectrum.mu_range("delta", negative_eigenvalues=True) == pytest.approx((-1.0, 1.0))
    # Raw keys up to ||k|| = 10: delta reaches 1 - 100; efla and longhorn stay in [0, 1].
    lo, hi = spectrum.mu_range("delta", norm_range=(0.1, 10.0))
    assert lo == pytest.approx(-99.0) and hi == pytest.approx(1.0)
    for rule in ("efla", "longhorn", "trapezoid", "kaczmarz"):
        lo, hi = spectrum.mu_range(rule, norm_range=(0.1, 10.0))
        assert -1 <= lo and hi <= 1, rule
    # Trapezoid with negative eigenvalues: (1 - 3h/2)/(1 + h/2) < -1 once h > 2.
    lo, _ = spectrum.mu_range("trapezoid", norm_range=(0.1, 10.0), negative_eigenvalues=True)
    assert lo == pytest.approx((1 - 150) / (1 + 50))
    rows = spectrum.spectrum_table(["delta", "efla"], {"raw": ((0.0, 1.0), (0.1, 10.0))})
    stable = {(r["rule"], r["negative_eigenvalues"]): r["stable"] for r in rows}
    assert stable == {
        ("delta", False): False,
        ("delta", True): False,
        ("efla", False): True,
        ("efla", True): True,
    }


def test_spectrum_bad_input():
    with pytest.raises(ValueError, match="h = beta"):
        spectrum.mu_of_h("delta", torch.tensor([-0.1]))
    with pytest.raises(ValueError, match="beta_range"):
        spectrum.mu_range("delta", beta_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="unknown rule"):
        spectrum.mu_of_h("nope", torch.tensor([0.1]))


def test_reflection_sequence_preserves_norm_exactly_in_float64():
    # beta = 1, unit keys, negative eigenvalues: every transition is the Householder reflection
    # I - 2kk^T (mu = -1). With v = 0 the state is a pure product of reflections: ||S_t||_F must
    # equal ||S_0||_F to round-off in float64 at every t; in bf16 inputs it drifts.
    dk, dv, steps = 12, 5, 800
    chains = [growth.Chain("delta", True, "unit", "one", s) for s in range(3)]
    s0 = torch.randn(3, dk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = growth.simulate(
        chains,
        ["bf16"],
        steps=steps,
        dk=dk,
        dv=dv,
        initial_state=s0,
        zero_values=True,
        records=50,
        progress=False,
    )
    n0 = torch.linalg.vector_norm(s0, dim=(1, 2))
    rel = (res.norms["fp64"] - n0).abs() / n0
    assert rel.max() < 1e-12
    assert (res.mu_max["fp64"] - 1).abs().max() < 1e-12
    drift = (res.norms["bf16"][-1] - n0).abs() / n0
    assert drift.max() > 1e-4  # the rounded transition is not orthogonal any more
    assert res.steps[-1] == steps and res.steps[0] == 1


def test_simulate_matches_core_op_reference():
    # The float64 chain must be the recurrence of deltaflow.delta_rule exactly.
    dk, dv, steps = 8, 3, 150
    chains = [
        growth.Chain("efla", False, "heavy", "uniform", 0),
        growth.Chain("trapezoid", True, "unit", "softplus", 1),
        growth.Chain("longhorn", False, "vocab:3", "near1", 2),
    ]
    res = growth.simulate(
        chains, ["fp32"], steps=steps, dk=dk, dv=dv, block=64, seed=5, progress=False
    )
    for i, c in enumerate(chains):
        k, v, beta = growth.stream_inputs(c, steps, dk, dv, seed=5, block=64)
        assert k.shape == (steps, dk) and v.shape == (steps, dv) and beta.shape == (steps,)
        q = torch.randn(1, steps, 1, dk, dtype=torch.float64)
        _, s_ref = delta_rule(
            q,
            k[None, :, None],
            v[None, :, None],
            beta[None, :, None],
            rule=c.rule,
            negative_eigenvalues=c.negative_eigenvalues,
            output_final_state=True,
            backend="reference",
        )
        s_ref = s_ref[0, 0].double()
        err = (res.final_states["fp64"][i] - s_ref).norm() / s_ref.norm()
        assert err < 1e-5, (c, err)  # the op keeps its state in float32
        err32 = (res.final_states["fp32"][i].double() - s_ref).norm() / s_ref.norm()
        assert err32 < 1e-4


def test_low_precision_state_is_rounded_every_step():
    chains = [growth.Chain("delta", False, "unit", "uniform", 0)]
    res = growth.simulate(
        chains, ["bf16", "fp16", "fp32/bf16"], steps=40, dk=8, dv=4, progress=False
    )
    assert res.final_states["bf16"].dtype == torch.bfloat16
    assert res.final_states["fp16"].dtype == torch.float16
    assert res.final_states["fp32/bf16"].dtype == torch.bfloat16
    err = res.rel_err["bf16"][-1, 0]
    assert 1e-4 < err < 0.1  # bf16 really was used, and is still close to the reference
    assert res.rel_err["fp64"].abs().max() == 0


def test_raw_keys_break_delta_not_efla():
    chains = [
        growth.Chain(rule, False, keys, "uniform", 0)
        for rule in ("delta", "efla", "longhorn", "kaczmarz")
        for keys in ("gaussian", "unit")
    ]
    res = growth.simulate(chains, ["fp32", "fp16"], steps=400, dk=16, dv=4, progress=False)
    first = {(c.rule, c.keys): int(res.first_nonfinite["fp32"][i]) for i, c in enumerate(chains)}
    assert first[("delta", "gaussian")] > 0  # |mu| ~ 16: overflows float32 in ~30-100 steps
    first16 = int(
        res.first_nonfinite["fp16"][
            chains.index(growth.Chain("delta", False, "gaussian", "uniform", 0))
        ]
    )
    assert 0 < first16 < first[("delta", "gaussian")]  # fp16 overflows at 65504
    for key, f in first.items():
        if key != ("delta", "gaussian"):
            assert f == -1, key
    for i, c in enumerate(chains):
        if c.rule != "delta" or c.keys == "unit":
            assert res.norms["fp32"][:, i].max() < 100
            assert res.mu_max["fp64"][i] <= 1 + 1e-12


def test_user_rule_goes_through_step_coefficients():
    # A user rule: half a delta step; mu = 1 - h/2 in [0.5, 1] for unit keys, so bounded.
    name = "test_analysis_half_delta"
    try:
        register_rule(name, lambda beta, lam, eps: (beta / 2, beta / 2))
    except ValueError:
        pass  # registered by an earlier run in this process
    res = growth.simulate(
        [growth.Chain(name, False, "unit", "one", 0)],
        ["fp32"],
        steps=50,
        dk=4,
        dv=2,
        progress=False,
    )
    assert res.mu_max["fp64"][0] == pytest.approx(0.5, abs=1e-9)


def test_growth_bad_input():
    with pytest.raises(ValueError, match="precision"):
        growth.parse_precision("fp8")
    with pytest.raises(ValueError, match="key regime"):
        growth.make_chains(["delta"], ["sphere"], ["uniform"], 1)
    with pytest.raises(ValueError, match="beta regime"):
        growth.make_chains(["delta"], ["unit"], ["const:-1"], 1)
    with pytest.raises(ValueError, match="vocab"):
        growth.make_chains(["delta"], ["vocab:0"], ["uniform"], 1)
    with pytest.raises(ValueError, match="unknown rule"):
        growth.simulate([growth.Chain("nope", False, "unit", "one", 0)], ["fp32"], steps=2)
    with pytest.raises(ValueError, match="initial_state"):
        growth.simulate(
            [growth.Chain("delta", False, "unit", "one", 0)],
            ["fp32"],
            steps=2,
            dk=4,
            dv=2,
            initial_state=torch.zeros(1, 4, 3, dtype=torch.float64),
            progress=False,
        )
    p = growth.parse_precision("bf16/fp32")
    assert (p.input_dtype, p.state_dtype) == (torch.bfloat16, torch.float32)


def test_transition_error_equals_eigenvalue_gap():
    # Both matrices are I off k; along k they are mu and exp(-h): the error is |mu - e^-h|.
    h = torch.tensor([0.01, 0.3, 2.0], dtype=torch.float64)
    for rule in ("delta", "longhorn", "trapezoid"):
        err = disc.transition_errors(rule, h, dk=6, lam=2.0)
        mu = spectrum.mu_of_h(rule, h)
        torch.testing.assert_close(err, (mu - torch.exp(-h)).abs(), rtol=1e-9, atol=1e-14)


def test_discretization_orders():
    h, errs, rows = disc.discretization_study(
        ["delta", "efla", "longhorn", "trapezoid", "kaczmarz"], points=25
    )
    by = {r["rule"]: r for r in rows}
    assert by["efla"]["exact"] and math.isnan(by["efla"]["local_order"])
    assert by["delta"]["method_order"] == pytest.approx(1.0, abs=0.1)
    assert by["longhorn"]["method_order"] == pytest.approx(1.0, abs=0.1)
    assert by["trapezoid"]["method_order"] == pytest.approx(2.0, abs=0.1)
    assert not by["kaczmarz"]["exact"] and by["kaczmarz"]["local_order"] < 0.5
    assert disc.fit_order(h, h**3) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="h must be > 0"):
        disc.transition_errors("delta", torch.tensor([0.0]))


def test_cli_subparser_and_tiny_study(tmp_path):
    ap = argparse.ArgumentParser(prog="deltaflow")
    sub = ap.add_subparsers(dest="command")
    add_stability_parser(sub)
    out = tmp_path / "st"
    args = ap.parse_args(
        [
            "stability",
            "--out",
            str(out),
            "--rules",
            "delta,efla",
            "--dtypes",
            "fp32,bf16",
            "--steps",
            "60",
            "--pinned-steps",
            "80",
            "--seeds",
            "1",
            "--pinned-seeds",
            "1",
            "--pinned-keys",
            "vocab:1",
            "--dk",
            "8",
            "--dv",
            "4",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    for f in (
        "summary.md",
        "study.json",
        "spectrum.png",
        "discretization.png",
        "growth_keys_gaussian.png",
        "growth_pinned.png",
    ):
        assert (out / f).stat().st_size > 0, f
    text = (out / "summary.md").read_text()
    assert "## Findings" in text and "(1) delta" in text and "inf@" in text
    # Standalone entry point validates options with a clear error and exit code 2.
    assert main(["--out", str(out), "--dtypes", "fp8"]) == 2
    assert main(["--out", str(out), "--parts", "spectra"]) == 2
    assert main(["--out", str(out), "--op-backend", "cuda"]) == 2
    assert main(["--out", str(out), "--keys", "sphere"]) == 2


def test_layer_eigenvalues_of_a_tiny_model():
    models = pytest.importorskip("deltaflow.models")
    cfg = models.DeltaFlowConfig(
        vocab_size=50,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        rule="delta",
        negative_eigenvalues=True,
    )
    torch.manual_seed(0)
    model = models.DeltaFlowForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 17))
    layers = spectrum.layer_eigenvalues(model, ids)
    assert len(layers) == 2
    for lay in layers:
        assert lay["rule"] == "delta" and lay["mu"].shape == (2 * 17, 2)
        # delta layers L2-normalize k and use a sigmoid beta: mu = 1 - 2 beta in (-1, 1).
        assert lay["mu"].abs().max() <= 1 + 1e-5
    rows = spectrum.layer_mu_table(layers)
    assert len(rows) == 4 and all(r["frac_unstable"] == 0 for r in rows)


def test_real_op_reproduces_emulated_bf16_run():
    # bf16 k, v, beta into delta_rule (float32 state) == the emulated 'bf16/fp32' precision.
    from deltaflow.analysis.report import op_crosscheck

    chains = [
        growth.Chain("delta", True, "vocab:1", "near1", 7),
        growth.Chain("delta", True, "unit", "uniform:0.9", 1),
        growth.Chain("efla", False, "gaussian", "uniform", 2),
    ]
    steps = 400
    res = growth.simulate(chains, ["bf16/fp32"], steps=steps, dk=8, dv=4, progress=False)
    chk = op_crosscheck(chains, steps, dk=8, dv=4, seed=0, backend="torch", segments=4)
    assert chk["t"][-1] == steps
    final = chk["bf16"][-1]
    torch.testing.assert_close(final, res.norms["bf16/fp32"][-1], rtol=2e-3, atol=0)
    assert torch.isfinite(chk["bf16, fp32 beta"]).all()


def test_verdict_classifies_known_curves():
    from deltaflow.analysis.report import verdict

    t = torch.arange(1, 2001, dtype=torch.float64)
    curves = torch.stack(
        [
            torch.full_like(t, 5.0) + 0.1 * torch.sin(t),  # bounded
            3 * t.sqrt(),  # random-walk growth
            torch.exp(t / 100),  # exponential
        ],
        1,
    )
    chains = [growth.Chain("delta", False, "unit", "one", s) for s in range(4)]
    norms = torch.cat([curves, torch.ones(len(t), 1)], 1)
    res = growth.GrowthResult(
        chains=chains,
        precisions=[growth.parse_precision("fp16")],
        steps=t.long(),
        norms={"fp16": norms},
        rel_err={"fp16": torch.zeros_like(norms)},
        first_nonfinite={"fp16": torch.tensor([-1, -1, -1, 1234])},
        mu_max={"fp16": torch.ones(4)},
        frac_mu_gt1={"fp16": torch.zeros(4)},
        final_states={},
    )
    v = [verdict(res, "fp16", i) for i in range(4)]
    assert [x.status for x in v] == ["bounded", "growing", "diverging", "non-finite"]
    assert v[1].exponent == pytest.approx(0.5, abs=1e-6)
    assert v[3].first_nonfinite == 1234
    # exp(t/100) reaches fp16's 65504 at t = 100 ln(65504) ~ 1109.
    assert v[2].projected_overflow == pytest.approx(100 * math.log(65504), rel=0.01)
