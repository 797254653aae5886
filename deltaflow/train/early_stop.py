"""``early_stop``: end a run once its evaluation reaches a threshold (Zoology's MQAR recipe
stops at validation accuracy 0.99), and the Trainer's check at each evaluation (a mixin of
:class:`deltaflow.train.trainer.Trainer`).

The rule is a string, ``METRIC>=X`` or ``METRIC<=X`` (``accuracy>=0.99``, ``loss<=1.2``),
checked against the headline metric of every periodic evaluation (``eval_every``, on
``eval_split``): :meth:`~deltaflow.train.evaluation.EvaluationMixin.evaluate`'s unsuffixed
value, the mean over the task's ``eval_lengths`` for state tracking, else the first length.
A run that reaches it ends there as a finished run (final checkpoint, ``final.json``,
``final/``), with ``stopped_early_at`` in its summary; resuming it trains no further.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deltaflow.validation import describe, did_you_mean

# The evaluation metrics early_stop may watch, each with the comparison that means "good
# enough": accuracies stop at or above a threshold, losses at or below one.
METRICS = {
    "accuracy": ">=",
    "scaled_accuracy": ">=",
    "sequence_accuracy": ">=",
    "loss": "<=",
    "ppl": "<=",
    "bpb": "<=",
}
_FRACTIONS = ("accuracy", "scaled_accuracy", "sequence_accuracy")  # at most 1
_LM_METRICS = ("loss", "ppl", "bpb")  # what language modelling reports
_SYNTAX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|=>|=<|>|<|==|=)\s*(.*?)\s*$")
FORM = "METRIC>=X or METRIC<=X, e.g. 'accuracy>=0.99' or 'loss<=1.2'"


@dataclass(frozen=True)
class EarlyStop:
    """A parsed ``early_stop``: stop once ``metric op threshold`` holds at an evaluation."""

    metric: str
    op: str  # '>=' or '<='
    threshold: float
    text: str  # the threshold as written (the config keeps it)

    @classmethod
    def parse(cls, text: str) -> EarlyStop:
        """``'accuracy>=0.99'`` parsed; a one-line ``ValueError`` naming the field for a bad
        form, an unknown metric, a threshold that is not a number or a comparison in the wrong
        direction (accuracies stop at >=, loss, ppl and bpb at <=)."""
        match = _SYNTAX.match(text)
        if match is None:
            raise ValueError(f"early_stop must look like {FORM}, got {text!r}")
        metric, op, raw = match.groups()
        if metric not in METRICS:
            raise ValueError(
                f"early_stop: unknown metric {metric!r}{did_you_mean(metric, METRICS)}; "
                f"known: {', '.join(METRICS)}"
            )
        good = METRICS[metric]
        if op != good:
            kind = "higher" if good == ">=" else "lower"
            raise ValueError(
                f"early_stop: {metric} is {kind}-is-better: write {metric}{good}X "
                f"(got {text.strip()!r})"
            )
        try:
            threshold = float(raw)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold):
            raise ValueError(f"early_stop: the threshold {raw!r} is not a finite number ({FORM})")
        if metric in _FRACTIONS and threshold > 1.0:
            raise ValueError(
                f"early_stop: {metric} is at most 1, so {metric}>={raw} would never stop the run"
            )
        return cls(metric, op, threshold, raw)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.text}"

    def reached(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def check_task(self, task: str, task_cls: type) -> None:
        """The metric is one that the (registered) task's evaluation reports."""
        from deltaflow.tasks import LanguageModeling

        if issubclass(task_cls, LanguageModeling):
            reported = _LM_METRICS
        else:
            reported = tuple(m for m in METRICS if m not in ("ppl", "bpb"))
        if self.metric not in reported:
            raise ValueError(
                f"early_stop: task {task!r} reports no {self.metric!r}; it reports "
                f"{', '.join(reported)}"
            )


def check_early_stop(value: Any) -> str | None:
    """A config's ``early_stop`` checked and written one way (``'accuracy >= 0.99'`` is
    ``'accuracy>=0.99'``: one run id per rule); None is off."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"early_stop must be a string, {FORM}, or null (off), got {describe(value)}"
        )
    return str(EarlyStop.parse(value))


class EarlyStopMixin:
    """A Trainer's check of ``config.early_stop`` after each periodic evaluation."""

    def _early_stop_reached(self, metrics: dict[str, float]) -> bool:
        """Whether this evaluation's headline metric meets ``config.early_stop``; rank 0
        decides for every rank. When it does: one line (verbose) and an ``early_stop`` event
        in the log."""
        rule = self.config.early_stop_rule
        if rule is None:
            return False
        code = 0  # 0: go on, 1: reached, 2: the evaluation has no such metric
        if self.dist.is_main:
            value = metrics.get(rule.metric)
            code = 2 if value is None else int(rule.reached(float(value)))
        if self.dist.world_size > 1:
            flag = torch.tensor([float(code)], device=self.device)
            dist.broadcast(flag, src=0)
            code = int(flag.item())
        if code == 2:
            reported = ", ".join(k for k in metrics if "@" not in k) or "nothing on this rank"
            raise ValueError(
                f"early_stop {self.config.early_stop!r}: the evaluation of task "
                f"{self.config.task!r} reports no {rule.metric!r} (it reports {reported})"
            )
        if code == 1 and self.dist.is_main:
            value = float(metrics[rule.metric])
            self.logger.log(
                "event",
                self.step,
                event="early_stop",
                metric=rule.metric,
                value=value,
                threshold=rule.threshold,
                rule=self.config.early_stop,
                steps=self.config.steps,
            )
            self.note(
                f"early stop at step {self.step}/{self.config.steps}: {rule.metric} "
                f"{value:.4g} {rule.op} {rule.text} (early_stop); writing the final checkpoint"
            )
        return code == 1
