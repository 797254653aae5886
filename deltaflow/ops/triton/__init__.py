"""The Triton kernels, one file per stage of the chunked algorithm (docs/design.md §3, §7),
each kernel beside its launcher:

- ``rules.py``: the rule table, every built-in rule's strengths and derivatives by kernel id
- ``common.py``: the chunk length, the chunk tables of a batch, shared loads and products
- ``prepare.py``: stage 1, per chunk: the rule's strengths and the UT transform (W, Ũ, T)
- ``rebuild.py``: the backward's W and Ũ from the forward's kept T (no solve)
- ``states.py``: stage 2, per sequence: the forward's state passes (fused forward, state pass)
- ``dstates.py``: stage 2 of the backward, per sequence: the reverse state-gradient pass
- ``states_split.py``: the passes with the state in row blocks (``states.STATES_SPLIT_K``: Dk 256)
- ``segment_states.py``: stage 2 split across segments of each sequence ("auto" by default)
- ``segment_chain.py``: its chain across segments, one launch for every sequence and head
- ``outputs.py``: stage 3 of the two-pass forward, per chunk: the outputs
- ``gradients.py``: stage 3 of the backward, per chunk: every gradient but the state's
- ``gradients_lean.py``: the same with fewer live registers (``gradients.GRADS_LEAN``: "auto",
  at key blocks >= 128)
- ``gradients_fused.py``: both sides in one kernel for small heads (``gradients.GRADS_FUSED``:
  "off"; "auto" at half-precision heads of <= 64 columns)
- ``decode.py``: generation, a few tokens into an fp32 state in place

``deltaflow/ops/triton_backend.py`` assembles them into the op's forward, backward and decode.
"""

from __future__ import annotations

import importlib

# The stages in launch order: the order in which pin_cache_keys hashes their kernels.
STAGES = (
    "prepare",
    "rebuild",
    "states",
    "states_split",
    "dstates",
    "segment_states",
    "segment_chain",
    "outputs",
    "gradients",
    "gradients_lean",
    "gradients_fused",
    "decode",
)


def pin_cache_keys() -> None:
    """Compute every kernel's Triton cache key once, in one fixed order (the stage order).

    Triton 3.6 folds the constexpr globals a kernel's helpers use into the kernel's key in a way
    that depends on which kernel first hashed a shared helper: computing the prepare kernel's
    key before the gradient kernels' gives both other keys than the reverse order (same code).
    A process that launched in a different order than the one that filled Triton's disk cache
    then compiled again: check_triton's case processes recompiled 10-16 kernels per run (one
    60 s compile), and a process that ran a backward first would too. Hashing in one order in
    every process makes the keys, and so the cache, the same everywhere. ~30 ms at import."""
    for stage in STAGES:
        module = importlib.import_module(f"{__name__}.{stage}")
        for name in sorted(vars(module)):
            kernel = getattr(module, name)
            if name.endswith("_kernel") and getattr(kernel, "__module__", None) == module.__name__:
                getattr(kernel, "cache_key", None)  # the interpreter's functions have none
