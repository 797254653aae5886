"""Padding masks: validation and conversion to the bool form the mixers use."""

from __future__ import annotations

import torch


def prepare_padding_mask(
    attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, device: torch.device
) -> torch.Tensor | None:
    """Check a ``[B, T]`` 0/1 padding mask and return it as bool, or None if it has no padding.

    Each row's real tokens must be one contiguous run (left padding, right padding or both):
    padding in the middle of a sequence cannot be expressed as identity steps of a causal conv.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
        )
    if attention_mask.shape != (batch_size, seq_len):
        raise ValueError(
            f"attention_mask must have shape [batch, seq_len] = [{batch_size}, {seq_len}], "
            f"got {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:
        if not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must contain only 0 and 1 (1 = real token)")
        mask = attention_mask != 0
    mask = mask.to(device)
    if bool(mask.all()):
        return None
    count = mask.sum(1)
    pos = torch.arange(seq_len, device=device)
    first = torch.where(mask, pos, seq_len).amin(1)
    last = torch.where(mask, pos, -1).amax(1)
    if not bool(((count == 0) | (last - first + 1 == count)).all()):
        raise ValueError(
            "attention_mask: each row's real tokens must be contiguous (left and/or right "
            "padding); padding in the middle of a sequence is not supported"
        )
    return mask


def prepare_cu_seqlens(
    cu_seqlens: torch.Tensor, batch_size: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Check packed-sequence offsets ``[N + 1]`` (0 = first, seq_len = last, non-decreasing)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of offsets, N >= 1")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if batch_size != 1:
        raise ValueError(
            f"cu_seqlens packs sequences along T and needs batch size 1, got {batch_size}"
        )
    # Checked where the offsets are (a CPU tensor, as the trainer's packing makes them: no GPU
    # sync; on a GPU one sync, not one per condition), then moved without waiting: a pageable
    # host tensor is staged at once, so the copy never waits for the GPU's queue.
    cu = cu_seqlens.long()
    if bool((cu[0] != 0) | (cu[-1] != seq_len) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, end at seq_len={seq_len} and never decrease, "
            f"got {cu_seqlens.tolist()}"
        )
    return cu.to(device, non_blocking=True)


def position_in_sequence(
    cu_seqlens: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position within its sequence) of every packed token, both ``[T]``."""
    pos = torch.arange(seq_len, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:], pos, right=True)
    return seq, pos - cu_seqlens[seq]


def prepare_mixer_inputs(
    name: str,
    x: torch.Tensor,
    hidden_size: int,
    attention_mask: torch.Tensor | None,
    state: dict | None,
    use_cache: bool,
    cu_seqlens: torch.Tensor | None,
    mask_prepared: bool,
) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None, dict]:
    """The checks every token mixer starts with; returns ``B, T, mask, cu_seqlens, state``."""
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(
            f"{name}: hidden_states must be [B, T, {hidden_size}], got {tuple(x.shape)}"
        )
    B, T, _ = x.shape
    if T == 0:
        raise ValueError(f"{name}: the input has no tokens (sequence length 0)")
    if x.device.type == "meta":
        raise ValueError(
            f"{name}: hidden_states are on the meta device (shapes without data): move the "
            "module and its inputs to cpu or cuda"
        )
    if state is not None and not isinstance(state, dict):
        raise TypeError(
            f"{name}: state must be the dict a previous call returned (or None), got "
            f"{type(state).__name__}"
        )
    if mask_prepared:  # a model already checked the mask / offsets once for all layers
        mask = attention_mask
    else:
        mask = prepare_padding_mask(attention_mask, B, T, x.device)
        if cu_seqlens is not None:
            cu_seqlens = prepare_cu_seqlens(cu_seqlens, B, T, x.device)
    if cu_seqlens is not None and (mask is not None or state or use_cache):
        raise ValueError(
            "cu_seqlens (packed sequences) cannot be combined with attention_mask, state "
            "or use_cache"
        )
    return B, T, mask, cu_seqlens, ({} if state is None else state)


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, T, ...]`` with padded positions (``mask`` ``[B, T]`` False) set to exactly 0.

    Selected with ``torch.where``, never multiplied by the mask: ``0 * nan`` is nan, so a
    non-finite value at a padded position would survive a multiplication and reach the real
    tokens through the conv and the recurrence (and every weight gradient in the backward).
    """
    if mask is None:
        return x
    m = mask.view(*mask.shape, *([1] * (x.dim() - mask.dim())))
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def padding_as_identity_steps(
    mask: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None,
    log_decay: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Make every padded step of the recurrence the identity, for every rule: no erase and no
    write (k = v = 0, β = 0) and no decay (log α = 0); selected, not multiplied (see
    :func:`zero_padding`). k, v ``[B, T, H, D]``; β, log α ``[B, T, H]``."""
    if mask is None:
        return k, v, beta, log_decay
    k, v = zero_padding(k, mask), zero_padding(v, mask)
    if beta is not None:
        beta = zero_padding(beta, mask)
    if log_decay is not None:
        log_decay = zero_padding(log_decay, mask)
    return k, v, beta, log_decay
