"""Issue 35, point 8: compare plots say what they draw (the training curves are the best
seed's run) and keep one colour per variant across panels."""

from __future__ import annotations

from matplotlib.colors import to_hex

from deltaflow.lab import get_preset, plots


def _rows(preset, cells, variants):
    rows = []
    for cell in cells:
        for i, variant in enumerate(variants):
            rows.append(
                {
                    "variant": variant,
                    "cell": cell,
                    "width": None,
                    "value": 0.1 * i,
                    "best_lr": 1e-3,
                    "n_seeds": 3,
                    "curve_seed": 2,
                    "curve": [[1, 2.0], [2, 1.0]],
                    "eval_curve": [[1, 0.1], [2, 0.2]],
                    "metrics": {},
                }
            )
    return rows


def test_curves_are_labelled_and_colours_follow_the_variant(tmp_path, monkeypatch):
    preset = get_preset("quick")
    cells = list(preset.cells)
    variants = list(preset.variants)
    # each panel holds another subset of the variants: colours must not shift with it
    rows = [
        r
        for r in _rows(preset, cells, variants)
        if not (r["cell"] == cells[0] and r["variant"] == variants[0])
    ]
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path.name)
    assert plots.plot_loss_curves(rows, preset, tmp_path) == "loss_curves.png"
    (fig,) = figures
    colour: dict[str, str] = {}
    titles = []
    for ax in fig.axes:
        titles.append(ax.get_title())
        for line in ax.get_lines():
            variant = line.get_label().split(" (")[0]
            assert "seed 2: best of 3" in line.get_label()
            assert colour.setdefault(variant, to_hex(line.get_color())) == to_hex(line.get_color())
    assert len(colour) == len(variants) and len(set(colour.values())) == len(variants)
    assert all("best seed's run; the table: mean of seeds" in t for t in titles)
