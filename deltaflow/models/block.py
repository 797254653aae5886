"""One layer of a DeltaFlow model: the mixer (delta-rule or softmax attention, from the config)
and the SwiGLU MLP in a pre-norm residual block, with selective activation checkpointing.

    h = h + Mixer(RMSNorm(h));  h = h + MLP(RMSNorm(h))   (the MLP step unless use_mlp=False)

The models that stack these blocks are in :mod:`deltaflow.models.modeling`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from deltaflow.layers.delta_attention import DeltaAttention
from deltaflow.layers.norm import RMSNorm
from deltaflow.layers.softmax_attention import SoftmaxAttention
from deltaflow.models.config import DeltaFlowConfig, delta_attention_kwargs


class _SwiGLUProduct(torch.autograd.Function):
    """``SiLU(a) ⊙ b`` saving only a and b: the op-by-op graph also keeps SiLU(a), an extra
    [tokens, intermediate] tensor per layer (88 MB at 16k tokens x 2816 in bf16)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        da = dy * b * (s * (1 + a * (1 - s)))
        db = dy * (a * s)
        return da, db


class SwiGLU(nn.Module):
    """``down(SiLU(gate x) ⊙ up x)``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.down_proj._is_residual_out = True  # init std / sqrt(2 n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SwiGLUProduct.apply(self.gate_proj(x), self.up_proj(x)))


def build_mixer(config: DeltaFlowConfig, layer_idx: int) -> nn.Module:
    """The token mixer of layer ``layer_idx`` from ``config.mixer_types``."""
    kind = config.mixer_types[layer_idx]
    if kind == "delta":
        # every layer argument by its name in the config (declared once: the layer's signature)
        mixer: nn.Module = DeltaAttention(**delta_attention_kwargs(config), layer_idx=layer_idx)
    else:
        mixer = SoftmaxAttention(
            hidden_size=config.hidden_size,
            num_heads=config.attn_num_heads or config.num_heads,
            num_kv_heads=config.attn_num_kv_heads,
            head_dim=config.attn_head_dim,
            rope_theta=config.rope_theta,
            window_size=config.sliding_window if kind == "sliding_attention" else None,
            qk_norm=config.attn_qk_norm,
            norm_eps=config.norm_eps,
            layer_idx=layer_idx,
            use_rope=config.position_embedding == "rope",
        )
    mixer.o_proj._is_residual_out = True
    return mixer


# The parts of a block that selective checkpointing names (the one list: compile_blocks, the
# block and benchmarks/model_training.py's --checkpoint check names against it). 'mixer' and
# 'mlp' recompute their glue in the backward; 'mixer_inputs' (with 'mixer', issue 31) also keeps
# the delta-rule op's inputs q, k, v, β, log α, so the op's backward needs no recompute first.
SELECTIVE_PARTS = ("mixer", "mlp", "mixer_inputs")


def selective_parts(parts: tuple[str, ...] | list[str] | bool) -> tuple[str, ...]:
    """``parts`` checked against :data:`SELECTIVE_PARTS` (True = 'mixer' and 'mlp', False =
    none): a misspelled name would otherwise silently checkpoint nothing."""
    if isinstance(parts, bool):
        return ("mixer", "mlp") if parts else ()
    if isinstance(parts, str):  # "mixer" is not ("m", "i", ...)
        raise TypeError(f"selective checkpointing parts are a tuple of names, got {parts!r}")
    unknown = [p for p in parts if p not in SELECTIVE_PARTS]
    if unknown:
        raise ValueError(
            f"selective checkpointing parts must be among {SELECTIVE_PARTS}, got {unknown}"
        )
    if "mixer_inputs" in parts and "mixer" not in parts:
        raise ValueError("'mixer_inputs' keeps tensors of the checkpointed mixer: add 'mixer'")
    return tuple(parts)


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: the matmuls and the sequence mixers
    (costly to redo), and the delta-rule op's inputs where the 'mixer_inputs' part marks them
    (``deltaflow.layers.delta_attention.keep_for_backward``). Everything else in a block
    (norms, the short conv, SiLU, gates, β and decay activations, L2 norms, the SwiGLU
    product) is elementwise or a row reduction, cheap to recompute in the backward's own fused
    kernels. The one exception is the Triton short conv (``conv.TRITON_SHORT_CONV``, issue 31
    item 4): an opaque kernel that the compiled backward cannot fuse, so its output (2 bytes
    per q|k|v channel per token) is kept rather than the kernel run again; it is in the graph
    only with that switch on. Likewise the conv + SiLU + L2 norm op (``conv.TRITON_CONV_NORM``).
    """
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    # the Triton ops (registered on import)
    for name in ("chunk_fwd", "chunk_fwd_varlen", "short_conv_fwd", "conv_silu_l2_fwd"):
        if hasattr(torch.ops, "deltaflow") and hasattr(torch.ops.deltaflow, name):
            ops.add(getattr(torch.ops.deltaflow, name).default)
    # The marker of keep_for_backward: in the graph only with the 'mixer_inputs' part on.
    ops.add(aten.alias_copy.default)
    return frozenset(ops)


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` under selective activation checkpointing with :func:`_keep_matmuls`."""
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_matmuls),
    )


class DeltaFlowBlock(nn.Module):
    """Pre-norm residual block: mixer then SwiGLU MLP.

    ``selective_checkpointing`` (set by :func:`deltaflow.models.compile.compile_blocks`): the
    parts named there ('mixer', 'mlp') keep only their matmul and sequence-mixer outputs for
    backward and recompute the elementwise glue, which under ``torch.compile`` fuses into the
    backward kernels (benchmarks/NOTES.md: bytes saved per token per layer); 'mixer_inputs'
    also keeps the delta-rule op's inputs (:data:`SELECTIVE_PARTS`)."""

    _parts: tuple[str, ...] = ()

    @property
    def selective_checkpointing(self) -> tuple[str, ...]:
        return self._parts

    @selective_checkpointing.setter
    def selective_checkpointing(self, parts: tuple[str, ...] | list[str] | bool) -> None:
        self._parts = selective_parts(parts)
        # the mixer marks its op's inputs itself (the policy only sees ops, not tensors)
        if hasattr(self.mixer, "keep_op_inputs"):
            self.mixer.keep_op_inputs = "mixer_inputs" in self._parts

    def __init__(self, config: DeltaFlowConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = build_mixer(config, layer_idx)
        # use_mlp=False: a mixer-only block (Zoology's MQAR models); no parameters left unused
        self.mlp_norm: RMSNorm | None = None
        self.mlp: SwiGLU | None = None
        if config.use_mlp:
            self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.mlp = SwiGLU(config.hidden_size, config.mlp_hidden_size)

    def forward(
        self,
        h: torch.Tensor,
        attention_mask: torch.Tensor | None = None,  # bool [B, T] from prepare_padding_mask
        state: dict[str, torch.Tensor] | None = None,
        use_cache: bool = False,
        cu_seqlens: torch.Tensor | None = None,  # checked offsets from prepare_cu_seqlens
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        parts = self.selective_checkpointing
        if parts and self.training and torch.is_grad_enabled() and not use_cache:
            if state is not None:
                raise ValueError("selective checkpointing is for training: no recurrent state")
            mix = _selective if "mixer" in parts else (lambda fn, *args: fn(*args))
            mlp = _selective if "mlp" in parts else (lambda fn, *args: fn(*args))
            h = h + mix(self._mix, h, attention_mask, cu_seqlens)
            return (h + mlp(self._mlp, h) if self.mlp is not None else h), None
        o, state = self.mixer(
            self.mixer_norm(h),
            attention_mask,
            state,
            use_cache,
            cu_seqlens=cu_seqlens,
            mask_prepared=True,
        )
        h = h + o
        if self.mlp is not None:
            h = h + self.mlp(self.mlp_norm(h))
        return h, state

    def _mix(
        self, h: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.mixer_norm(h)
        o, _ = self.mixer(x, attention_mask, None, False, cu_seqlens=cu_seqlens, mask_prepared=True)
        return o

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        assert self.mlp is not None and self.mlp_norm is not None
        return self.mlp(self.mlp_norm(h))
