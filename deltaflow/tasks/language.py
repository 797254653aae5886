"""Language modelling on local documents: the LM task over a tokenized-corpus cache.

- Tokenizers (`deltaflow.tasks.tokenizers`): bytes, GPT-2 BPE from a `.tiktoken` file, or any
  local Hugging Face tokenizer folder.
- Documents (`deltaflow.tasks.corpus`): `.txt` files, `.jsonl`, `.parquet` or a
  `datasets.save_to_disk` folder, split into train and validation by whole document; each split
  is tokenized once into a `.npy` cache (documents joined with the separator) and memory-mapped.
- `LanguageModeling`: training batches are either random windows of the token stream (the
  default for `.txt` folders) or rows *packed* from whole documents (the default for record
  data): each row carries ``doc_starts`` and the trainer runs it with ``cu_seqlens``, so no
  token sees another document. Evaluation uses consecutive non-overlapping rows at any length,
  so perplexity and bits per byte can be compared at the training length and at 2x and 4x it.
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
from deltaflow.tasks.corpus import DEFAULT_VALID_FILES, Corpus, tokenize_corpus
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

    `eval_batches(split, length=L)`: consecutive non-overlapping rows of L tokens over the same
    span of the validation split (in document order) for L = seq_len, 2*seq_len and 4*seq_len
    (the span is a multiple of 4*seq_len), so the three lengths score the same tokens. The
    corpus has one held-out split: "valid" and "test" are the same documents.
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
    ) -> None:
        super().__init__(seed)
        self.data_dir = Path(data_dir)
        if not self.data_dir.exists():
            raise FileNotFoundError(f"data_dir not found: {self.data_dir}")
        self.seq_len = check_int("seq_len", seq_len, 1)
        self.tokenizer = get_tokenizer(tokenizer, tokenizer_path)
        self.vocab_size = self.tokenizer.vocab_size
        self.chance = 1.0 / self.vocab_size
        self.corpus = Corpus(
            self.data_dir,
            text_field=text_field,
            valid_files=valid_files,
            valid_fraction=valid_fraction,
            skip_empty=skip_empty,
        )
        self.files = {"train": self.corpus.files("train"), "valid": self.corpus.files("valid")}
        if pack is None:
            pack = self.corpus.packs_by_default
        if not isinstance(pack, bool):
            raise TypeError(f"pack must be true, false or None (auto), got {pack!r}")
        self.pack = pack
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._data: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self._epochs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._token_bytes = torch.from_numpy(self.tokenizer.token_bytes())
        # length extrapolation: evaluate with eval_batches(split, length=L) for each of these
        self.extrapolation_lengths = [seq_len, 2 * seq_len, 4 * seq_len]

    # ---------------------------------------------------------------- the cached splits
    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        part = "train" if check_split(split) == "train" else "valid"
        if self._data is None:
            self._data = tokenize_corpus(self.corpus, self.tokenizer, self.cache_dir / "tokens")
        return self._data[part]

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

    def train_passes(self, steps: int, batch_size: int) -> float:
        """How many times ``steps`` batches of ``batch_size`` rows read the training split
        (random windows: in expectation); above 1 a model can memorise the split."""
        return steps * batch_size * self.seq_len / len(self.stream("train"))

    def eval_starts(self, split: str = "valid", length: int | None = None) -> list[int]:
        length = self.seq_len if length is None else check_int("length", length, 1)
        # windows need one token past the end for the last label; packed units carry their own
        n = len(self.stream(split)) - (0 if self.pack else 1)
        span = (n // (4 * self.seq_len)) * 4 * self.seq_len or n
        count = span // length
        if count == 0:
            raise self._too_small(split, n, length, f"one evaluation row of {length}")
        return list(range(0, count * length, length))

    def eval_set(self, split: str = "valid", num_examples: int | None = None, **kw) -> Batch:
        return next(self.eval_batches(split, num_examples, batch_size=1 << 30, **kw))

    def eval_batches(
        self,
        split: str = "valid",
        num_examples: int | None = None,
        batch_size: int = 8,
        length: int | None = None,
    ) -> Iterator[Batch]:
        """Consecutive rows of `length` tokens (default seq_len); `num_examples` caps the
        number of rows (the first ones). Packed: documents in order, with ``doc_starts``."""
        check_int("batch_size", batch_size, 1)
        starts = self.eval_starts(split, length)
        if num_examples is not None:
            starts = starts[: check_int("num_examples", num_examples, 1)]
        length = self.seq_len if length is None else length
        stream, offsets = self._split(split)
        for i in range(0, len(starts), batch_size):
            chunk = starts[i : i + batch_size]
            if self.pack:
                order = np.arange(len(offsets) - 1)
                yield self._packed(split, order, offsets[1:], chunk, length)
            else:
                yield self._windows(stream, chunk, length)

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
