"""experiments/plot_lm_regimes.py draws both regimes from runs.jsonl files, skipping unfinished
runs."""

from __future__ import annotations

import json

from tests._scripts import load_script


def _write_runs(folder, runs):
    folder.mkdir(parents=True)
    lines = [json.dumps(r) for r in runs]
    (folder / "runs.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_lm_regimes(tmp_path, monkeypatch):
    script = load_script("experiments/plot_lm_regimes.py")
    ok = {"status": "ok"}
    _write_runs(
        tmp_path / "lm_corpus_1pass",
        [
            {**ok, "variant": "deltanet", "eval": {"ppl@512": 133.0}},
            {**ok, "variant": "deltanet", "eval": {"ppl@512": 134.0}},
            {**ok, "variant": "gated_deltanet", "eval": {"ppl@512": 121.0}},
            {"status": "diverged", "variant": "efla", "eval": {}},
        ],
    )
    _write_runs(
        tmp_path / "lm_corpus_50m", [{**ok, "variant": "deltanet", "eval": {"ppl@512": 105.0}}]
    )
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    assert script.load("lm_corpus_1pass") == {"deltanet": [133.0, 134.0], "gated_deltanet": [121.0]}
    script.main()
    png = tmp_path / "lm_regimes.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
