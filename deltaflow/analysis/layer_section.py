"""The stability study's optional part on a trained model: mu per head of its real (k, beta)."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaflow.analysis import spectrum
from deltaflow.analysis.config import StudyConfig
from deltaflow.analysis.verdicts import fmt, table


def layer_section(cfg: StudyConfig, out: Path, data: dict) -> list[str]:
    """mu per head of a trained checkpoint on a text. Guarded: any failure becomes a note."""
    md = ["## 4. A trained model's actual mu per head", ""]
    if not (cfg.checkpoint and cfg.text):
        return md + ["Skipped: pass --checkpoint DIR and --text FILE.", ""]
    try:
        from deltaflow.models import DeltaFlowForCausalLM
        from deltaflow.tasks.language import get_tokenizer

        model = DeltaFlowForCausalLM.from_pretrained(cfg.checkpoint).eval()
        tok = get_tokenizer(cfg.tokenizer)
        text = Path(cfg.text).read_text(encoding="utf-8", errors="replace")
        ids = torch.tensor([tok.encode(text)[: cfg.max_tokens]], dtype=torch.long)
        if ids.shape[1] == 0:
            raise ValueError(f"text file {cfg.text} produced no tokens")
        layers = spectrum.layer_eigenvalues(model, ids)
    except Exception as e:  # a broken checkpoint must not lose the rest of the study
        return md + [f"Failed: `{type(e).__name__}: {e}`", ""]
    rows = spectrum.layer_mu_table(layers)
    spectrum.plot_layer_mu(layers, str(out / "layer_mu.png"))
    data["layer"] = rows
    return md + [
        f"Checkpoint `{cfg.checkpoint}`, {ids.shape[1]} tokens of `{cfg.text}`. mu excludes the",
        "decay alpha (which only shrinks it).",
        "",
        "![layer mu](layer_mu.png)",
        "",
        table(
            [
                "layer",
                "head",
                "rule",
                "min",
                "p01",
                "median",
                "p99",
                "max",
                "frac abs>1",
                "median ‖k‖",
            ],
            [
                [
                    r["layer"],
                    r["head"],
                    r["rule"],
                    fmt(r["mu_min"]),
                    fmt(r["mu_p01"]),
                    fmt(r["mu_median"]),
                    fmt(r["mu_p99"]),
                    fmt(r["mu_max"]),
                    fmt(r["frac_unstable"]),
                    fmt(r["key_norm_median"]),
                ]
                for r in rows
            ],
        ),
        "",
    ]
