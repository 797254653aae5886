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

from deltaflow.analysis.discretization import discretization_study, transition_errors
from deltaflow.analysis.growth import Chain, make_chains, parse_precision, simulate, summarize
from deltaflow.analysis.report import StudyConfig, run_study
from deltaflow.analysis.spectrum import layer_eigenvalues, mu_of_h, mu_of_norm, mu_range, rule_mu

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
