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
    """Per-layer state for incremental decoding, passed as ``past_key_values`` or ``cache``."""

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


class StaticDecodeCache:
    """Preallocated decoding state for a fixed (batch, max length): CUDA-graph friendly.

    Each layer's buffers come from its mixer's ``decode_state`` (delta-rule layers: the fp32
    recurrent state and conv windows; softmax layers: a ``max_length``-column KV cache) and are
    only ever updated in place by ``decode_step``, so their addresses never change and one
    captured step can be replayed for every token. A prompt is prefilled with the chunked
    kernels into a :class:`DeltaFlowCache`, then copied in with :meth:`load`.
    """

    def __init__(self, mixers, batch_size: int, max_length: int, device: torch.device) -> None:
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(
                f"StaticDecodeCache: batch_size and max_length must be positive, got "
                f"{batch_size} and {max_length}"
            )
        self.batch_size = batch_size
        self.max_length = max_length
        self.layers: list[LayerState] = [
            m.decode_state(batch_size, max_length, device) for m in mixers
        ]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> LayerState:
        return self.layers[layer_idx]

    @torch.no_grad()
    def load(self, cache: DeltaFlowCache) -> None:
        """Copy a prefilled dynamic cache in (every buffer fully overwritten, in place)."""
        if len(cache) != len(self):
            raise ValueError(f"cache has {len(cache)} layers, this one {len(self)}")
        for i, (static, dynamic) in enumerate(zip(self.layers, cache.layers)):
            if "key" in static:
                self._load_kv(i, static, dynamic)
                continue
            for name, buf in static.items():
                if name not in dynamic:
                    raise ValueError(f"layer {i}: the prefilled cache has no {name!r}")
                src = dynamic[name]
                if src.shape != buf.shape:
                    raise ValueError(
                        f"layer {i}: {name} has shape {tuple(src.shape)}, the static cache "
                        f"{tuple(buf.shape)} (batch size {self.batch_size})"
                    )
                buf.copy_(src)

    def _load_kv(self, i: int, static: LayerState, dynamic: LayerState) -> None:
        columns = dynamic["key"].shape[2]
        if dynamic["key"].shape[0] != self.batch_size or columns >= self.max_length:
            raise ValueError(
                f"layer {i}: the prompt's KV cache is {tuple(dynamic['key'].shape)}; the static "
                f"cache holds batch {self.batch_size} and {self.max_length} columns (one free "
                "column per new token is needed)"
            )
        static["key_mask"].zero_()  # columns past the prompt are not keys yet
        for name in ("key", "value"):
            static[name][:, :, :columns].copy_(dynamic[name])
        for name in ("key_mask", "key_pos"):
            static[name][:, :columns].copy_(dynamic[name])
        static["num_tokens"].copy_(dynamic["num_tokens"])
        static["length"].fill_(columns)
