"""Running rows packed from several documents: ``doc_starts`` [B, T] -> ``cu_seqlens``.

A packed batch (``LanguageModeling(pack=True)``) marks with ``doc_starts[b, t] = True`` every
position where a document (or a piece of one) begins. deltaflow's model takes packed input as
one ``[1, N]`` row plus int offsets ``cu_seqlens`` ``[S + 1]`` of its S sequences; every layer
restarts there (the recurrent state, the short convolution, softmax attention's mask and RoPE
positions). So the B rows are laid end to end (a row's start is always a sequence start) and
the logits are folded back to ``[B, T, V]``: the model computes exactly what it would for each
document alone (tested in tests/test_documents.py).

Cost: the delta-rule layers pay nothing for packing; a softmax-attention layer (hybrids,
``attn_every``) builds a dense block-diagonal mask over all B x T tokens, quadratic in the
micro-batch: keep micro-batches of hybrids small (``grad_accum``) or set ``pack: false``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def cu_seqlens_from_starts(doc_starts: torch.Tensor) -> torch.Tensor:
    """int64 offsets ``[S + 1]`` of the sequences of ``doc_starts`` [B, T] laid end to end."""
    if doc_starts.dim() != 2 or doc_starts.dtype != torch.bool:
        raise ValueError(
            f"doc_starts must be a bool tensor [B, T], got {doc_starts.dtype} "
            f"{tuple(doc_starts.shape)}"
        )
    B, T = doc_starts.shape
    starts = doc_starts.detach().to("cpu").clone()
    starts[:, 0] = True  # a row never continues the row before it
    offsets = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([offsets, torch.tensor([B * T])]).long()


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (``.module``), or ``model`` itself."""
    return model.module if hasattr(model, "module") else model


def forward_parameters(model: nn.Module) -> Any:
    """The keyword parameters of the (unwrapped) model's forward."""
    return inspect.signature(unwrapped(model).forward).parameters


def accepts_cu_seqlens(model: nn.Module) -> bool:
    return "cu_seqlens" in forward_parameters(model)


def packed_forward(
    model: nn.Module, input_ids: torch.Tensor, doc_starts: torch.Tensor, **kwargs: Any
) -> Any:
    """``model`` on ``input_ids`` [B, T] whose rows pack documents at ``doc_starts``; returns
    the model's output with ``logits`` reshaped to [B, T, V] (a tensor, or ``.logits``; None
    stays None: a model computing its loss from ``labels`` [B, T] without logits)."""
    if not accepts_cu_seqlens(model):
        raise TypeError(
            f"{type(model).__name__}.forward takes no cu_seqlens, which packed documents need "
            "(deltaflow models take it); set the task's pack=false (--task-arg pack=false)"
        )
    if doc_starts.shape != input_ids.shape:
        raise ValueError(
            f"doc_starts {tuple(doc_starts.shape)} must have the shape of input_ids "
            f"{tuple(input_ids.shape)}"
        )
    B, T = input_ids.shape
    # Left on the CPU: the model checks the offsets there (no GPU sync) and moves them itself.
    cu_seqlens = cu_seqlens_from_starts(doc_starts)
    if kwargs.get("labels") is not None:  # the labels run laid end to end, like the ids
        kwargs["labels"] = kwargs["labels"].reshape(1, B * T)
    out = model(input_ids=input_ids.reshape(1, B * T), cu_seqlens=cu_seqlens, **kwargs)
    if hasattr(out, "logits"):
        if out.logits is not None:
            out.logits = out.logits.reshape(B, T, -1)
        return out
    if isinstance(out, tuple):
        return (out[0].reshape(B, T, -1), *out[1:])
    return out.reshape(B, T, -1)
