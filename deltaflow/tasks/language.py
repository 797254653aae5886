"""Language modelling on local text: tokenizers, a tokenized-corpus cache, and the LM task.

- `ByteTokenizer`: UTF-8 bytes are ids 0..255, `<|endoftext|>` is 256 (vocab 257).
- `BPETokenizer`: GPT-2 BPE from a local `.tiktoken` file (base64 token + rank per line) with
  the GPT-2 split regex; `<|endoftext|>` gets the id after the last rank (50256 for GPT-2).
- `LanguageModeling`: documents are the `.txt` files under a directory, split into train and
  validation by whole file; each split is tokenized once into a `.npy` cache (documents
  joined with `<|endoftext|>`) and memory-mapped. Training batches are random windows;
  evaluation uses consecutive non-overlapping windows at any length, so perplexity and bits
  per byte can be compared at the training length and at 2x and 4x it.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from deltaflow.tasks.base import IGNORE_INDEX, Batch, Task, check_int, check_split

EOT_TEXT = "<|endoftext|>"
# The GPT-2 pre-tokenization pattern (contractions, letters, numbers, other, whitespace).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Validation files suggested by the offline corpus README (relative to the corpus root).
DEFAULT_VALID_FILES = (
    "english/austen_persuasion.txt",
    "english/shakespeare_hamlet.txt",
    "english/shakespeare_sonnets.txt",
)


class ByteTokenizer:
    """UTF-8 bytes; no merges, nothing unknown, exact round trip for any text."""

    name = "byte"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of each id (0 for special tokens), for bits per byte."""
        out = np.ones(self.vocab_size, dtype=np.int64)
        out[self.eot_id] = 0
        return out


class BPETokenizer:
    """GPT-2 byte-level BPE from a local `.tiktoken` file; never touches the network."""

    def __init__(self, path: str | os.PathLike) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        data = self.path.read_bytes()
        # tiktoken caches files by path; passing the content hash makes a stale cache refetch
        digest = hashlib.sha256(data).hexdigest()
        ranks = load_tiktoken_bpe(str(self.path.resolve()), expected_hash=digest)
        self.eot_id = len(ranks)
        self.vocab_size = len(ranks) + 1
        self.name = f"bpe-{self.path.stem}-{digest[:12]}"
        self.enc = tiktoken.Encoding(
            name=self.path.stem,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: self.eot_id},
        )

    def encode(self, text: str) -> list[int]:
        # ordinary: "<|endoftext|>" inside a document is text, not the separator
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return np.asarray(self.enc.encode_ordinary(text), dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        out = np.array(
            [len(self.enc.decode_single_token_bytes(i)) for i in range(self.eot_id)] + [0],
            dtype=np.int64,
        )
        return out


def get_tokenizer(tokenizer: str = "byte", path: str | os.PathLike | None = None):
    """`"byte"`, `"gpt2"` (needs `path` to a .tiktoken file), or a path to a .tiktoken file."""
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer in ("gpt2", "bpe"):
        if path is None:
            raise ValueError(
                f"tokenizer={tokenizer!r} needs tokenizer_path, a GPT-2 .tiktoken file "
                "(deltaflow train: --tokenizer-path FILE)"
            )
        return BPETokenizer(path)
    if str(tokenizer).endswith(".tiktoken"):
        return BPETokenizer(tokenizer)
    raise ValueError(f"tokenizer must be 'byte', 'gpt2' or a .tiktoken path, got {tokenizer!r}")


def default_cache_dir() -> Path:
    return Path(os.environ.get("DELTAFLOW_CACHE", Path.home() / ".cache" / "deltaflow"))


def split_files(data_dir: Path, valid_files: Sequence[str] | None = None) -> dict[str, list[Path]]:
    """Train/valid split by whole file. Default validation files: the corpus README's
    suggestion if all present, else every 10th file in sorted order (at least one)."""
    files = sorted(p for p in data_dir.rglob("*.txt") if p.is_file())
    if len(files) < 2:
        raise ValueError(f"data_dir {data_dir} needs at least 2 .txt files, found {len(files)}")
    rel = [p.relative_to(data_dir).as_posix() for p in files]
    if valid_files is None:
        if all(v in rel for v in DEFAULT_VALID_FILES):
            valid_files = DEFAULT_VALID_FILES
        else:
            k = max(len(rel) // 10, 1)
            valid_files = rel[:: len(rel) // k][:k]
    missing = [v for v in valid_files if v not in rel]
    if missing:
        raise ValueError(f"valid_files not found under {data_dir}: {missing}")
    valid = set(valid_files)
    split = {
        "train": [p for p, r in zip(files, rel) if r not in valid],
        "valid": [p for p, r in zip(files, rel) if r in valid],
    }
    if not split["train"]:
        raise ValueError("every file is a validation file; nothing left to train on")
    return split


def read_corpus_file(path: Path) -> str:
    """A corpus file's text; a file that is not UTF-8 (binary, another encoding) is a one-line
    error naming it, not a decode error without a file name."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"corpus file {path} is not UTF-8 text ({err.reason} at byte {err.start}): "
            "convert it to UTF-8 or move it out of data_dir"
        ) from None


def tokenize_files(files: Sequence[Path], tokenizer, cache_dir: Path, tag: str) -> np.ndarray:
    """Tokenize `files` (each followed by <|endoftext|>) into a cached .npy; memory-map it.

    The cache key covers the tokenizer and every file's path, size and mtime, so an edited
    corpus is re-tokenized and an unchanged one never is. Written atomically (temp + rename).
    """
    key = hashlib.sha256(tokenizer.name.encode())
    for p in files:
        st = p.stat()
        key.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    path = cache_dir / f"{tag}-{tokenizer.name}-{key.hexdigest()[:16]}.npy"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        parts = []
        for p in tqdm(files, desc=f"tokenizing {tag} ({tokenizer.name})", unit="file"):
            parts.append(tokenizer.encode_array(read_corpus_file(p)).astype(dtype))
            parts.append(np.array([tokenizer.eot_id], dtype=dtype))
        tokens = np.concatenate(parts)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, tokens)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shareable
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return np.load(path, mmap_mode="r")


class LanguageModeling(Task):
    """Next-token prediction on a directory of .txt files.

    `get_batch(B, split, step)`: B random windows of `seq_len + 1` tokens from the split's
    stream (input = window[:-1], labels = window[1:]). `eval_batches(split, length=L)`:
    consecutive non-overlapping windows of L tokens over the same span of the validation
    stream for L = seq_len, 2*seq_len and 4*seq_len (the span is a multiple of 4*seq_len), so
    the three lengths score the same tokens. The corpus has one held-out split: "valid" and
    "test" are the same validation files.
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
    ) -> None:
        super().__init__(seed)
        self.data_dir = Path(data_dir)
        if not self.data_dir.is_dir():
            raise FileNotFoundError(f"data_dir is not a directory: {self.data_dir}")
        self.seq_len = check_int("seq_len", seq_len, 1)
        self.tokenizer = get_tokenizer(tokenizer, tokenizer_path)
        self.vocab_size = self.tokenizer.vocab_size
        self.chance = 1.0 / self.vocab_size
        self.files = split_files(self.data_dir, valid_files)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._streams: dict[str, np.ndarray] = {}
        self._token_bytes = torch.from_numpy(self.tokenizer.token_bytes())
        # length extrapolation: evaluate with eval_batches(split, length=L) for each of these
        self.extrapolation_lengths = [seq_len, 2 * seq_len, 4 * seq_len]

    def stream(self, split: str) -> np.ndarray:
        """The split's token ids (memory-mapped), documents separated by <|endoftext|>."""
        part = "train" if check_split(split) == "train" else "valid"
        if part not in self._streams:
            self._streams[part] = tokenize_files(
                self.files[part], self.tokenizer, self.cache_dir / "tokens", part
            )
        return self._streams[part]

    def _windows(self, stream: np.ndarray, starts: Sequence[int], length: int) -> Batch:
        w = torch.from_numpy(np.stack([np.asarray(stream[s : s + length + 1]) for s in starts]))
        w = w.long()
        return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0) -> Batch:
        check_int("batch_size", batch_size, 1)
        check_int("step", step, 0)
        stream = self.stream(split)
        n_start = len(stream) - self.seq_len
        if n_start < 1:
            raise ValueError(f"{split} stream has {len(stream)} tokens, fewer than seq_len + 1")
        g = self._generator(split, "batch", step)
        starts = torch.randint(0, n_start, (batch_size,), generator=g).tolist()
        return self._windows(stream, starts, self.seq_len)

    def train_passes(self, steps: int, batch_size: int) -> float:
        """How many times ``steps`` batches of ``batch_size`` windows read the training split
        (in expectation: windows start at random); above 1 a model can memorise the split."""
        return steps * batch_size * self.seq_len / len(self.stream("train"))

    def eval_starts(self, split: str = "valid", length: int | None = None) -> list[int]:
        length = self.seq_len if length is None else check_int("length", length, 1)
        n = len(self.stream(split)) - 1
        span = (n // (4 * self.seq_len)) * 4 * self.seq_len or n
        count = span // length
        if count == 0:
            raise ValueError(f"{split} stream has {n + 1} tokens, too few for length {length}")
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
        """Consecutive windows of `length` tokens (default seq_len); `num_examples` caps the
        number of windows (the first ones)."""
        check_int("batch_size", batch_size, 1)
        starts = self.eval_starts(split, length)
        if num_examples is not None:
            starts = starts[: check_int("num_examples", num_examples, 1)]
        length = self.seq_len if length is None else length
        stream = self.stream(split)
        for i in range(0, len(starts), batch_size):
            yield self._windows(stream, starts[i : i + batch_size], length)

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
