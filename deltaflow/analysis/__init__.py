"""deltaflow.analysis: the stability lab (`deltaflow stability`).

- :mod:`~deltaflow.analysis.spectrum`: eigenvalue mu = 1 - a||k||^2 of every rule, and of a
  trained model's real (k, beta) per head.
- :mod:`~deltaflow.analysis.growth`: long-run ||S_t|| of batched random chains in fp64, fp32,
  bf16 and fp16 (low precision emulated as a kernel rounds it), error against float64.
- :mod:`~deltaflow.analysis.discretization`: one-token error against exp(-beta kk^T).
- :mod:`~deltaflow.analysis.report`: the whole study (:func:`run_study`), markdown summary and
  plots; its parts: :mod:`~deltaflow.analysis.config` (:class:`StudyConfig`),
  :mod:`~deltaflow.analysis.verdicts` (a chain's verdict, table cells),
  :mod:`~deltaflow.analysis.growth_section` (experiments A and B),
  :mod:`~deltaflow.analysis.op_crosscheck` (experiment C: the real op) and
  :mod:`~deltaflow.analysis.layer_section` (a trained model's mu per head).
"""

from __future__ import annotations

from typing import Any

from deltaflow import lazy_attribute

# Imported on first use (PEP 562): the command line imports only what a command needs.
_LAZY = {
    "discretization_study": "deltaflow.analysis.discretization",
    "transition_errors": "deltaflow.analysis.discretization",
    "Chain": "deltaflow.analysis.growth",
    "make_chains": "deltaflow.analysis.growth",
    "parse_precision": "deltaflow.analysis.growth",
    "simulate": "deltaflow.analysis.growth",
    "summarize": "deltaflow.analysis.growth",
    "StudyConfig": "deltaflow.analysis.report",
    "run_study": "deltaflow.analysis.report",
    "layer_eigenvalues": "deltaflow.analysis.spectrum",
    "mu_of_h": "deltaflow.analysis.spectrum",
    "mu_of_norm": "deltaflow.analysis.spectrum",
    "mu_range": "deltaflow.analysis.spectrum",
    "rule_mu": "deltaflow.analysis.spectrum",
}

__all__ = [
    "Chain",
    "StudyConfig",
    "discretization_study",
    "layer_eigenvalues",
    "make_chains",
    "mu_of_h",
    "mu_of_norm",
    "mu_range",
    "parse_precision",
    "rule_mu",
    "run_study",
    "simulate",
    "summarize",
    "transition_errors",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
