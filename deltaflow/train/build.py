"""Building a run's parts from its config: the task, the model, the optimizer (with its
weight-decay groups); and the contract a trained model keeps (``model_logits``, batches, and
``lean_loss_sum`` for a model that computes its own loss without the logits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltaflow.train.config import TrainConfig
from deltaflow.train.packing import forward_parameters, packed_forward, unwrapped

IGNORE_INDEX = -100


def build_task(config: TrainConfig) -> Any:
    from deltaflow.tasks import get_task

    return get_task(config.task, **config.task_kwargs)


def task_vocab_size(config: TrainConfig) -> int:
    """The vocabulary of ``config``'s task, without building a language model's data."""
    if config.task == "lm":
        from deltaflow.tasks.language import get_tokenizer

        kw = config.task_kwargs
        return get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path")).vocab_size
    return build_task(config).vocab_size


def build_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    model_config = DeltaFlowConfig(vocab_size=vocab_size, **config.model)
    try:
        return DeltaFlowForCausalLM(model_config)
    except (RuntimeError, MemoryError) as err:  # torch: "can't allocate", "size ... overflowed"
        text = str(err)
        if not isinstance(err, MemoryError) and "allocate" not in text and "overflow" not in text:
            raise
        reason = text.splitlines()[0] if text else type(err).__name__
        raise ValueError(
            f"the model (hidden_size {model_config.hidden_size}, {model_config.num_layers} "
            f"layers, vocabulary {vocab_size}) is too large to create here ({reason}); "
            "make model.hidden_size or model.num_layers smaller"
        ) from None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: never norms, biases, scalars (A_log, dt_bias), embeddings."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() already de-duplicates tied weights
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_ids else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module, config: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.adam_eps,
        fused=device.type == "cuda",
    )


def model_logits(
    model: nn.Module, input_ids: torch.Tensor, doc_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [B, T, V] from a plain module or a transformers model (no labels, no cache).
    ``doc_starts`` [B, T] (packed documents): run the rows with ``cu_seqlens`` (packing.py)."""
    kwargs = _no_cache(model)
    if doc_starts is not None:
        out = packed_forward(model, input_ids, doc_starts, **kwargs)
    else:
        out = model(input_ids=input_ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    if logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"model must return logits [B, T, V] for input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    return logits


def _no_cache(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` where the forward takes it: training/eval never need the cache."""
    return {"use_cache": False} if "use_cache" in forward_parameters(model) else {}


# The forward keywords of a model that computes the LM loss itself, chunk by chunk, without the
# [B, T, V] logits (DeltaFlowForCausalLM; deltaflow/models/loss.py).
LEAN_LOSS_KEYWORDS = ("labels", "labels_are_shifted", "fuse_linear_cross_entropy")


def has_lean_loss(model: nn.Module) -> bool:
    """Whether the trainer may take the loss from :func:`lean_loss_sum`: the forward takes
    ``LEAN_LOSS_KEYWORDS`` and the model's config does not turn the fused loss off
    (``fuse_linear_cross_entropy=False``: then the loss comes from the logits, as for any
    other model)."""
    params = forward_parameters(model)
    config = getattr(unwrapped(model), "config", None)
    fused_off = getattr(config, "fuse_linear_cross_entropy", None) is False
    return all(k in params for k in LEAN_LOSS_KEYWORDS) and not fused_off


def lean_loss_sum(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    doc_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token cross-entropy summed over ``labels`` != IGNORE_INDEX (aligned: ``labels[t]``
    is the target of position ``t``), computed by a model with :func:`has_lean_loss` from its
    hidden states chunk by chunk: the number ``F.cross_entropy(logits, labels,
    reduction="sum")`` gives, without the [B, T, V] logits. ``doc_starts``: packed documents,
    as in :func:`model_logits`."""
    kwargs = dict(
        labels=labels, labels_are_shifted=True, fuse_linear_cross_entropy=True, **_no_cache(model)
    )
    if doc_starts is not None:
        out = packed_forward(model, input_ids, doc_starts, **kwargs)
    else:
        out = model(input_ids=input_ids, **kwargs)
    if out.logits is not None:
        raise ValueError(
            f"{type(unwrapped(model)).__name__} returned logits with fuse_linear_cross_entropy"
            "=True: the lean loss path expects .logits None (the [B, T, V] logits not built)"
        )
    # The model returns the mean over the micro-batch's scored labels (0 when there are none);
    # the trainer normalizes by the global batch's count itself, so it takes the sum.
    return out.loss * (labels != IGNORE_INDEX).sum()


def check_batch(batch: dict[str, torch.Tensor], batch_size: int | None = None) -> None:
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"task batch is missing {key!r} (has {sorted(batch)})")
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.ndim != 2 or labels.shape != ids.shape:
        raise ValueError(
            f"task batch must have input_ids and labels of equal shape [B, T], got "
            f"{tuple(ids.shape)} and {tuple(labels.shape)}"
        )
    if batch_size is not None and ids.shape[0] != batch_size:
        raise ValueError(f"task returned batch of {ids.shape[0]} rows, asked for {batch_size}")


def _check_tokenizer_fits(model: nn.Module, task: Any) -> None:
    """A language task's tokenizer must not produce ids past the model's embedding."""
    tokenizer = getattr(task, "tokenizer", None)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if tokenizer is None or not isinstance(embedding, nn.Embedding):
        return
    from deltaflow.tasks.tokenizers import check_vocab_fits

    desc = str(getattr(tokenizer, "path", tokenizer.name))
    check_vocab_fits(task.vocab_size, embedding.num_embeddings, desc)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: bf16/fp16 in float32; float32 and float64 as they are (an fp64
    run keeps fp64: accumulation tests compare its gradients to ~1e-12)."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
