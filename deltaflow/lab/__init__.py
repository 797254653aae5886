"""deltaflow.lab: grids of training runs that compare step rules, with tables and plots.

    from deltaflow.lab import get_preset, compare
    rows, table = compare(get_preset("quick"), "results/quick")
    print(table)

``deltaflow compare --preset NAME`` is the command-line form; see docs/lab.md. One module per
job: ``grid`` (the runs of a preset), ``runner`` (training them, resumably, in a process pool),
``select`` (each cell's best learning rate), ``report`` (tables and prose), ``plots``,
``comparison`` (the whole job), ``presets``, ``paired`` (paired statistics over seeds).
"""

from __future__ import annotations

from typing import Any

from deltaflow import lazy_attribute

# Imported on first use (PEP 562): the command line imports only what a command needs.
_LAZY = {
    "compare": "deltaflow.lab.comparison",
    "RunSpec": "deltaflow.lab.grid",
    "expand_grid": "deltaflow.lab.grid",
    "PairedDifference": "deltaflow.lab.paired",
    "paired_difference": "deltaflow.lab.paired",
    "make_plots": "deltaflow.lab.plots",
    "PRESETS": "deltaflow.lab.presets",
    "VARIANTS": "deltaflow.lab.presets",
    "Preset": "deltaflow.lab.presets",
    "get_preset": "deltaflow.lab.presets",
    "markdown_report": "deltaflow.lab.report",
    "results_table": "deltaflow.lab.report",
    "run_grid": "deltaflow.lab.runner",
    "select_best": "deltaflow.lab.select",
}

__all__ = [
    "PRESETS",
    "VARIANTS",
    "Preset",
    "get_preset",
    "RunSpec",
    "expand_grid",
    "run_grid",
    "select_best",
    "compare",
    "make_plots",
    "results_table",
    "markdown_report",
    "PairedDifference",
    "paired_difference",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
