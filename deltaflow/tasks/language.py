"""Language modelling on local documents: the LM task over a tokenized-corpus cache.

- Tokenizers (`deltaflow.tasks.tokenizers`): bytes, GPT-2 BPE from a `.tiktoken` file, or any
  local Hugging Face tokenizer folder.
- Documents (`deltaflow.tasks.corpus`): `.txt` files, `.jsonl`, `.parquet` or a
  `datasets.save_to_disk` folder, split into train and validation by whole document; each split
  is tokenized once into a `.npy` cache (documents joined with the separator) and memory-mapped.
- `LanguageModeling`: training batches are either random windows of the token stream (the
  default for `.txt` folders) or rows *packed* from whole documents (the default for record
  data): each row carries ``doc_starts`` and the trainer runs it with ``cu_seqlens``, so no
  token sees another document. Evaluation scores consecutive non-overlapping rows of the
  training length; at a longer length L each row is scored with up to L tokens of context, so
  perplexity and bits per byte at 1x, 2x and 4x the training length cover the same tokens.
- ``streaming=True`` (no token cache) and ``mixture={source: weight}`` (several sources drawn
  by weight) read training rows from one seeded sequence (`deltaflow.tasks.streaming`);
  ``workers=N`` tokenizes in N processes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deltaflow.tasks.base import IGNORE_INDEX, Batch, Task, check_int, check_split, derive_seed
from deltaflow.tasks.corpus import (
    DEFAULT_VALID_FILES,
    Corpus,
    check_workers,
    tokenize_corpus,
    tokenized_documents,
)
from deltaflow.tasks.streaming import RowPacker, cached_epochs, epochs, mixed, shuffled
from deltaflow.tasks.tokenizers import (
    EOT_TEXT,
    GPT2_PATTERN,
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    get_tokenizer,
)

__all__ = [
    "EOT_TEXT",
    "GPT2_PATTERN",
    "DEFAULT_VALID_FILES",
    "BPETokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "get_tokenizer",
    "default_cache_dir",
    "LanguageModeling",
]


def default_cache_dir() -> Path:
    return Path(os.environ.get("DELTAFLOW_CACHE", Path.home() / ".cache" / "deltaflow"))


def mixture_sources(
    data_dir: Path, mixture: dict[str, float] | None
) -> list[tuple[str, float, Path]]:
    """``(name, weight, path)`` per source: data_dir alone, or each mixture entry (a path
    relative to data_dir, or absolute) with its weight (> 0; normalized to sum to 1)."""
    if mixture is None:
        return [(data_dir.name, 1.0, data_dir)]
    if not isinstance(mixture, dict) or not mixture:
        raise ValueError(
            "mixture must be a non-empty mapping {source: weight} (paths under data_dir), e.g. "
            f"--task-arg 'mixture={{web.jsonl: 0.7, books: 0.3}}', got {mixture!r}"
        )
    out = []
    for name, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"mixture weight of {name!r} must be a number > 0, got {weight!r}")
        path = data_dir / str(name)
        if not path.exists():
            raise FileNotFoundError(f"mixture source {name!r} not found: {path}")
        out.append((str(name), float(weight), path))
    return out


class LanguageModeling(Task):
    """Next-token prediction on local documents (see the module doc for formats and splits).

    `get_batch(B, split, step)`, unpacked: B random windows of `seq_len + 1` tokens from the
    split's stream (input = window[:-1], labels = window[1:]). Packed (``pack=True``, the
    default for JSONL/Parquet/datasets): every epoch the split's documents are shuffled
    (seeded by epoch), laid end to end as units ``input = [sep] + doc``, ``labels = doc +
    [sep]``, and cut into rows of `seq_len`; row ``step * B + b`` is the batch's row ``b``. A
    document that crosses a row's end continues in the next row as its own piece.
    ``doc_starts`` [B, T] marks where each document (or piece) begins; the trainer turns it
    into ``cu_seqlens`` so that no token attends to, or carries state or convolution from,
    another document, and no label is another document's token.

    `eval_batches(split, length=L)`: the scored tokens are always the same, consecutive
    non-overlapping rows of `seq_len` tokens of the validation split (in document order; with
    `num_examples`, the first rows); `length` sets the context each row is scored with. At
    ``L <= seq_len`` a row is scored as it is (``L < seq_len``: consecutive rows of L tokens,
    the only case that scores other rows). At ``L > seq_len`` every row is the last `seq_len`
    positions of an L-token window ending where the row ends (the first rows, which have less
    than L tokens before their end, sit inside the window ``[0, L)``), and the labels of the
    window's other positions are ignored: so the 2x and 4x numbers score the same tokens at
    the same positions as the 1x number, with longer contexts (issue 24). The corpus has one
    held-out split: "valid" and "test" are the same documents.
    """

    name = "lm"
    default_eval_examples = None  # all windows of the evaluation span

    def __init__(
        self,
        data_dir: str | os.PathLike,
        seq_len: int = 512,
        tokenizer: str = "byte",
        tokenizer_path: str | os.PathLike | None = None,
        valid_files: Sequence[str] | None = None,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
        text_field: str = "text",
        valid_fraction: float = 0.01,
        skip_empty: bool = False,
        pack: bool | None = None,
        workers: int = 1,
        streaming: bool = False,
        mixture: dict[str, float] | None = None,
        shuffle_buffer: int = 1000,
    ) -> None:
        super().__init__(seed)
        self.data_dir = Path(data_dir)
        if not self.data_dir.exists():
            raise FileNotFoundError(f"data_dir not found: {self.data_dir}")
        self.seq_len = check_int("seq_len", seq_len, 1)
        self.workers = check_workers(workers)
        if not isinstance(streaming, bool):
            raise TypeError(f"streaming must be true or false, got {streaming!r}")
        self.streaming = streaming
        self.shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, 1)
        self.tokenizer = get_tokenizer(tokenizer, tokenizer_path)
        self.vocab_size = self.tokenizer.vocab_size
        self.chance = 1.0 / self.vocab_size
        # (name, weight, corpus) per source: data_dir itself, or each mixture entry under it
        split_kw = dict(
            text_field=text_field,
            valid_files=valid_files,
            valid_fraction=valid_fraction,
            skip_empty=skip_empty,
        )
        self.sources = [
            (name, weight, Corpus(path, **split_kw))
            for name, weight, path in mixture_sources(self.data_dir, mixture)
        ]
        self.corpus = self.sources[0][2]
        self.files = {
            split: [f for _, _, c in self.sources for f in c.files(split)]
            for split in ("train", "valid")
        }
        # streaming and mixtures read training rows from one sequence (deltaflow.tasks.streaming)
        self.sequential = streaming or mixture is not None
        if pack is None:
            pack = self.sequential or self.corpus.packs_by_default
        if not isinstance(pack, bool):
            raise TypeError(f"pack must be true, false or None (auto), got {pack!r}")
        if self.sequential and not pack:
            raise ValueError(
                "pack=false (random windows) needs the whole token stream: it does not combine "
                "with streaming or mixture; drop pack=false (documents are then packed)"
            )
        self.pack = pack
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._data: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self._source_data: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self._packer = RowPacker(self._train_units, self.seq_len, self.tokenizer.eot_id)
        self._epochs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._token_bytes = torch.from_numpy(self.tokenizer.token_bytes())
        # length extrapolation: evaluate with eval_batches(split, length=L) for each of these
        self.extrapolation_lengths = [seq_len, 2 * seq_len, 4 * seq_len]

    # ---------------------------------------------------------------- the cached splits
    def _cached(self, index: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Source ``index``'s cached splits (tokenized on first use)."""
        if index not in self._source_data:
            self._source_data[index] = tokenize_corpus(
                self.sources[index][2],
                self.tokenizer,
                self.cache_dir / "tokens",
                workers=self.workers,
            )
        return self._source_data[index]

    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        part = "train" if check_split(split) == "train" else "valid"
        if not self.sequential:
            if self._data is None:
                self._data = self._cached(0)
            return self._data[part]
        if part == "train":
            raise ValueError(
                "with streaming or a mixture the training split is a sequence, not one stream: "
                "read it through get_batch"
            )
        if self._data is None:  # the sources' validation documents, one after another
            if self.streaming:  # read and tokenized into memory, no cache
                docs = [
                    doc
                    for _, _, corpus in self.sources
                    for doc in tokenized_documents(corpus, self.tokenizer, "valid", self.workers)
                ]
            else:
                docs = []
                for i in range(len(self.sources)):
                    tokens, offsets = self._cached(i)["valid"]
                    docs += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
            offsets = np.zeros(len(docs) + 1, dtype=np.int64)
            np.cumsum([len(d) for d in docs], out=offsets[1:])
            tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.uint16)
            self._data = {"valid": (tokens, offsets)}
        return self._data["valid"]

    def _train_units(self) -> Iterator[np.ndarray]:
        """The training documents of a streaming or mixture task, in their seeded order."""
        per_source = []
        for i, (name, _, corpus) in enumerate(self.sources):
            parts = (self.name, self.seed, "train", name)
            if self.streaming:

                def one_epoch(epoch: int, corpus: Corpus = corpus, parts: tuple = parts):
                    rng = np.random.default_rng(derive_seed(*parts, "epoch", epoch))
                    docs = tokenized_documents(corpus, self.tokenizer, "train", self.workers)
                    return shuffled(docs, self.shuffle_buffer, rng)

                per_source.append(epochs(one_epoch, f"data {corpus.root}"))
            else:
                per_source.append(cached_epochs(*self._cached(i)["train"], parts))
        weights = [w for _, w, _ in self.sources]
        return mixed(per_source, weights, derive_seed(self.name, self.seed, "mixture"))

    def stream(self, split: str) -> np.ndarray:
        """The split's token ids (memory-mapped), each document followed by the separator."""
        return self._split(split)[0]

    def doc_offsets(self, split: str) -> np.ndarray:
        """int64 ``[D + 1]``: document ``i`` is ``stream[o[i] : o[i + 1]]`` (separator last)."""
        return self._split(split)[1]

    def _too_small(self, split: str, n: int, need: int, what: str) -> ValueError:
        return ValueError(
            f"data {self.data_dir}: the {split} split has {n} tokens, fewer than {what}; "
            + (
                "add documents, or lower --batch-size / --seq-len"
                if split == "train"
                else "hold out more documents (valid_files, valid_fraction) or lower --seq-len"
            )
        )

    # ---------------------------------------------------------------- random windows
    def _windows(self, stream: np.ndarray, starts: Sequence[int], length: int) -> Batch:
        w = torch.from_numpy(np.stack([np.asarray(stream[s : s + length + 1]) for s in starts]))
        w = w.long()
        return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}

    # ---------------------------------------------------------------- packed documents
    def _epoch(self, split: str, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, end of each unit in the packed stream) of one epoch."""
        key = (split, epoch)
        if key not in self._epochs:
            lengths = np.diff(self.doc_offsets(split))  # unit = [sep] + doc: as long as doc+sep
            rng = np.random.default_rng(derive_seed(self.name, self.seed, split, "epoch", epoch))
            order = rng.permutation(len(lengths))
            if len(self._epochs) >= 4:  # a batch spans at most two epochs; keep a few
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[key] = (order, np.cumsum(lengths[order]))
        return self._epochs[key]

    def _packed(
        self, split: str, order: np.ndarray, ends: np.ndarray, starts: Sequence[int], length: int
    ) -> Batch:
        """Rows ``[lo, lo + length)`` of the packed stream that ``order`` lays out."""
        stream, offsets = self._split(split)
        sep = self.tokenizer.eot_id
        B = len(starts)
        inputs = np.empty((B, length), dtype=np.int64)
        labels = np.empty((B, length), dtype=np.int64)
        doc_starts = np.zeros((B, length), dtype=bool)
        for row, lo in enumerate(starts):
            pos, hi = lo, lo + length
            j = int(np.searchsorted(ends, lo, side="right"))  # the unit holding position lo
            while pos < hi:
                unit_lo = int(ends[j - 1]) if j else 0
                a = pos - unit_lo  # offset inside the unit
                b = min(int(ends[j]) - unit_lo, a + hi - pos)
                s = int(offsets[order[j]])  # the document's first token in the stream
                at = pos - lo
                labels[row, at : at + b - a] = stream[s + a : s + b]
                if a == 0:  # the unit's first input is the separator (a BOS)
                    inputs[row, at] = sep
                    inputs[row, at + 1 : at + b - a] = stream[s : s + b - 1]
                else:
                    inputs[row, at : at + b - a] = stream[s + a - 1 : s + b - 1]
                doc_starts[row, at] = True
                pos += b - a
                j += 1
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "doc_starts": torch.from_numpy(doc_starts),
        }

    # ---------------------------------------------------------------- batches
    def get_batch(self, batch_size: int, split: str = "train", step: int = 0) -> Batch:
        check_int("batch_size", batch_size, 1)
        check_int("step", step, 0)
        if self.sequential and check_split(split) == "train":
            return self._packer.rows(step * batch_size, batch_size)
        stream = self.stream(split)
        T = self.seq_len
        need = batch_size * T + (0 if self.pack else 1)
        if len(stream) < need:
            raise self._too_small(
                split, len(stream), need, f"one batch of {batch_size} x {T} = {batch_size * T}"
            )
        if self.pack:
            rows_per_epoch = len(stream) // T
            rows = range(step * batch_size, (step + 1) * batch_size)
            parts = []
            for epoch in sorted({g // rows_per_epoch for g in rows}):
                order, ends = self._epoch(split, epoch)
                starts = [(g % rows_per_epoch) * T for g in rows if g // rows_per_epoch == epoch]
                parts.append(self._packed(split, order, ends, starts, T))
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        g = self._generator(split, "batch", step)
        starts = torch.randint(0, len(stream) - T, (batch_size,), generator=g).tolist()
        return self._windows(stream, starts, T)

    def train_passes(self, steps: int, batch_size: int) -> float | None:
        """How many times ``steps`` batches of ``batch_size`` rows read the training split
        (random windows: in expectation); above 1 a model can memorise the split. A mixture:
        the most-read source, counting its share of the tokens as its weight. Streaming:
        None (the size is unknown without a pass over the data)."""
        tokens = steps * batch_size * self.seq_len
        if self.streaming:
            return None
        if not self.sequential:
            return tokens / len(self.stream("train"))
        total = sum(w for _, w, _ in self.sources)
        return max(
            tokens * w / total / len(self._cached(i)["train"][0])
            for i, (_, w, _) in enumerate(self.sources)
        )

    def _eval_tokens(self, split: str) -> int:
        # windows need one token past the end for the last label; packed units carry their own
        return len(self.stream(split)) - (0 if self.pack else 1)

    def eval_starts(self, split: str = "valid", length: int | None = None) -> list[int]:
        """Where the scored rows start: rows of ``min(length, seq_len)`` tokens over a span of
        the split that is a multiple of ``4 · seq_len`` (the whole split if shorter)."""
        length = self.seq_len if length is None else check_int("length", length, 1)
        row = min(length, self.seq_len)
        n = self._eval_tokens(split)
        span = (n // (4 * self.seq_len)) * 4 * self.seq_len or n
        count = span // row
        if count == 0:
            raise self._too_small(split, n, row, f"one evaluation row of {row}")
        return list(range(0, count * row, row))

    def eval_set(self, split: str = "valid", num_examples: int | None = None, **kw) -> Batch:
        return next(self.eval_batches(split, num_examples, batch_size=1 << 30, **kw))

    def eval_batches(
        self,
        split: str = "valid",
        num_examples: int | None = None,
        batch_size: int = 8,
        length: int | None = None,
    ) -> Iterator[Batch]:
        """The rows of :meth:`eval_starts` (`num_examples` caps their number: the first ones),
        each scored with a context of `length` tokens (default seq_len; see the class doc).
        Packed: documents in order, with ``doc_starts``."""
        check_int("batch_size", batch_size, 1)
        starts = self.eval_starts(split, length)
        if num_examples is not None:
            starts = starts[: check_int("num_examples", num_examples, 1)]
        length = self.seq_len if length is None else length
        row = min(length, self.seq_len)
        if length > self._eval_tokens(split):
            raise self._too_small(
                split, self._eval_tokens(split), length, f"one evaluation window of {length}"
            )
        # The window holding each row: it ends where the row ends, or is [0, length) for the
        # first rows; only the row's positions are scored (the others' labels are ignored).
        windows = [max(0, s + row - length) for s in starts]
        stream, offsets = self._split(split)
        for i in range(0, len(starts), batch_size):
            chunk = windows[i : i + batch_size]
            if self.pack:
                order = np.arange(len(offsets) - 1)
                batch = self._packed(split, order, offsets[1:], chunk, length)
            else:
                batch = self._windows(stream, chunk, length)
            if length > row:
                offset = torch.tensor(starts[i : i + batch_size]) - torch.tensor(chunk)
                pos = torch.arange(length)
                scored = (pos >= offset[:, None]) & (pos < offset[:, None] + row)
                batch["labels"] = batch["labels"].masked_fill(~scored, IGNORE_INDEX)
            yield batch

    def metric_sums(self, logits: torch.Tensor, batch: Batch) -> dict[str, float]:
        labels = batch["labels"].to(logits.device)
        self._check_logits(logits, labels)
        mask = labels != IGNORE_INDEX
        safe = labels.clamp_min(0)
        nll = F.cross_entropy(logits.float().transpose(1, 2), safe, reduction="none")
        nbytes = self._token_bytes.to(logits.device)[safe] * mask
        return {
            "nll": float((nll * mask).sum()),
            "tokens": float(mask.sum()),
            "bytes": float(nbytes.sum()),
        }

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["nll"] / max(sums["tokens"], 1.0)
        return {
            "loss": loss,
            "ppl": math.exp(min(loss, 700.0)),
            "bpb": sums["nll"] / math.log(2) / max(sums["bytes"], 1.0),
            "num_tokens": sums["tokens"],
        }
