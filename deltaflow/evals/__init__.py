"""Evaluating trained language models with lm-evaluation-harness (pip install deltaflow[eval]).

- `pretrained.load_pretrained`: a model and its tokenizer from a run folder, a checkpoint or
  an exported Hugging Face folder.
- `harness`: the lm-eval model class ``deltaflow`` (``DeltaFlowLM``) and `harness.evaluate`;
  ``deltaflow-lm-eval`` (or ``python -m deltaflow.evals``) is the ``lm_eval`` command
  with that class registered.
- `local_tasks`: builds lm-eval tasks that point at local files from a corpus's held-out
  documents (last-word prediction, rolling perplexity), so evaluation runs offline.

Nothing here is imported by ``import deltaflow``: lm-eval is an optional dependency.
"""
