"""Decoding cache: one dict of tensors per layer plus the number of columns processed.

A delta-rule layer keeps ``recurrent_state`` [B, H, Dk, Dv] (float32) and its short-conv
windows (``conv_q``, ``conv_k``, ``conv_v``: [B, C, W-1]); a softmax-attention layer keeps
``key``/``value`` [B, Hkv, Tc, D], ``key_mask`` [B, Tc] (False at padding) and ``key_pos``
[B, Tc] (RoPE positions). Layers own the meaning of their entries; this object only stores,
reorders and counts them, so it has no dependency on transformers' cache classes.
"""

from __future__ import annotations

import torch

LayerState = dict[str, torch.Tensor]


class DeltaFlowCache:
    """Per-layer state for incremental decoding, passed as ``past_key_values``."""

    is_compileable = False  # read by transformers.generate; we never want its static-cache path

    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError(f"DeltaFlowCache: num_layers must be positive, got {num_layers}")
        self.layers: list[LayerState] = [{} for _ in range(num_layers)]
        self.seen_tokens = 0  # columns (tokens or padding) processed so far

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> LayerState:
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of columns already processed (the length transformers slices inputs by)."""
        return self.seen_tokens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # unbounded: recurrent states are constant size, KV caches grow

    @property
    def batch_size(self) -> int | None:
        for state in self.layers:
            for t in state.values():
                return t.shape[0]
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows in place (beam search, or dropping finished sequences)."""
        for state in self.layers:
            for name, t in state.items():
                state[name] = t.index_select(0, beam_idx.to(t.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for state in self.layers:
            for name, t in state.items():
                state[name] = t.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def __repr__(self) -> str:
        kinds = [",".join(sorted(s)) or "empty" for s in self.layers]
        return f"DeltaFlowCache(seen_tokens={self.seen_tokens}, layers={kinds})"
