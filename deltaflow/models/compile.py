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

import contextlib
import importlib.util

import torch
import torch.nn as nn

from deltaflow.models.block import selective_parts

COMPILE_MODES = ("auto", "blocks", "off")

# The warm-up said before the first step ("first steps take ~N s"): inductor compiles one
# block's forward and backward (every layer reuses it) and the op's kernels compile at their
# first launch. H100, 400M model, B=8 x T=2048: 21 s with the op's kernels already compiled
# (benchmarks/results/issue30/s13call5/model_training.log), 32 s cold (issue27). CPU: not
# measured, a guess: inductor's C++ codegen takes minutes on a few cores (why the CPU tests
# trace with aot_eager).
WARMUP_SECONDS = {"cuda": 40, "cpu": 90}

# Blocks compiled with mode="reduce-overhead": inductor replays each block's forward and
# backward from CUDA graphs (cudagraph trees), so the host launches one graph per block instead
# of its ~70 kernels and the custom ops' Python. Why: the H100 step of the 400M model was
# host-bound (session 16: its kernels sum to 133-149 ms of a ~165 ms step). Measured session 17
# (H100, B=8 T=2048, conv norm op on): pure bf16 109.1k -> 126.6k tok/s, the trainer's step
# 101.6k -> 115.7k (benchmarks/NOTES.md, "Issue 31, session 17"). Packed sequences run their
# graphs without CUDA graphs (their ops are cudagraph_unsafe: ops/triton_ops.py). The trainer
# marks each step's start (torch.compiler.cudagraph_mark_step_begin) so a replay never
# overwrites outputs still in use. CUDA and inductor only (elsewhere compile_blocks leaves the
# mode unset).
CUDA_GRAPHS = True


def resolve_compile(mode: str, device: torch.device) -> bool:
    """Whether the trainer's ``compile`` setting asks for compiled blocks on ``device``.

    ``auto``: blocks on CUDA, eager elsewhere (on CPU the warm-up rarely pays off for the lab's
    small models). ``blocks``: everywhere. ``off``: eager. Whether compiling can run at all is
    :func:`compile_obstacle`'s.

    History: until session 15 CUDA's ``auto`` was eager and ``blocks`` refused there: with
    float32 activations (fp32 weights, and bf16 autocast over them, the trainer's setting)
    compiled blocks returned wrong parameter gradients with the right loss on an H100 with torch
    2.11, whose dynamo zeroed the gradient through the norms' no-op cast (fixed in
    ``deltaflow/compat.py``). ``benchmarks/check_training.py`` confirmed the fix on the GPU
    (``benchmarks/results/check_training_NVIDIA_H100_80GB_HBM3.json``: every Triton rule, fp32 /
    autocast / bf16, compiled gradients within issue 31's tolerances of eager's)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "auto":
        return device.type == "cuda"
    return mode == "blocks"


def compile_obstacle(model: nn.Module, device: torch.device) -> str | None:
    """Why the blocks of ``model`` cannot be compiled on ``device`` (None: they can): the
    reason, for the one line that says the run goes on eager instead."""
    if _blocks(model) is None:
        return f"{type(model).__name__} has no .layers blocks to compile"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed (inductor generates Triton kernels on CUDA)"
    return None


def auto_leaves_eager(model: nn.Module) -> str | None:
    """Why ``compile='auto'`` runs ``model``'s blocks eager although they could compile (None:
    it compiles them); ``compile='blocks'`` compiles them anyway.

    Softmax attention: session 31's Transformer LM runs (lab preset lm_corpus_1pass, H200,
    torch 2.11) trained 7-16 ppl worse compiled than the same run ids eager in session 8, while
    DeltaNet and Gated DeltaNet reproduced within 1.2 ppl. Session 32 re-ran the three eager:
    145.9 / 148.8 / 139.7 ppl (session 8: 143.1 / 144.0 / 143.3; compiled 158.8 / 158.8 /
    150.1), the compiled runs' training loss 0.07-0.14 nats higher on 3/3 seeds. Yet compiled
    and eager gradients agree at small shapes on the GPU (fp32 2e-6; autocast and bf16 within
    eager's own error) and on the CPU the curves agree, so the cause is not found
    (``results/issue33/README.md``, session 32). Until ``benchmarks/check_training.py --rules
    softmax --lm-models transformer`` passes at the preset's recipe, auto keeps them eager.
    """
    from deltaflow.layers.softmax_attention import SoftmaxAttention

    if any(isinstance(m, SoftmaxAttention) for m in model.modules()):
        return (
            "softmax-attention layers: compiled, they train worse on the GPU "
            "(Transformer LM runs ~11 ppl worse than eager, cause not found); compile='blocks' "
            "forces it"
        )
    return None


def _blocks(model: nn.Module) -> nn.ModuleList | None:
    return getattr(getattr(model, "model", model), "layers", None)


def blocks_compiled(model: nn.Module) -> bool:
    """Whether ``model``'s blocks run compiled (:func:`compile_blocks` was called on it)."""
    return any(getattr(b, "_compiled_call_impl", None) is not None for b in _blocks(model) or ())


def eager_blocks() -> contextlib.AbstractContextManager:
    """Run compiled blocks eager inside the block (``torch.compiler.set_stance("force_eager")``).

    For evaluation: it runs at lengths training never saw (state tracking's every even length
    40-256, a language model's 2x length), and each one that dynamo cannot treat as a dynamic
    size recompiles the block, so a fullgraph block hits the recompile limit and fails (session
    31 on the GPU: parity at 109 lengths, and SDPA's ``is_causal`` as a symbolic bool). A
    forward without grad gains little from compiling. torch < 2.6 (no set_stance): unchanged."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def uncompile_blocks(model: nn.Module) -> None:
    """Undo :func:`compile_blocks`: every block runs eager again, without the selective
    checkpointing that only pays off compiled (eager, it recomputes the glue op by op)."""
    for block in _blocks(model) or ():
        block._compiled_call_impl = None  # what nn.Module.compile set
        if hasattr(block, "selective_checkpointing"):
            block.selective_checkpointing = ()
    _set_graphed(model, False)


def _set_graphed(model: nn.Module, on: bool) -> None:
    """Tell the module holding the blocks whether they replay CUDA graphs: its forward then
    starts a new cudagraph-trees step when it runs without grad (DeltaFlowModel.forward)."""
    owner = getattr(model, "model", model)
    if on or hasattr(owner, "cuda_graph_blocks"):
        owner.cuda_graph_blocks = on


def compile_blocks(
    model: nn.Module,
    *,
    selective_checkpointing: tuple[str, ...] | bool = ("mixer", "mlp"),
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str = "inductor",
    cuda_graphs: bool | None = None,
) -> int:
    """Compile every block of a DeltaFlow model in place (``nn.Module.compile``: parameter
    names and ``state_dict`` keys are unchanged). Returns the number of blocks compiled.

    ``selective_checkpointing``: the parts of each block ('mixer', 'mlp'; True = both) that keep
    only matmul and mixer outputs for backward and recompute the rest inside the compiled
    backward (``DeltaFlowBlock.selective_checkpointing``); 'mixer_inputs' (with 'mixer') also
    keeps the delta-rule op's inputs (``deltaflow.models.block.SELECTIVE_PARTS``).

    ``dynamic=None`` (dynamo's default): the first shape compiles static; a second one (an
    evaluation length, packed documents) recompiles once with dynamic sizes.

    ``backend``: torch.compile's; ``"aot_eager"`` traces the same graphs (fullgraph, the
    checkpointing policy, AOTAutograd) without generating code, for CPU smoke runs of the GPU
    checks (inductor's C++ compile takes minutes on a small CPU).

    ``cuda_graphs``: replay the blocks from CUDA graphs (``mode="reduce-overhead"``); None =
    :func:`cuda_graphs_on` (the switch, inductor, CUDA present); True where that is False is
    refused, not ignored."""
    layers = _blocks(model)
    if layers is None:
        raise TypeError(f"compile_blocks: {type(model).__name__} has no .layers to compile")
    # Every layer is the same code with other parameters; evaluation lengths add shapes.
    limit = max(torch._dynamo.config.cache_size_limit, 8 * (1 + len(layers)))
    torch._dynamo.config.cache_size_limit = limit
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit
        )
    parts = selective_parts(selective_checkpointing)  # before compiling: a typo fails now
    possible = cuda_graphs_on(model, backend)
    if cuda_graphs and not possible:
        raise ValueError(
            "cuda_graphs=True needs compile.CUDA_GRAPHS on, backend='inductor' and CUDA, "
            f"got CUDA_GRAPHS={CUDA_GRAPHS}, backend={backend!r}, "
            f"CUDA available: {torch.cuda.is_available()}"
        )
    graphs = possible if cuda_graphs is None else cuda_graphs
    mode = {"mode": "reduce-overhead"} if graphs else {}
    for block in layers:
        if hasattr(block, "selective_checkpointing"):
            block.selective_checkpointing = tuple(parts)
        block.compile(fullgraph=fullgraph, dynamic=dynamic, backend=backend, **mode)
    _set_graphed(model, bool(mode))
    return len(layers)


def cuda_graphs_on(model: nn.Module, backend: str = "inductor") -> bool:
    """Whether compiled blocks of ``model`` replay CUDA graphs: ``CUDA_GRAPHS``, inductor, and
    CUDA present (not the parameters' device: a benchmark compiles before it moves the model;
    inductor leaves CPU graphs alone anyway)."""
    del model  # one rule for every model today; the argument keeps call sites stable
    return CUDA_GRAPHS and backend == "inductor" and torch.cuda.is_available()
