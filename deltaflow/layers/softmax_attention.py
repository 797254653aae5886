"""Softmax attention baseline (and sliding-window variant for hybrids).

Same interface as :class:`deltaflow.layers.DeltaAttention`:
``(y, state) = layer(x, attention_mask, state, use_cache)``.

torch SDPA with RoPE and grouped KV heads. Positions count real tokens only, so a left-padded
row sees exactly what the unpadded sequence sees. The KV cache stores keys after RoPE with
their validity mask and positions; a sliding window is applied by masking, and the cache is
trimmed to the last ``window_size - 1`` keys whenever no row has padding in it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaflow.layers.heads import resolve_head_dim
from deltaflow.layers.mask import position_in_sequence, prepare_mixer_inputs, zero_padding
from deltaflow.layers.norm import RMSNorm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split layout) of x ``[B, T, H, D]`` at positions ``[B, T]``."""
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
    xf = x.float()
    return (xf * emb.cos() + rotate_half(xf) * emb.sin()).to(x.dtype)


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention with RoPE, GQA, optional sliding window and qk-norm.

    Args:
        hidden_size: model width. num_heads: query heads. num_kv_heads: key/value heads
            (divides num_heads; default num_heads). head_dim: default hidden_size // num_heads.
        rope_theta: RoPE base. window_size: attend to the last ``window_size`` tokens only
            (including the current one); None = full causal attention.
        qk_norm: RMSNorm on q and k per head (stabilizes training at high learning rates).
        use_rope: False: no rotary embedding (the model adds learned absolute positions
            instead; ``position_embedding='learned'`` in DeltaFlowConfig).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        window_size: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        use_rope: bool = True,
    ) -> None:
        super().__init__()
        head_dim = resolve_head_dim(hidden_size, num_heads, head_dim)
        if head_dim <= 0 or (use_rope and head_dim % 2 != 0):
            raise ValueError(f"head_dim must be a positive even number (RoPE), got {head_dim}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must be positive and divide num_heads ({num_heads})"
            )
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size must be None or >= 1, got {window_size}")
        if rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {rope_theta}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = float(rope_theta)
        self.use_rope = use_rope
        self.window_size = window_size
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window={self.window_size}, "
            + (f"rope_theta={self.rope_theta}" if self.use_rope else "no rope")
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        state: dict[str, torch.Tensor] | None = None,
        use_cache: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        mask_prepared: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """hidden_states ``[B, T, hidden]``; attention_mask ``[B, T]`` for these T tokens
        (``mask_prepared``: already the bool-or-None output of ``prepare_padding_mask``);
        ``cu_seqlens``: offsets of sequences packed in ``[1, T, hidden]`` (block-diagonal
        causal attention, positions restart per sequence).

        Returns ``(y, state)``; ``state`` (with ``use_cache``) holds ``key``/``value``
        ``[B, Hkv, Tc, D]``, ``key_mask`` and ``key_pos`` ``[B, Tc]`` and ``num_tokens [B]``.
        """
        x = hidden_states
        B, T, mask, cu_seqlens, state = prepare_mixer_inputs(
            "SoftmaxAttention",
            x,
            self.hidden_size,
            attention_mask,
            state,
            use_cache,
            cu_seqlens,
            mask_prepared,
        )
        x = zero_padding(x, mask)  # nan at a padded key/value must not reach real tokens
        past_k = state.get("key")

        # Position of each token = number of real tokens before it in its row.
        valid = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        n_past = state.get("num_tokens")  # real tokens seen so far, per row
        if n_past is None:
            n_past = torch.zeros(B, dtype=torch.long, device=x.device)
        pos = n_past[:, None] + valid.long().cumsum(1) - 1
        pos = pos.clamp_min(0)
        if cu_seqlens is not None:  # packed sequences: positions restart in every sequence
            seq_id, pos_in_seq = position_in_sequence(cu_seqlens, T)
            pos = pos_in_seq[None]
        q, k, v = self._heads(x, pos)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]

        if past_k is not None:
            k_all = torch.cat([past_k, k], dim=2)
            v_all = torch.cat([state["value"], v], dim=2)
            kmask = torch.cat([state["key_mask"], valid], dim=1)
            kpos = torch.cat([state["key_pos"], pos], dim=1)
        else:
            k_all, v_all, kmask, kpos = k, v, valid, pos
        Tk = k_all.shape[2]

        attn_mask = None
        is_causal = False
        if cu_seqlens is not None:
            same = seq_id[:, None] == seq_id[None, :]
            allowed = same & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            if self.window_size is not None:
                allowed = allowed & (pos[0][:, None] - pos[0][None, :] < self.window_size)
            attn_mask = allowed[None, None]  # block-diagonal causal [1, 1, T, T]
        elif mask is None and past_k is None and self.window_size is None:
            # the fast path. A plain bool: SDPA refuses a SymBool, which bool(T > 1) still is
            # under dynamo with a dynamic T; a branch makes dynamo guard on T > 1 instead
            is_causal = True if T > 1 else False  # noqa: SIM210
        elif not (past_k is not None and T == 1 and self.window_size is None and bool(kmask.all())):
            # Column causality (query i sits at column Tk - T + i), padding and window by position.
            qcol = torch.arange(Tk - T, Tk, device=x.device)
            kcol = torch.arange(Tk, device=x.device)
            allowed = (kcol[None, :] <= qcol[:, None])[None] & kmask[:, None, :]
            if self.window_size is not None:
                allowed = allowed & (pos[:, :, None] - kpos[:, None, :] < self.window_size)
            # Every query keeps its own column, so padded queries have a finite (unused) output.
            allowed = allowed | (kcol[None, :] == qcol[:, None])[None]
            attn_mask = allowed[:, None]  # [B, 1, T, Tk]

        group = self.num_heads // self.num_kv_heads
        kr = k_all.repeat_interleave(group, dim=1) if group > 1 else k_all
        vr = v_all.repeat_interleave(group, dim=1) if group > 1 else v_all
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), kr, vr, attn_mask=attn_mask, is_causal=is_causal
        )
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

        if not use_cache:
            return y, None
        if self.window_size is not None and Tk >= self.window_size and bool(kmask.all()):
            # Without padding, column = position: later queries only reach the last W-1 keys.
            keep = self.window_size - 1
            k_all, v_all = k_all[:, :, Tk - keep :], v_all[:, :, Tk - keep :]
            kmask, kpos = kmask[:, Tk - keep :], kpos[:, Tk - keep :]
        state.update(
            key=k_all, value=v_all, key_mask=kmask, key_pos=kpos, num_tokens=n_past + valid.sum(1)
        )
        return y, state

    # ---------------------------------------------------------------- static decoding

    def decode_state(
        self, batch_size: int, max_length: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """A preallocated KV cache of ``max_length`` columns for :meth:`decode_step`.

        ``key``/``value`` ``[B, Hkv, max_length, D]``, ``key_mask``/``key_pos`` ``[B,
        max_length]`` (unused columns are masked out), ``num_tokens [B]`` (RoPE position of
        the next token) and ``length`` ``[1]``: the next column to write, kept on the device
        so that a captured step advances it without the host.
        """
        dtype = self.q_proj.weight.dtype
        shape = (batch_size, self.num_kv_heads, max_length, self.head_dim)
        return {
            "key": torch.zeros(shape, device=device, dtype=dtype),
            "value": torch.zeros(shape, device=device, dtype=dtype),
            "key_mask": torch.zeros(batch_size, max_length, device=device, dtype=torch.bool),
            "key_pos": torch.zeros(batch_size, max_length, device=device, dtype=torch.long),
            "num_tokens": torch.zeros(batch_size, device=device, dtype=torch.long),
            "length": torch.zeros(1, device=device, dtype=torch.long),
        }

    def _heads(
        self, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[B, T, H, D]``, k and v ``[B, T, Hkv, D]`` of x ``[B, T, hidden]``: projections,
        optional q/k RMSNorm, RoPE at positions ``pos [B or 1, T]`` (shared by forward and
        decode_step)."""
        B, T = x.shape[:2]
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.use_rope:
            return q, k, v
        return apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta), v

    def decode_step(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per row, x ``[B, hidden]`` -> ``[B, hidden]``: writes its key and value at
        column ``state['length']`` in place and attends over the masked full buffer (static
        shapes, no host sync: capturable in a CUDA graph). Same math as :meth:`forward`."""
        B = x.shape[0]
        pos = state["num_tokens"][:, None]  # [B, 1]: real tokens before this one
        q, k, v = self._heads(x[:, None], pos)
        col = state["length"]
        state["key"].index_copy_(2, col, k.transpose(1, 2))
        state["value"].index_copy_(2, col, v.transpose(1, 2))
        state["key_mask"].index_fill_(1, col, True)
        state["key_pos"].index_copy_(1, col, pos)
        allowed = state["key_mask"]
        if self.window_size is not None:
            allowed = allowed & (pos - state["key_pos"] < self.window_size)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            state["key"],
            state["value"],
            attn_mask=allowed[:, None, None, :],
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        state["num_tokens"].add_(1)
        state["length"].add_(1)
        return self.o_proj(o.reshape(B, self.num_heads * self.head_dim))
