"""Learned absolute position embeddings (``position_embedding='learned'``, Zoology's attention
baseline): added to the token embeddings, counted as softmax attention counts its RoPE
positions, so padding, packing and a cache see the positions an unpadded sequence sees."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from deltaflow.layers.mask import position_in_sequence


def token_positions(
    T: int,
    past: int,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    limit: int,
    device: torch.device,
) -> torch.Tensor:
    """Absolute position ids ``[B or 1, T]`` of T new tokens after ``past`` cached ones, for
    learned position embeddings: counted as softmax attention counts its RoPE positions (real
    tokens before this one in its row, or in its packed document). ``mask``: None (no
    padding), ``[B, T]`` (no cache) or ``[B, past + T]`` (what transformers passes while
    decoding). ``limit``: the number of learned positions (``past + T`` beyond it raises,
    rather than an index error deep inside the embedding)."""
    if past + T > limit:
        raise ValueError(
            f"position {past + T - 1} is past the {limit} learned positions "
            "(max_position_embeddings)"
        )
    if cu_seqlens is not None:
        return position_in_sequence(cu_seqlens, T)[1][None]
    if mask is None:
        return torch.arange(past, past + T, device=device)[None]
    if mask.shape[-1] != past + T:  # the cache keeps no per-row count of earlier padding
        raise ValueError(
            f"learned positions continuing a cache of {past} tokens need the attention mask of "
            f"all {past + T} tokens, got {mask.shape[-1]} columns"
        )
    return (mask.long().cumsum(1) - 1).clamp_min(0)[:, past:]


class LearnedPositions(nn.Embedding):
    """``max_positions`` learned vectors; :meth:`add_to` adds each token's to its embedding."""

    def __init__(self, max_positions: int, hidden_size: int) -> None:
        super().__init__(max_positions, hidden_size)

    @classmethod
    def of(cls, config: Any) -> LearnedPositions | None:
        """A DeltaFlowConfig's learned positions; None unless position_embedding='learned'."""
        if config.position_embedding != "learned":
            return None
        return cls(config.max_position_embeddings, config.hidden_size)

    def add_to(
        self,
        h: torch.Tensor,
        past: int,
        mask: torch.Tensor | None,
        whole_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """``h [B, T, hidden]`` plus the embeddings of its tokens' positions, after ``past``
        cached tokens. ``mask``: the checked ``[B, T]`` padding mask (None: no padding);
        ``whole_mask``: the mask as the caller passed it, ``[B, past + T]`` while transformers
        decodes (the only place the padding before the cache is known)."""
        T = h.shape[1]
        if past and whole_mask is not None:  # an all-ones [B, T] mask, checked to None, could
            mask = whole_mask  # hide padding before the cache: only the whole mask will do
        return h + self(token_positions(T, past, mask, cu_seqlens, self.num_embeddings, h.device))
