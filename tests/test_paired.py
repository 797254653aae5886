"""Paired comparison over seeds (deltaflow.lab.paired) and the claims script built on it."""

from __future__ import annotations

import json
import math

import pytest

from deltaflow.lab.paired import paired_difference, t95
from tests._scripts import load_script


def test_t_interval_matches_the_textbook_value():
    d = paired_difference({0: 5.0, 1: 6.0, 2: 7.0}, {0: 2.0, 1: 2.0, 2: 2.0}, higher_is_better=True)
    assert d.diffs == (3.0, 4.0, 5.0) and d.mean == 4.0 and d.wins == 3
    # sd 1, n 3: t(0.975, 2) = 4.303
    assert d.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert d.verdict("a", "b") == "a ahead"


def test_lower_is_better_flips_the_sign_and_pairs_common_seeds_only():
    # perplexities: b is lower (better) on every common seed; seed 7 has no partner
    a = {0: 130.0, 1: 131.0, 2: 129.5, 7: 1.0}
    d = paired_difference(a, {0: 120.0, 1: 122.0, 2: 121.0}, higher_is_better=False)
    assert d.seeds == (0, 1, 2)
    assert d.diffs == (-10.0, -9.0, -8.5) and d.wins == 0
    assert d.verdict("a", "b") == "b ahead"


def test_noisy_and_single_seed_verdicts():
    noisy = paired_difference({0: 1.0, 1: -1.0}, {0: 0.0, 1: 0.0}, higher_is_better=True)
    assert noisy.verdict("a", "b") == "no difference resolved"
    one = paired_difference({0: 2.0}, {0: 1.0}, higher_is_better=True)
    assert math.isinf(one.half_width) and one.verdict("a", "b") == "one seed: no interval"


def test_bad_pairs_raise_clear_errors():
    with pytest.raises(ValueError, match="share no seed"):
        paired_difference({0: 1.0}, {1: 1.0}, higher_is_better=True)
    with pytest.raises(ValueError, match="non-finite"):
        paired_difference({0: math.inf}, {0: 1.0}, higher_is_better=False)
    with pytest.raises(ValueError, match="dof"):
        t95(0)
    assert t95(11) == t95(10) and t95(100) == 1.96  # skipped entries err on the wide side


def _run(variant, seed, lr, ppl, status="ok"):
    return {
        "id": f"{variant}-corpus-lr{lr}-s{seed}",
        "variant": variant,
        "cell": "corpus",
        "width": None,
        "lr": lr,
        "seed": seed,
        "status": status,
        "eval": {"ppl": ppl, "ppl@512": ppl, "ppl@1024": ppl * 1.01},
    }


def test_claims_script_pairs_at_each_variants_best_lr(tmp_path, monkeypatch):
    script = load_script("experiments/paired_claims.py")
    runs = [
        *[_run("efla", s, 1e-3, 120.0 + s) for s in range(3)],
        *[_run("efla", s, 3e-3, 150.0) for s in range(3)],  # a worse lr: not the one paired
        *[_run("deltanet", s, 1e-3, 125.0 + 2 * s) for s in range(3)],
        _run("deltanet", 3, 1e-3, 0.0, status="partial"),  # unfinished: ignored
    ]
    folder = tmp_path / "lm_corpus_1pass"
    folder.mkdir()
    (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    claim = script.Claim("4-GPU", "efla", "deltanet", **script.ONE_PASS)
    monkeypatch.setattr(script, "CLAIMS", [claim])
    d = script.measure(claim)
    assert d.seeds == (0, 1, 2) and d.diffs == (5.0, 6.0, 7.0)
    script.main()
    text = (tmp_path / "paired.md").read_text()
    assert "| 4-GPU | efla > deltanet |" in text and "efla ahead" in text
    assert "| efla | 6 | 1.010 |" in text  # ppl@1024 / ppl@512 of every finished run
    assert (tmp_path / "paired.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
