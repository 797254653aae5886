"""Regional compilation for training: ``torch.compile`` each block, not the whole model.

The glue around the delta-rule op (projections' epilogues, the short conv, L2 and RMS norms,
gates, SwiGLU) is ~90% of an eager training step on a GPU and is elementwise: inductor fuses
it into a few Triton kernels per block. Compiling each block separately (as torchtitan does)
compiles ONE graph that every layer reuses (parameters are graph inputs), so warm-up costs a
block, not the model; the embedding, the final norm and the chunked LM loss stay eager (the
loss is a loop over row chunks that already never materializes the logits).

The delta-rule op is a ``torch.library`` custom op with a fake kernel, so blocks compile with
``fullgraph=True``: a graph break would be a bug, not a slowdown.
"""

from __future__ import annotations

import torch
import torch.nn as nn

COMPILE_MODES = ("auto", "blocks", "off")


def resolve_compile(mode: str, device: torch.device) -> bool:
    """Whether the trainer compiles its model's blocks.

    ``auto`` is OFF for now: on CUDA, compiled DeltaAttention blocks whose activations are
    float32 (fp32 weights, also under bf16 autocast, the trainer's setting) returned wrong
    parameter gradients with the right loss in our GPU check (benchmarks/check_training.py,
    H100, torch 2.11; bf16 models were right), and a 200-step LM run diverged from the eager
    one. The cause is torch 2.11's dynamo zeroing the gradient through the norms' no-op cast
    (``deltaflow/compat.py``; reproduced on CPU with torch 2.11, right after the fix); ``blocks``
    stays refused on CUDA until ``benchmarks/check_compile_grads.py`` confirms that on a GPU.
    On CPU it is correct (tests) but its warm-up rarely pays off for the lab's small models.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "blocks" and device.type == "cuda":
        raise ValueError(
            "compile='blocks' is refused on CUDA: compiled blocks with float32 activations gave "
            "wrong gradients in benchmarks/check_training.py (bf16 models are right; see "
            "benchmarks/NOTES.md); use compile='off'"
        )
    return mode == "blocks"


def compile_blocks(
    model: nn.Module,
    *,
    selective_checkpointing: tuple[str, ...] | bool = ("mixer", "mlp"),
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str = "inductor",
) -> int:
    """Compile every block of a DeltaFlow model in place (``nn.Module.compile``: parameter
    names and ``state_dict`` keys are unchanged). Returns the number of blocks compiled.

    ``selective_checkpointing``: the parts of each block ('mixer', 'mlp'; True = both) that keep
    only matmul and mixer outputs for backward and recompute the rest inside the compiled
    backward (``DeltaFlowBlock.selective_checkpointing``).

    ``dynamic=None`` (dynamo's default): the first shape compiles static; a second one (an
    evaluation length, packed documents) recompiles once with dynamic sizes.

    ``backend``: torch.compile's; ``"aot_eager"`` traces the same graphs (fullgraph, the
    checkpointing policy, AOTAutograd) without generating code, for CPU smoke runs of the GPU
    checks (inductor's C++ compile takes minutes on a small CPU)."""
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise TypeError(f"compile_blocks: {type(model).__name__} has no .layers to compile")
    # Every layer is the same code with other parameters; evaluation lengths add shapes.
    limit = max(torch._dynamo.config.cache_size_limit, 8 * (1 + len(layers)))
    torch._dynamo.config.cache_size_limit = limit
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit
        )
    parts = {True: ("mixer", "mlp"), False: ()}.get(
        selective_checkpointing, selective_checkpointing
    )
    for block in layers:
        if hasattr(block, "selective_checkpointing"):
            block.selective_checkpointing = tuple(parts)
        block.compile(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
    return len(layers)
