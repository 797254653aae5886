"""The contract every task meets: deterministic batches, a fixed evaluation set, metrics.

A task turns (seed, split, step) into a batch of token ids and aligned labels
(`labels[b, t]` is the target for position `t`, `IGNORE_INDEX` where nothing is scored).
All randomness comes from a `torch.Generator` seeded by hashing those three values, so a
batch can be regenerated anywhere (resuming a run, another process) and the train, valid
and test streams never share a generator.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
SPLITS = ("train", "valid", "test")
# Evaluation sets are generated in blocks of this many examples, each from its own seed, so
# the set does not depend on the batch size asked for and a smaller set is a prefix of a larger.
EVAL_BLOCK = 256

Batch = dict[str, torch.Tensor]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (stable across processes, unlike hash())."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_generator(*parts: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g


def numpy_seed(g: torch.Generator) -> int:
    """Draw a seed for a numpy Generator (for the few generators written per example)."""
    return int(torch.randint(0, 2**62, (1,), generator=g).item())


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_float(
    name: str, value: object, low: float, high: float, high_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not (low <= value <= high) or (high_open and value >= high):
        raise ValueError(
            f"{name} must be in [{low}, {high}{')' if high_open else ']'}, got {value}"
        )
    return value


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


class Task:
    """Base class. Subclasses set `vocab_size`, `seq_len`, `chance` and implement `_sample`.

    `_sample(n, g, split, **kw)` returns a batch of `n` examples drawn with generator `g`;
    `kw` are the evaluation options (e.g. `length` for state tracking). Tasks with a finite
    training set (MAD) set `num_train_examples`: training batches then sample from a fixed
    pool of that many examples instead of a fresh stream.
    """

    name: ClassVar[str] = "task"
    default_eval_examples: ClassVar[int] = 1024
    vocab_size: int
    seq_len: int
    chance: float
    num_train_examples: int | None = None

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_int("seed", seed, 0)
        self._pool: Batch | None = None
        self._eval_cache: dict[tuple, Batch] = {}

    # ---------------------------------------------------------------- data
    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        raise NotImplementedError

    def _generator(self, *parts: object) -> torch.Generator:
        return make_generator(self.name, self.seed, *parts)

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0) -> Batch:
        """A batch that depends only on (seed, split, step): `input_ids`, `labels` [B, T]."""
        check_int("batch_size", batch_size, 1)
        check_split(split)
        check_int("step", step, 0)
        g = self._generator(split, "batch", step)
        if split == "train" and self.num_train_examples is not None:
            pool = self._train_pool()
            idx = torch.randint(0, self.num_train_examples, (batch_size,), generator=g)
            return {k: v[idx].long() for k, v in pool.items()}
        return self._sample(batch_size, g, split)

    def _train_pool(self) -> Batch:
        """The finite training set, generated once in fixed blocks and kept in memory."""
        if self._pool is None:
            n = self.num_train_examples
            assert n is not None
            blocks = [
                self._sample(EVAL_BLOCK, self._generator("train", "pool", b), "train")
                for b in range(math.ceil(n / EVAL_BLOCK))
            ]
            self._pool = {
                k: torch.cat([b[k] for b in blocks])[:n].to(torch.int32) for k in blocks[0]
            }
        return self._pool

    def eval_set(self, split: str = "valid", num_examples: int | None = None, **kw) -> Batch:
        """The fixed evaluation set as one batch (cached). `kw`: task options such as `length`."""
        check_split(split)
        n = self.default_eval_examples if num_examples is None else num_examples
        check_int("num_examples", n, 1)
        num_blocks = math.ceil(n / EVAL_BLOCK)
        key = (split, num_blocks, tuple(sorted(kw.items())))
        if key not in self._eval_cache:
            tag = ",".join(f"{k}={v}" for k, v in sorted(kw.items()))
            blocks = [
                self._sample(EVAL_BLOCK, self._generator(split, "eval", tag, b), split, **kw)
                for b in range(num_blocks)
            ]
            self._eval_cache[key] = {k: torch.cat([b[k] for b in blocks]) for k in blocks[0]}
        return {k: v[:n] for k, v in self._eval_cache[key].items()}

    def eval_batches(
        self, split: str = "valid", num_examples: int | None = None, batch_size: int = 64, **kw
    ) -> Iterator[Batch]:
        """Iterate over the fixed, finite evaluation set in batches of `batch_size`."""
        check_int("batch_size", batch_size, 1)
        data = self.eval_set(split, num_examples, **kw)
        n = data["input_ids"].shape[0]
        for start in range(0, n, batch_size):
            yield {k: v[start : start + batch_size] for k, v in data.items()}

    # ------------------------------------------------------------- metrics
    def _check_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if logits.dim() != 3 or logits.shape[:2] != labels.shape:
            raise ValueError(
                f"logits must be [B, T, V] with [B, T] = labels.shape {tuple(labels.shape)}, "
                f"got {tuple(logits.shape)}"
            )
        if logits.shape[-1] < self.vocab_size:
            raise ValueError(
                f"logits last dim {logits.shape[-1]} is smaller than task.vocab_size "
                f"{self.vocab_size}"
            )

    def metric_sums(self, logits: torch.Tensor, batch: Batch) -> dict[str, float]:
        """Additive statistics of one batch; `finalize` turns summed statistics into metrics."""
        labels = batch["labels"].to(logits.device)
        self._check_logits(logits, labels)
        mask = labels != IGNORE_INDEX
        safe = labels.clamp_min(0)
        correct = (logits.argmax(-1) == safe) & mask
        nll = F.cross_entropy(logits.float().transpose(1, 2), safe, reduction="none")
        scored_rows = mask.any(1)
        row_ok = (correct | ~mask).all(1) & scored_rows
        return {
            "correct": float(correct.sum()),
            "scored": float(mask.sum()),
            "nll": float((nll * mask).sum()),
            "rows_correct": float(row_ok.sum()),
            "rows": float(scored_rows.sum()),
        }

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["scored"], 1.0)
        acc = sums["correct"] / n
        return {
            "accuracy": acc,
            "scaled_accuracy": (acc - self.chance) / (1.0 - self.chance),
            "sequence_accuracy": sums["rows_correct"] / max(sums["rows"], 1.0),
            "loss": sums["nll"] / n,
            "num_scored": sums["scored"],
        }

    def metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, float]:
        """Metrics of one batch: accuracy, scaled accuracy (acc - chance)/(1 - chance), loss."""
        return self.finalize(self.metric_sums(logits, batch))

    @torch.no_grad()
    def evaluate(
        self,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
        split: str = "valid",
        num_examples: int | None = None,
        batch_size: int = 64,
        device: torch.device | str | None = None,
        **kw,
    ) -> dict[str, float]:
        """Run `logits_fn(input_ids) -> logits` over the evaluation set; exact pooled metrics."""
        total: dict[str, float] = {}
        for batch in self.eval_batches(split, num_examples, batch_size, **kw):
            ids = batch["input_ids"] if device is None else batch["input_ids"].to(device)
            for k, v in self.metric_sums(logits_fn(ids), batch).items():
                total[k] = total.get(k, 0.0) + v
        return self.finalize(total)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
            f"chance={self.chance:.4g}, seed={self.seed})"
        )
