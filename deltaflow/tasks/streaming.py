"""Training documents as an endless, deterministic sequence, and rows packed from it.

Two things the random-access cache of :mod:`deltaflow.tasks.corpus` cannot do:

- **Streaming** (``streaming=True``): documents are read and tokenized as training consumes
  them (in ``workers`` processes), with no token cache, so a dataset larger than the disk or
  memory trains in constant memory. Each epoch reads the sources in order through a shuffle
  buffer of ``shuffle_buffer`` documents seeded by (seed, source, epoch).
- **Mixtures** (``mixture={source: weight}``): every document slot draws its source with the
  given probabilities from a seeded generator; each source runs through its own epochs
  (a source that ends starts its next epoch, so small sources repeat and weights hold).
  Cached sources shuffle their documents per epoch by a seeded permutation.

Rows: the sequence is laid out as units ``input = [sep] + doc``, ``labels = doc + [sep]``
(the layout of ``LanguageModeling``'s packed rows) and cut into rows of ``seq_len``; batch
``step`` is rows ``step * B`` to ``step * B + B - 1``. The sequence depends only on the seed,
so a batch depends only on (seed, step): :class:`RowPacker` serves consecutive steps from
where it stopped and reaches any other step (a resumed run) by replaying the sequence from
its start, skipping rows without building them (streaming sources are read and tokenized
again up to there: resume costs the time the skipped data took to tokenize, no memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from deltaflow.tasks.base import Batch, derive_seed

Units = Iterator[np.ndarray]  # documents, each followed by the separator (a cache's layout)


def shuffled(items: Iterator[np.ndarray], buffer: int, rng: np.random.Generator) -> Units:
    """``items`` in a seeded order that is a full shuffle within any ``buffer`` of them."""
    pool: list[np.ndarray] = []
    for item in items:
        pool.append(item)
        if len(pool) >= buffer:
            i = int(rng.integers(len(pool)))
            pool[i], pool[-1] = pool[-1], pool[i]
            yield pool.pop()
    for i in rng.permutation(len(pool)):
        yield pool[i]


def epochs(open_epoch: Callable[[int], Units], what: str) -> Units:
    """Epoch 0, 1, 2, ... of a source without end; an epoch with no documents is an error
    (else the sequence would wait forever)."""
    epoch = 0
    while True:
        empty = True
        for unit in open_epoch(epoch):
            empty = False
            yield unit
        if empty:
            raise ValueError(f"{what}: the train split has no documents")
        epoch += 1


def cached_epochs(tokens: np.ndarray, offsets: np.ndarray, seed_parts: Sequence[object]) -> Units:
    """A cached split's documents, each epoch in a permutation seeded by (parts, epoch)."""

    def one(epoch: int) -> Units:
        rng = np.random.default_rng(derive_seed(*seed_parts, "epoch", epoch))
        for i in rng.permutation(len(offsets) - 1):
            yield np.asarray(tokens[offsets[i] : offsets[i + 1]])

    return epochs(one, "cached source")


def mixed(sources: Sequence[Units], weights: Sequence[float], seed: int) -> Units:
    """Each document from source ``i`` with probability ``weights[i]`` (normalized)."""
    if len(sources) == 1:
        yield from sources[0]
        return
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    rng = np.random.default_rng(seed)
    try:
        while True:
            for i in rng.choice(len(sources), size=1024, p=p):
                yield next(sources[i])
    finally:  # closing the mixture ends every source's tokenizer workers now, not at GC
        for source in sources:
            source.close()


class RowPacker:
    """Rows of ``seq_len`` cut from the units ``open_units()`` lays out (see the module doc)."""

    def __init__(self, open_units: Callable[[], Units], seq_len: int, sep: int) -> None:
        self.open_units = open_units
        self.seq_len = seq_len
        self.sep = sep
        self._units: Units | None = None
        self.replays = 0  # how many times the sequence was restarted (tests read it)

    def _restart(self) -> None:
        if self._units is not None:
            self._units.close()  # ends its tokenizer workers
        self._units = self.open_units()
        self._unit = np.zeros(0, dtype=np.int64)
        self._pos = 0
        self.next_row = 0
        self.replays += 1

    def _row(self, out: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        """The next row into ``out`` (inputs, labels, doc_starts), or skipped when None."""
        filled, T = 0, self.seq_len
        while filled < T:
            if self._pos == len(self._unit):
                self._unit, self._pos = next(self._units), 0
            n = min(T - filled, len(self._unit) - self._pos)
            if out is not None:
                inputs, labels, starts = out
                a = self._pos
                labels[filled : filled + n] = self._unit[a : a + n]
                if a == 0:  # the unit's first input is the separator (a BOS)
                    inputs[filled] = self.sep
                    inputs[filled + 1 : filled + n] = self._unit[: n - 1]
                else:
                    inputs[filled : filled + n] = self._unit[a - 1 : a + n - 1]
                starts[filled] = True
            self._pos += n
            filled += n
        self.next_row += 1

    def rows(self, first: int, count: int) -> Batch:
        """Rows ``[first, first + count)`` with ``doc_starts``."""
        if self._units is None or first < self.next_row:
            self._restart()
        while self.next_row < first:
            self._row(None)
        T = self.seq_len
        inputs = np.empty((count, T), dtype=np.int64)
        labels = np.empty((count, T), dtype=np.int64)
        starts = np.zeros((count, T), dtype=bool)
        for r in range(count):
            self._row((inputs[r], labels[r], starts[r]))
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "doc_starts": torch.from_numpy(starts),
        }

    def close(self) -> None:
        if self._units is not None:
            self._units.close()
            self._units = None
