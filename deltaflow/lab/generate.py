"""Sampling from a trained causal LM (temperature, top-k, top-p)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    decode_mode: str | None = None,
) -> torch.Tensor:
    """Continue ``input_ids`` [B, T] by ``max_new_tokens`` tokens; returns [B, T + n].

    ``temperature=0`` is greedy. deltaflow models go through their ``generate``: on CUDA a
    compiled one-token step replayed as a CUDA graph (``decode_mode`` to choose another, see
    :meth:`DeltaFlowForCausalLM.generate`), on CPU the recurrent cache; they sample from the
    global RNG (seed it with ``torch.manual_seed``). Any other model falls back to a full
    forward per token, sampling with ``generator``.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("max_new_tokens, temperature and top_k must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens == 0:
        return input_ids
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None) == "deltaflow":
        kw: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=None, decode_mode=decode_mode)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        else:
            kw.update(do_sample=False)
        return model.generate(input_ids, **kw)

    from deltaflow.models.generation import Sampling, choose_next

    # temperature 0 is greedy: Sampling's default (do_sample=False) is the argmax
    sampling = Sampling()
    if temperature > 0:
        sampling = Sampling(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = input_ids
    for _ in range(max_new_tokens):
        out = model(input_ids=tokens)
        logits = (out.logits if hasattr(out, "logits") else out)[:, -1]
        nxt = choose_next(logits, sampling, generator)  # the static decoder's token choice
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens
