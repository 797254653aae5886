"""Sampling from a trained causal LM (temperature, top-k) with the recurrent cache."""

from __future__ import annotations

import torch
from torch import nn


def _filter(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``input_ids`` [B, T] by ``max_new_tokens`` tokens; returns [B, T + n].

    ``temperature=0`` is greedy. deltaflow models prefill with the chunked op and then take
    one recurrent step per token (``past_key_values`` cache); any other model falls back to a
    full forward per token.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("max_new_tokens, temperature and top_k must be >= 0")
    if max_new_tokens == 0:
        return input_ids
    cache = None
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None) == "deltaflow":
        from deltaflow.models import DeltaFlowCache

        cache = DeltaFlowCache(config.num_layers)

    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        if cache is not None:
            return model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out = model(input_ids=ids)
        return (out.logits if hasattr(out, "logits") else out)[:, -1]

    tokens = [input_ids]
    logits = logits_of(input_ids)
    for i in range(max_new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(_filter(logits, temperature, top_k), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            logits = logits_of(nxt if cache is not None else torch.cat(tokens, dim=1))
    return torch.cat(tokens, dim=1)
