"""The models of ``benchmarks/model_training.py``, built from one architecture: deltaflow's
Gated DeltaNet, fla's (optional) and a Llama-style SDPA Transformer of the same size, with the
flags that size them. Also used by generation.py, saved_activations.py and context_parallel.py
(the same 400M model at other jobs).

Imported after ``--smoke`` has switched the Triton interpreter on (torch here, deltaflow and
fla inside the builders).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn
from _common import load_fla

# the parameter dtypes a run takes (--dtype)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fla_intermediate_size(hidden_size: int, hidden_ratio: int = 4) -> int:
    """fla's GatedMLP width for ``intermediate_size=None``: 2/3·ratio·hidden, rounded up to 256."""
    size = int(hidden_size * hidden_ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


def add_architecture_args(p: argparse.ArgumentParser) -> None:
    """The model-shape flags that :func:`shared_architecture` reads (360M-class defaults)."""
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, help="q/k head dim")
    p.add_argument("--expand-v", type=float, default=1.0, help="v head dim = head_dim * this")
    p.add_argument("--vocab", type=int, default=32000)


def shared_architecture(args: argparse.Namespace) -> dict[str, Any]:
    """The one architecture both models are built from (names are ours)."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        expand_v=args.expand_v,
        intermediate_size=fla_intermediate_size(args.hidden),
        conv_size=4,
        norm_eps=1e-6,
        tie_word_embeddings=False,  # fla's default
    )


def build_deltaflow(
    arch: dict[str, Any],
    compiled: bool = False,
    no_fused: bool = False,
    checkpoint: str = "mixer,mlp",
    backend: str = "inductor",
    triton_conv: bool | None = None,
    triton_conv_norm: bool | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Gated DeltaNet in deltaflow: delta rule + Mamba2 decay, sigmoid β, L2 q/k, short conv,
    output RMSNorm ⊙ SiLU gate, SwiGLU MLP; the lean loss is on in training mode.
    ``compiled``: every block under ``torch.compile`` (the training harness's CUDA default);
    ``backend``: its backend (CPU smoke runs trace with "aot_eager", no codegen).
    ``triton_conv``: sets the process-wide ``conv.TRITON_SHORT_CONV`` until the next build sets
    it (it is read when the model runs); None leaves it as it is. ``triton_conv_norm``: the same
    for ``conv.TRITON_CONV_NORM`` (the conv + SiLU + q/k L2 norms as one Triton op)."""
    from deltaflow.layers import conv
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks

    if triton_conv is not None:
        conv.TRITON_SHORT_CONV = triton_conv
    if triton_conv_norm is not None:
        conv.TRITON_CONV_NORM = triton_conv_norm

    config = DeltaFlowConfig(
        **arch,
        rule="delta",
        use_decay=True,
        beta_activation="sigmoid",
        qk_norm="l2",
        use_short_conv=True,
        use_output_gate=True,
        backend="auto",
    )
    model = DeltaFlowForCausalLM(config)
    if no_fused:
        for m in model.modules():
            if hasattr(m, "fused_projections"):
                m.fused_projections = False
    if compiled:
        parts = tuple(p for p in checkpoint.split(",") if p)
        compile_blocks(model, selective_checkpointing=parts, backend=backend)
    switches = {
        "triton_short_conv": conv.TRITON_SHORT_CONV,
        "triton_conv_norm": conv.TRITON_CONV_NORM,
    }
    return model, {**config.to_dict(), **switches}


def build_llama(arch: dict[str, Any], compiled: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """A Llama-style Transformer of the same size with SDPA (flash) attention: the quadratic
    model a linear-attention user compares against (same width, depth, heads, MLP, vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=arch["vocab_size"],
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"],
        num_key_value_heads=arch["num_heads"],
        head_dim=arch["head_dim"],
        rms_norm_eps=arch["norm_eps"],
        tie_word_embeddings=arch["tie_word_embeddings"],
        max_position_embeddings=1 << 17,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    if compiled:
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    return model, config.to_dict()


def build_fla(arch: dict[str, Any], linear_ce: bool) -> tuple[nn.Module, dict[str, Any]]:
    """fla's Gated DeltaNet of ``arch``; ImportError without fla (optional: callers report it)."""
    classes = load_fla("fla.models:GatedDeltaNetConfig", "fla.models:GatedDeltaNetForCausalLM")
    if classes is None:
        raise ImportError("fla is not installed")
    GatedDeltaNetConfig, GatedDeltaNetForCausalLM = classes
    config = GatedDeltaNetConfig(
        attn_mode="chunk",
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_heads=arch["num_heads"],
        head_dim=arch["head_dim"],
        expand_v=arch["expand_v"],
        vocab_size=arch["vocab_size"],
        intermediate_size=arch["intermediate_size"],
        conv_size=arch["conv_size"],
        norm_eps=arch["norm_eps"],
        tie_word_embeddings=arch["tie_word_embeddings"],
        use_gate=True,
        use_short_conv=True,
        allow_neg_eigval=False,
        # fla's defaults are fuse_cross_entropy=True (logits materialized, fused CE kernel);
        # --fla-linear-ce switches to its chunked linear + CE, the analogue of ours.
        fuse_cross_entropy=not linear_ce,
        fuse_linear_cross_entropy=linear_ce,
    )
    return GatedDeltaNetForCausalLM(config), config.to_dict()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights
