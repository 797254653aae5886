"""Issue 11, item 4: validation perplexity per rule at one pass over the corpus vs ~7 passes.

    python3 experiments/plot_lm_regimes.py   # writes results/issue11/lm_regimes.png

Reads the committed `runs.jsonl` of `issue11/lm_corpus_1pass` (7.06M tokens a run) and
`issue11/lm_corpus_50m` (50M tokens: ~7 passes over the 7.07M-token training split) and draws
every seed's ppl@512 per variant, one panel per regime, so the flip between the regimes (the
gated rules best at one pass, worst after memorising) is visible at a glance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from deltaflow.lab.grid import upgrade_record  # noqa: E402
from deltaflow.lab.presets import VARIANTS  # noqa: E402

# the committed issue-11 results, whatever the working directory
RESULTS = Path(__file__).resolve().parents[1] / "results" / "issue11"
REGIMES = {
    "lm_corpus_1pass": "one pass (7.06M tokens)",
    "lm_corpus_50m": "50M tokens (~7 passes, memorised)",
}
ORDER = [  # the claims' variants first, in the order the claims name them
    "deltanet",
    "efla",
    "gated_deltanet",
    "efla_decay",
    "kaczmarz",
    "longhorn",
    "relaxed_kaczmarz",
    "relaxed_kaczmarz_noqnorm",
    "transformer",
]


def load(grid: str) -> dict[str, list[float]]:
    """variant -> ppl@512 of each finished seed."""
    ppl: dict[str, list[float]] = {}
    for line in (RESULTS / grid / "runs.jsonl").read_text().splitlines():
        run = upgrade_record(json.loads(line))  # committed under gated_efla: efla_decay
        if run.get("status") == "ok":
            ppl.setdefault(run["variant"], []).append(run["eval"]["ppl@512"])
    return ppl


def main(argv: list[str] | None = None) -> None:
    """``argv``: ``--out DIR`` writes lm_regimes.png there instead of beside the committed runs
    (a check that the script still runs leaves the committed files alone)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="default results/issue11")
    folder = p.parse_args(argv or []).out or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    runs = {grid: load(grid) for grid in REGIMES}
    names = [v for v in ORDER if any(v in ppl for ppl in runs.values())]  # same x in both
    fig, axes = plt.subplots(1, len(REGIMES), figsize=(12, 4.8))
    for ax, (grid, title) in zip(axes, REGIMES.items(), strict=True):
        for x, name in enumerate(names):
            values = runs[grid].get(name)
            if not values:  # not trained in this regime (yet)
                continue
            ax.scatter(
                [x] * len(values), values, color="C3" if VARIANTS[name].get("use_decay") else "C0"
            )
            ax.hlines(sum(values) / len(values), x - 0.25, x + 0.25, color="0.3")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_title(title)
        ax.set_ylabel("validation ppl@512")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "31M-parameter models on the offline corpus (a dot per seed, a bar per mean; red: gated)"
    )
    fig.tight_layout()
    out = folder / "lm_regimes.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
