"""The Triton kernels, one file per stage of the chunked algorithm (docs/design.md §3, §7),
each kernel beside its launcher:

- ``rules.py``: the rule table, every built-in rule's strengths and derivatives by kernel id
- ``common.py``: the chunk length, the chunk tables of a batch, shared loads and products
- ``prepare.py``: stage 1, per chunk: the rule's strengths and the UT transform (W, Ũ, T)
- ``states.py``: stage 2, per sequence: the state passes (fused forward, forward, reverse)
- ``outputs.py``: stage 3 of the two-pass forward, per chunk: the outputs
- ``gradients.py``: stage 3 of the backward, per chunk: every gradient but the state's
- ``decode.py``: generation, a few tokens into an fp32 state in place

``deltaflow/ops/triton_backend.py`` assembles them into the op's forward, backward and decode.
"""
