"""Documents from local files, split into train and validation by whole document, tokenized
once into a memory-mapped cache.

Formats (found by extension under a folder, or given as one file):

- ``.txt``: one document per file (the offline corpus's convention).
- ``.jsonl``: one document per line, the text in field ``text_field`` (default ``"text"``).
- ``.parquet``: one document per row, the text in column ``text_field`` (needs ``pyarrow``).
- a ``datasets.save_to_disk`` folder (``Dataset`` or ``DatasetDict``): one document per row
  (needs ``datasets``); a ``DatasetDict``'s first ``validation``/``valid``/``test`` split is
  the validation set and, when it has a ``train`` split, only ``train`` is trained on (a
  ``test`` split beside ``validation`` stays unseen).

Validation documents, in order of precedence: ``valid_files`` (paths relative to the data
folder: every document of those files); a ``DatasetDict``'s validation split; for ``.txt``
folders the long-standing rule (the offline corpus README's three files when present, else
every tenth file); otherwise every ``round(1 / valid_fraction)``-th document, the first one
included (so there is always one).

Each split becomes ``<cache>/<split>-<tokenizer>-<key>.npy`` (all its documents, each followed
by the tokenizer's separator ``eot_id``) and ``….docs.npy`` (int64 offsets ``[D + 1]``: document
``i`` is ``tokens[o[i] : o[i + 1]]``, its separator last). The key covers the tokenizer, the
split options and every source file's path, size and mtime, so an edited corpus is tokenized
again and an unchanged one never is. Files are written to temporaries and renamed into place.
Tokenizing runs in ``workers`` processes when asked (`encode_batches`: in order, so the cache's
bytes do not depend on the count); `tokenized_documents` is the same pass without a cache,
for streaming (`deltaflow.tasks.streaming`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

# Validation files suggested by the offline corpus README (relative to the corpus root).
DEFAULT_VALID_FILES = (
    "english/austen_persuasion.txt",
    "english/shakespeare_hamlet.txt",
    "english/shakespeare_sonnets.txt",
)
SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
DATASET_VALID_SPLITS = ("validation", "valid", "test")
CACHE_VERSION = 1  # bump when the cache layout or the split rules change
_BATCH_DOCS = 256  # documents handed to the tokenizer at a time (fast tokenizers parallelize)


def require(module: str, extra: str, what: str) -> Any:
    """Import an optional dependency, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{what} needs the '{module}' package: pip install 'deltaflow[{extra}]' "
            f"(or pip install {module})"
        ) from None


@dataclass
class Source:
    """One file (or one split of a saved dataset) and how to read documents from it."""

    path: Path
    kind: str  # "txt" | "jsonl" | "parquet" | "dataset"
    rel: str  # path relative to the data root (names it in valid_files and in messages)
    dataset_split: str | None = None  # the DatasetDict split this source reads


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def find_sources(data: Path) -> list[Source]:
    """Every document source under ``data`` (a file, a folder, or a saved dataset)."""
    if not data.exists():
        raise FileNotFoundError(f"data not found: {data}")
    if is_saved_dataset(data):
        if (data / "dataset_dict.json").is_file():
            splits = json.loads((data / "dataset_dict.json").read_text()).get("splits", [])
            return [Source(data / s, "dataset", s, dataset_split=s) for s in splits]
        return [Source(data, "dataset", data.name)]
    if data.is_file():
        kind = SUFFIXES.get(data.suffix)
        if kind is None:
            raise ValueError(
                f"data file {data} is not .txt, .jsonl or .parquet (or pass a folder of them, "
                "or a datasets.save_to_disk folder)"
            )
        return [Source(data, kind, data.name)]
    found = sorted(p for p in data.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not found:
        raise ValueError(
            f"no .txt, .jsonl or .parquet files under {data} (and it is not a "
            "datasets.save_to_disk folder)"
        )
    return [Source(p, SUFFIXES[p.suffix], p.relative_to(data).as_posix()) for p in found]


# ---------------------------------------------------------------------------- reading
def _check_text(text: Any, where: str, field: str, skip_empty: bool) -> str | None:
    """The document's text, None to skip it (empty, with skip_empty), or a one-line error."""
    if text is None or (isinstance(text, str) and not text.strip()):
        if skip_empty:
            return None
        what = "null" if text is None else "empty"
        raise ValueError(
            f"{where}: field {field!r} is {what}; remove such records or pass skip_empty=true "
            "(--task-arg skip_empty=true) to skip them"
        )
    if not isinstance(text, str):
        raise ValueError(
            f"{where}: field {field!r} is a {type(text).__name__}, expected a string of text; "
            "pass text_field=<name of the text field> (--task-arg text_field=NAME)"
        )
    return text


def _missing_field(where: str, field: str, has: Sequence[str]) -> ValueError:
    shown = ", ".join(repr(k) for k in list(has)[:12])
    return ValueError(
        f"{where}: no field {field!r} (it has {shown}); pass text_field=<name> "
        "(--task-arg text_field=NAME)"
    )


def iter_documents(source: Source, text_field: str, skip_empty: bool) -> Iterator[str]:
    """The texts of one source, in order; a text file that is not UTF-8 (binary, another
    encoding) is a one-line error naming it, not a decode error without a file name."""
    try:
        yield from _iter_documents(source, text_field, skip_empty)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"corpus file {source.path} is not UTF-8 text ({err.reason} at byte {err.start}): "
            "convert it to UTF-8 or move it out of data_dir"
        ) from None


def _iter_documents(source: Source, text_field: str, skip_empty: bool) -> Iterator[str]:
    if source.kind == "txt":
        yield source.path.read_text(encoding="utf-8")
    elif source.kind == "jsonl":
        with open(source.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (a trailing newline) carry no record
                where = f"{source.path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"{where}: not valid JSON ({err.msg}); each line of a .jsonl file must "
                        "be one JSON object"
                    ) from None
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{where}: expected a JSON object with a {text_field!r} field, got a "
                        f"{type(record).__name__}"
                    )
                if text_field not in record:
                    raise _missing_field(where, text_field, list(record))
                text = _check_text(record[text_field], where, text_field, skip_empty)
                if text is not None:
                    yield text
    elif source.kind == "parquet":
        pq = require("pyarrow.parquet", "data", f"reading {source.path}")
        pf = pq.ParquetFile(source.path)
        if text_field not in pf.schema_arrow.names:
            raise _missing_field(str(source.path), text_field, pf.schema_arrow.names)
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                text = _check_text(value, f"{source.path} row {row}", text_field, skip_empty)
                if text is not None:
                    yield text
    elif source.kind == "dataset":
        dataset = _load_dataset(source)
        if text_field not in dataset.column_names:
            raise _missing_field(str(source.path), text_field, dataset.column_names)
        row = 0
        for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
            for value in batch[text_field]:
                row += 1
                text = _check_text(value, f"{source.path} row {row}", text_field, skip_empty)
                if text is not None:
                    yield text
    else:  # pragma: no cover - find_sources makes only the kinds above
        raise ValueError(f"unknown source kind {source.kind!r}")


def _load_dataset(source: Source) -> Any:
    datasets = require("datasets", "data", f"reading the saved dataset {source.path}")
    return datasets.load_from_disk(str(source.path))


def count_documents(source: Source) -> int:
    """Documents (records) in a source, read cheaply, for the progress bar's total."""
    if source.kind == "txt":
        return 1
    if source.kind == "jsonl":
        with open(source.path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if source.kind == "parquet":
        pq = require("pyarrow.parquet", "data", f"reading {source.path}")
        return pq.ParquetFile(source.path).metadata.num_rows
    return len(_load_dataset(source))


# ---------------------------------------------------------------------------- the corpus
class Corpus:
    """The documents under ``data`` and their train/validation split (see the module doc)."""

    def __init__(
        self,
        data: str | os.PathLike,
        *,
        text_field: str = "text",
        valid_files: Sequence[str] | None = None,
        valid_fraction: float = 0.01,
        skip_empty: bool = False,
    ) -> None:
        self.root = Path(data)
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
        if not 0.0 < float(valid_fraction) < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction!r}")
        self.text_field = text_field
        self.skip_empty = bool(skip_empty)
        self.valid_fraction = float(valid_fraction)
        self.sources = find_sources(self.root)
        self.plain_text = all(s.kind == "txt" for s in self.sources)
        self.valid_sources = self._valid_sources(valid_files)
        # every k-th document is held out when no rule above names whole files or splits
        self.every = None if self.valid_sources else max(1, round(1.0 / self.valid_fraction))

    def _valid_sources(self, valid_files: Sequence[str] | None) -> set[str]:
        rels = [s.rel for s in self.sources]
        if valid_files is not None:
            valid_files = [valid_files] if isinstance(valid_files, str) else list(valid_files)
            missing = [v for v in valid_files if v not in rels]
            if missing:
                raise ValueError(f"valid_files not found under {self.root}: {missing}")
            chosen = set(valid_files)
        elif any(s.dataset_split in DATASET_VALID_SPLITS for s in self.sources):
            name = next(n for n in DATASET_VALID_SPLITS if n in rels)
            chosen = {name}
            if "train" in rels:  # train on "train" only: never on a second held-out split
                self.sources = [s for s in self.sources if s.rel in ("train", name)]
                rels = [s.rel for s in self.sources]
        elif self.plain_text:
            if len(rels) < 2:
                raise ValueError(
                    f"data {self.root} needs at least 2 .txt files (one document each, split by "
                    f"file), found {len(rels)}"
                )
            if all(v in rels for v in DEFAULT_VALID_FILES):
                chosen = set(DEFAULT_VALID_FILES)
            else:
                k = max(len(rels) // 10, 1)
                chosen = set(rels[:: len(rels) // k][:k])
        else:
            return set()
        if len(chosen) == len(rels):
            raise ValueError(
                f"every source under {self.root} is a validation source; nothing left to train on"
            )
        return chosen

    @property
    def packs_by_default(self) -> bool:
        """Record data (JSONL, Parquet, datasets) is many short documents: pack them. A .txt
        folder is a few long books, trained on random windows as before."""
        return not self.plain_text

    def files(self, split: str) -> list[Path]:
        """Source paths whose documents all belong to ``split`` ("train" or "valid"); with
        the every-k-th rule a file holds both, and both lists name it."""
        if self.every is not None:
            return [s.path for s in self.sources]
        want = split == "valid"
        return [s.path for s in self.sources if (s.rel in self.valid_sources) == want]

    def documents(self, only: str | None = None) -> Iterator[tuple[str, str]]:
        """``(split, text)`` for every document, in source order; ``only`` ("train" or
        "valid") skips the documents of the other split, and whole sources of it unread."""
        index = 0
        for source in self.sources:
            whole = "valid" if source.rel in self.valid_sources else "train"
            if only is not None and self.every is None and whole != only:
                continue
            for text in iter_documents(source, self.text_field, self.skip_empty):
                split = whole
                if self.every is not None:
                    split = "valid" if index % self.every == 0 else "train"
                    index += 1
                if only is None or split == only:
                    yield split, text

    def fingerprint(self) -> str:
        """Changes whenever a source file or a split option changes."""
        h = hashlib.sha256(
            json.dumps(
                [
                    CACHE_VERSION,
                    self.text_field,
                    self.skip_empty,
                    self.every,
                    sorted(self.valid_sources),
                ]
            ).encode()
        )
        for source in self.sources:
            files = [source.path] if source.path.is_file() else sorted(source.path.rglob("*"))
            for p in files:
                if p.is_file():
                    st = p.stat()
                    h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]

    def total_documents(self) -> int:
        return sum(count_documents(s) for s in self.sources)


# ---------------------------------------------------------------------------- tokenizing
class _SplitWriter:
    """Appends one split's documents to a raw temporary file, then writes the .npy pair."""

    def __init__(self, folder: Path, dtype: type, eot_id: int) -> None:
        fd, self.raw = tempfile.mkstemp(dir=folder, suffix=".raw.tmp")
        self.file = os.fdopen(fd, "wb")
        self.dtype = dtype
        self.eot = np.array([eot_id], dtype=dtype)
        self.lengths: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        self.file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.file.write(self.eot.tobytes())
        self.lengths.append(len(ids) + 1)

    def finish(self, tokens_path: Path, docs_path: Path) -> None:
        self.file.close()
        try:
            n = sum(self.lengths)
            offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=offsets[1:])
            _atomic_npy(docs_path, offsets)
            raw = np.memmap(self.raw, dtype=self.dtype, mode="r", shape=(n,)) if n else None
            fd, tmp = tempfile.mkstemp(dir=tokens_path.parent, suffix=".npy.tmp")
            os.close(fd)
            try:
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(n,))
                block = 1 << 24
                for lo in range(0, n, block):
                    out[lo : lo + block] = raw[lo : lo + block]
                out.flush()
                del out, raw
                os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shareable
                os.replace(tmp, tokens_path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            os.unlink(self.raw)

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.raw):
            os.unlink(self.raw)


def _atomic_npy(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _encode_many(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode_array(t) for t in texts]


_WORKER_TOKENIZER: Any = None  # the tokenizer of a tokenizing worker process


def _start_worker(tokenizer: Any) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    # one text at a time: the processes are the parallelism (a batch call would start a
    # thread pool per worker: tiktoken's 8 threads each, oversubscribing the cores)
    return [_WORKER_TOKENIZER.encode_array(t) for t in texts]


def check_workers(workers: object) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers (tokenizer processes) must be an int >= 1, got {workers!r}")
    return workers


def encode_batches(
    tokenizer: Any, batches: Iterable[list[str]], workers: int = 1
) -> Iterator[list[np.ndarray]]:
    """Each batch of texts tokenized, in order, by ``workers`` processes: the results (and so
    a cache's bytes) are the same for any worker count. At most ``2 * workers`` batches are in
    flight, so memory stays bounded however long ``batches`` is."""
    if check_workers(workers) == 1:
        for texts in batches:
            yield _encode_many(tokenizer, texts)
        return
    methods = multiprocessing.get_all_start_methods()
    # fork: workers inherit the tokenizer and the imports (spawn would re-import torch, ~s each)
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # Hugging Face tokenizers warn (and go serial) in a forked child after the parent used
    # their thread pool; the workers are the parallelism here
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = context.Pool(workers, initializer=_start_worker, initargs=(tokenizer,))
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending: deque = deque()
        for texts in batches:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()  # also when the consumer stops early (a generator closed)
        pool.join()


def _batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenized_documents(
    corpus: Corpus, tokenizer: Any, split: str, workers: int = 1
) -> Iterator[np.ndarray]:
    """One pass over ``split``'s documents, each tokenized and followed by the separator (the
    cache's layout), with no cache: what streaming reads."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    sep = np.array([tokenizer.eot_id], dtype=dtype)
    texts = ([t for _, t in chunk] for chunk in _batched(corpus.documents(split), _BATCH_DOCS))
    for encoded in encode_batches(tokenizer, texts, workers):
        for ids in encoded:
            yield np.concatenate([np.asarray(ids, dtype=dtype), sep])


def cache_paths(corpus: Corpus, tokenizer: Any, cache_dir: Path, split: str) -> tuple[Path, Path]:
    stem = f"{split}-{tokenizer.name}-{corpus.fingerprint()}"
    return cache_dir / f"{stem}.npy", cache_dir / f"{stem}.docs.npy"


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: Any,
    cache_dir: str | os.PathLike,
    progress: bool = True,
    workers: int = 1,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (tokens, offsets)}`` for "train" and "valid", memory-mapped from the cache;
    tokenizes every document once (both splits in one pass, in ``workers`` processes: the same
    bytes for any count) when the cache lacks them."""
    cache_dir = Path(cache_dir)
    paths = {s: cache_paths(corpus, tokenizer, cache_dir, s) for s in ("train", "valid")}
    if not all(p.exists() for pair in paths.values() for p in pair):
        cache_dir.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        writers = {s: _SplitWriter(cache_dir, dtype, tokenizer.eot_id) for s in paths}
        try:
            bar = tqdm(
                total=corpus.total_documents(),
                desc=f"tokenizing {corpus.root.name} ({tokenizer.name})",
                unit="doc",
                disable=not progress,
                dynamic_ncols=True,
            )
            splits: deque[list[str]] = deque()  # each batch's splits, in the batches' order

            def texts() -> Iterator[list[str]]:
                for chunk in _batched(corpus.documents(), _BATCH_DOCS):
                    splits.append([split for split, _ in chunk])
                    yield [text for _, text in chunk]

            for encoded in encode_batches(tokenizer, texts(), workers):
                for split, ids in zip(splits.popleft(), encoded):
                    writers[split].add(ids)
                bar.update(len(encoded))
            bar.close()
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        empty = [split for split, w in writers.items() if not w.lengths]
        if empty:
            for w in writers.values():
                w.abort()
            hint = {
                "train": "every document is held out (add documents, or name fewer valid_files)",
                "valid": "name valid_files (paths relative to the data folder) to hold some out",
            }
            raise ValueError(
                f"data {corpus.root}: the {empty[0]} split has no documents; {hint[empty[0]]}"
            )
        for split, w in writers.items():
            w.finish(*paths[split])
    return {s: (np.load(tok, mmap_mode="r"), np.load(docs)) for s, (tok, docs) in paths.items()}
