"""deltaflow.lab: grids of training runs that compare step rules, with tables and plots.

    from deltaflow.lab import get_preset, compare
    rows, table = compare(get_preset("quick"), "results/quick")
    print(table)

``deltaflow compare --preset NAME`` is the command-line form; see docs/lab.md. One module per
job: ``grid`` (the runs of a preset), ``runner`` (training them, resumably, in a process pool),
``select`` (each cell's best learning rate), ``report`` (tables and prose), ``plots``,
``comparison`` (the whole job), ``presets``, ``paired`` (paired statistics over seeds).
"""

from deltaflow.lab.comparison import compare
from deltaflow.lab.grid import RunSpec, expand_grid
from deltaflow.lab.paired import PairedDifference, paired_difference
from deltaflow.lab.plots import make_plots
from deltaflow.lab.presets import PRESETS, VARIANTS, Preset, get_preset
from deltaflow.lab.report import markdown_report, results_table
from deltaflow.lab.runner import run_grid
from deltaflow.lab.select import select_best

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
