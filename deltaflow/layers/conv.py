"""Causal depthwise short convolution with padding masks and a decoding window.

Every mode runs the same computation: the previous window (zeros at the start of a sequence)
is concatenated in front of the new inputs, then a valid depthwise conv1d is applied. That
makes full-sequence, chunked-prefill and token-by-token decoding give identical outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaflow.layers import short_conv_triton
from deltaflow.layers.mask import position_in_sequence, zero_padding

# Issue 31 item 4: run the short conv (the fused q|k|v conv of DeltaAttention, and
# ShortConvolution without bias) on the Triton kernels of short_conv_triton.py, wherever they
# can run (a GPU, or the CPU interpreter; float16/bfloat16/float32), instead of the tap sum /
# aten conv1d below, which stay the reference. Off: measured slower in the training step
# (H100, 400M model, B=8 T=2048, session 15: 89.8k tok/s with it at its best launch settings,
# 93.5k without, +2.4 GB): alone its forward + backward beats the compiled tap sum (0.71 vs
# 0.92-1.21 ms a layer), but as an opaque op it stops inductor fusing the conv with the norms
# and activations around it (benchmarks/NOTES.md, "Issue 31, session 15"). Read at call time.
TRITON_SHORT_CONV = False

# Issue 31, session 15: DeltaAttention's fused path runs the q|k|v conv + SiLU AND the q/k L2
# norms as one Triton op (conv_norm_triton.py), so that the opaque kernel takes the norms with
# it instead of cutting them off from inductor's fusion (why TRITON_SHORT_CONV lost in the
# model). On since session 17: H100, 400M model, B=8 T=2048, pure bf16 step 100.5k -> 109.1k
# tok/s, the trainer's 94.1k -> 101.6k, +1.0 GB; its kernels 16-20 ms less GPU time a step
# (benchmarks/NOTES.md, "Issue 31, session 17"). Wherever the kernels can run: a GPU, or the
# CPU with the Triton interpreter on (the test suite turns it off there unless a test asks).
# Read at call time.
TRITON_CONV_NORM = True


def _triton_conv(x: torch.Tensor) -> bool:
    """The switch is on and the Triton kernels can take x."""
    return TRITON_SHORT_CONV and short_conv_triton.usable(x)


class ShortConvolution(nn.Module):
    """Causal depthwise conv over time: ``y_t = act(sum_j w_j x_{t-W+1+j})``, input ``[B, T, C]``.

    Padded positions (``mask == False``) are zeroed before the conv, so with left padding the
    conv sees the same zeros it would see at a sequence start; the decoding window is taken
    at each row's last real token, so right padding is handled as well.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int = 4,
        activation: str | None = "silu",
        bias: bool = False,
    ) -> None:
        super().__init__()
        if channels <= 0:
            raise ValueError(f"ShortConvolution: channels must be positive, got {channels}")
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: kernel_size must be >= 1, got {kernel_size}")
        if activation not in (None, "silu"):
            raise ValueError(
                f"ShortConvolution: activation must be 'silu' or None, got {activation!r}"
            )
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        # Same layout as nn.Conv1d(groups=channels): [C, 1, W].
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv1d's default (kaiming uniform with a = sqrt(5)) for a depthwise filter of W taps.
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        output_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x ``[B, T, C]``; mask ``[B, T]`` bool (True = real token); state ``[B, C, W-1]``;
        cu_seqlens: checked long offsets ``[N + 1]`` of sequences packed in x ``[1, T, C]``
        (the conv restarts at every sequence; no mask, state or output_state with it).

        Returns ``(y [B, T, C], new_state [B, C, W-1] or None)``.
        """
        if x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(
                f"ShortConvolution: x must be [B, T, {self.channels}], got {tuple(x.shape)}"
            )
        B, T, C = x.shape
        W = self.kernel_size
        if cu_seqlens is not None:
            if mask is not None or state is not None or output_state:
                raise ValueError(
                    "ShortConvolution: cu_seqlens excludes mask, state and output_state"
                )
            return self._forward_packed(x, cu_seqlens), None
        if mask is not None:
            if mask.shape != (B, T):
                raise ValueError(
                    f"ShortConvolution: mask must be [{B}, {T}], got {tuple(mask.shape)}"
                )
            x = zero_padding(x, mask)  # selected, not multiplied: 0 * nan is nan
        xt = x.transpose(1, 2)
        if state is None:
            prev = xt.new_zeros(B, C, W - 1)
        else:
            if state.shape != (B, C, W - 1):
                raise ValueError(
                    f"ShortConvolution: state must be [{B}, {C}, {W - 1}], got {tuple(state.shape)}"
                )
            prev = state.to(xt.dtype)
        full = torch.cat([prev, xt], dim=-1)  # [B, C, W-1+T]
        if self.bias is None and _triton_conv(x):
            y = short_conv_triton.short_conv(
                x,
                self.weight[:, 0],
                activation=self.activation,
                initial_state=None if state is None else prev,
            )
        else:
            y = F.conv1d(full, self.weight.to(xt.dtype), None, groups=C)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)[:, None]
            if self.activation == "silu":
                y = F.silu(y)
            y = y.transpose(1, 2).contiguous()  # [B, T, C] row-major for the heads
        new_state = None
        if output_state:
            if mask is None:
                new_state = full[..., full.shape[-1] - (W - 1) :].clone()
            else:
                # Window = the W-1 inputs ending at each row's last real token (-1 if none: the
                # old window is kept). In `full` coordinates token t sits at t + W - 1.
                pos = torch.arange(T, device=x.device)
                last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=1)  # [B]
                idx = last[:, None] + 1 + torch.arange(W - 1, device=x.device)  # [B, W-1]
                new_state = full.gather(2, idx[:, None, :].expand(B, C, W - 1)).contiguous()
        return y, new_state

    def step(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """One decoding step with a preallocated window, for CUDA-graph capture.

        x ``[B, C]`` (one token per row); window ``[B, C, W-1]`` (the previous inputs, oldest
        first) is shifted in place, so no tensor is allocated or re-bound between steps.
        Same numbers as :meth:`forward` with a state: the dot product over the W taps.
        """
        full = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)  # [B, C, W]
        acc = torch.promote_types(full.dtype, torch.float32)  # fp32 taps, like conv1d's
        y = (full.to(acc) * self.weight[:, 0].to(acc)).sum(-1)
        if self.bias is not None:
            y = y + self.bias.to(acc)
        window.copy_(full[..., 1:])
        y = F.silu(y) if self.activation == "silu" else y
        return y.to(x.dtype)

    def _forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Tap by tap, dropping taps that reach back into the previous packed sequence."""
        if self.bias is None and _triton_conv(x):
            return short_conv_triton.short_conv(
                x, self.weight[:, 0], activation=self.activation, cu_seqlens=cu_seqlens
            )
        T, W = x.shape[1], self.kernel_size
        _, p = position_in_sequence(cu_seqlens.to(x.device), T)
        xpad = F.pad(x, (0, 0, W - 1, 0))
        w = self.weight[:, 0].to(x.dtype)  # [C, W]; tap j multiplies x_{t - (W-1-j)}
        y = xpad[:, W - 1 : W - 1 + T] * w[:, W - 1]
        for j in range(W - 1):
            back = W - 1 - j
            y = y + xpad[:, j : j + T] * w[:, j] * (p >= back)[None, :, None].to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return F.silu(y) if self.activation == "silu" else y

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, activation={self.activation}"


def causal_conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv + activation over x ``[B, T, C]``, weight ``[C, W]``: the tap sum
    below under ``torch.compile`` (it fuses there), aten's ``conv1d`` in eager mode (one
    kernel instead of W products in float32); the Triton kernels when ``TRITON_SHORT_CONV``
    is on and they can run."""
    if _triton_conv(x):
        return short_conv_triton.short_conv(x, weight, activation=activation, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None or torch.compiler.is_compiling():
        return causal_conv_taps(x, weight, cu_seqlens, activation)
    W = weight.shape[-1]
    xt = F.pad(x.transpose(1, 2), (W - 1, 0))  # [B, C, W-1+T], zeros before the sequence
    y = F.conv1d(xt, weight.to(x.dtype)[:, None], None, groups=x.shape[-1])
    y = F.silu(y) if activation == "silu" else y
    return y.transpose(1, 2)


def causal_conv_taps(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """``act(sum_j w[:, j] x_{t-W+1+j})`` over x ``[B, T, C]`` with weight ``[C, W]``, as a sum
    of W shifted products accumulated in float32 (float64 for float64 inputs).

    Same numbers as :meth:`ShortConvolution.forward` without state (zeros before each sequence;
    with packed ``cu_seqlens`` a tap never reaches into the previous sequence), written as
    elementwise work instead of a depthwise ``conv1d`` so that ``torch.compile`` fuses the taps,
    the activation and what follows into one kernel (aten's depthwise conv was 31 ms of a 337 ms
    training step, forward and backward, at 16k tokens x 3072 channels x 24 layers).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc)
    xpad = F.pad(x, (0, 0, W - 1, 0)).to(acc)  # W-1 zeros in front of every row
    valid = None
    if cu_seqlens is not None:
        _, p = position_in_sequence(cu_seqlens.to(x.device), T)
    y = xpad[:, W - 1 : W - 1 + T] * w[:, W - 1]
    for j in range(W - 1):
        back = W - 1 - j  # tap j multiplies x_{t - back}
        term = xpad[:, j : j + T] * w[:, j]
        if cu_seqlens is not None:
            valid = (p >= back)[None, :, None]
            term = torch.where(valid, term, 0.0)
        y = y + term
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype)
