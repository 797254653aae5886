"""A Trainer's evaluation: metrics per length and the headline, pooled or token-weighted
(a mixin of :class:`deltaflow.train.trainer.Trainer`)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from deltaflow.models.compile import eager_blocks
from deltaflow.train.build import IGNORE_INDEX, check_batch, model_logits


class EvaluationMixin:
    """A Trainer's evaluation on its task's fixed evaluation set."""

    # ------------------------------------------------------------------ evaluation
    def eval_lengths(self) -> tuple[list[int | None], bool]:
        """Lengths to evaluate at, and whether the headline metric is their mean."""
        if self.config.eval_lengths is not None:
            return list(self.config.eval_lengths), hasattr(self.task, "eval_lengths")
        if getattr(self.task, "eval_lengths", None):
            return list(self.task.eval_lengths), True
        return [None], False

    @torch.no_grad()
    def evaluate(self, split: str | None = None, progress: bool = False) -> dict[str, float]:
        """Metrics on the task's fixed evaluation set, per length (``name@L``) and headline.

        The headline (unsuffixed) metrics are the mean over lengths for tasks defining
        ``eval_lengths`` (state tracking: the test distribution is all of them), else the
        first length (language modelling: the training length). ``progress``: a bar per
        length (``deltaflow eval``; the trainer's own evaluations run under its step bar).
        """
        split = split or self.config.eval_split
        model = self.raw_model  # no DDP hooks in eval (rank 0 only; all ranks under FSDP)
        model.eval()
        lengths, mean_headline = self.eval_lengths()
        per_length: list[dict[str, float]] = []
        out: dict[str, float] = {}
        for length in lengths:
            kwargs = dict(self.config.eval_kwargs)
            if length is not None:
                kwargs["length"] = length
            desc = f"eval {self.config.task} {split}" + (f" @{length}" if length else "")
            with eager_blocks():  # compiled blocks would recompile for each new length
                metrics = self._evaluate_one(model, split, kwargs, desc if progress else None)
            per_length.append(metrics)
            if length is not None and len(lengths) > 1:
                out.update({f"{k}@{length}": v for k, v in metrics.items()})
        if mean_headline and len(per_length) > 1:
            keys = set.intersection(*(set(m) for m in per_length))
            out.update({k: sum(m[k] for m in per_length) / len(per_length) for k in sorted(keys)})
        else:
            out.update(per_length[0])
        return out

    def _evaluate_one(
        self, model: nn.Module, split: str, kwargs: dict[str, Any], bar: str | None = None
    ) -> dict[str, float]:
        """Pool the whole evaluation set exactly when the task offers ``metric_sums``/``finalize``
        (additive statistics); otherwise average per-batch ``metrics`` weighted by scored tokens."""
        pooled = hasattr(self.task, "metric_sums") and hasattr(self.task, "finalize")
        sums: dict[str, float] = {}
        total = 0
        batches = self.task.eval_batches(split, **kwargs)
        count = _eval_batch_count(self.task, kwargs) if bar is not None else None
        for batch in tqdm(
            batches, desc=bar, total=count, unit="batch", disable=bar is None, leave=False
        ):
            check_batch(batch)
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with self._autocast():
                logits = model_logits(model, batch["input_ids"], batch.get("doc_starts"))
                logits = logits.float()
            if pooled:
                stats, weight = self.task.metric_sums(logits, batch), 1
            else:
                weight = int((batch["labels"] != IGNORE_INDEX).sum())
                stats = self.task.metrics(logits, batch)
            total += weight
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        if total == 0:
            raise ValueError(f"evaluation set of task {self.config.task!r} ({split}) is empty")
        if pooled:
            return {k: float(v) for k, v in self.task.finalize(sums).items()}
        out = {k: v / total for k, v in sums.items()}
        if "loss" in out and "ppl" in out:
            out["ppl"] = math.exp(out["loss"])  # exp of the mean loss, not the mean of exps
        return out

    def _eval_and_log(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        with self.layout.whole_sequences():  # context parallel: each process evaluates alone
            if self.sharded:  # every rank runs the forward passes (they all-gather the weights)
                metrics = self.evaluate()
            elif self.dist.is_main:
                metrics = self.evaluate()
        if self.dist.is_main:
            self.logger.log("eval", self.step, split=self.config.eval_split, **metrics)
            self.logger.flush()
        if self.dist.world_size > 1:
            dist.barrier()
        return metrics


def _eval_batch_count(task: Any, kwargs: dict[str, Any]) -> int | None:
    """Batches of an evaluation set when its size and batch size are known (the bar's total;
    None: the bar counts without an ETA)."""
    try:
        defaults = inspect.signature(task.eval_batches).parameters
    except (TypeError, ValueError):
        return None
    sizes = []
    for name in ("num_examples", "batch_size"):
        default = defaults[name].default if name in defaults else None
        value = kwargs.get(name, default)
        sizes.append(value if isinstance(value, int) and value > 0 else None)
    if None in sizes:
        return None
    return math.ceil(sizes[0] / sizes[1])
