"""Tokenizers for language modelling, and the copy of its tokenizer that a run keeps.

- `ByteTokenizer`: UTF-8 bytes are ids 0..255, `<|endoftext|>` is 256 (vocab 257).
- `BPETokenizer`: GPT-2 BPE from a local `.tiktoken` file (base64 token + rank per line) with
  the GPT-2 split regex; `<|endoftext|>` gets the id after the last rank (50256 for GPT-2).
- `HFTokenizer`: any local Hugging Face tokenizer folder (what ``save_pretrained`` writes:
  ``tokenizer.json``, ``tokenizer_config.json``, ...), read by ``transformers.AutoTokenizer``
  with ``local_files_only``: nothing is downloaded. Its ``eos_token`` (else ``bos_token``)
  separates documents.

Every tokenizer has ``name`` (content-addressed: it keys the token cache), ``vocab_size``,
``eot_id`` (the document separator), ``encode``/``encode_array``/``decode``, ``token_bytes``
(UTF-8 bytes per id, for bits per byte) and ``to_hf()``: the same tokenizer as a transformers
``PreTrainedTokenizerFast``. `save_tokenizer` writes a folder that both deltaflow
(`load_tokenizer`) and Hugging Face (``AutoTokenizer.from_pretrained``) read; every checkpoint
holds one in ``tokenizer/``, so ``deltaflow generate`` and ``from_pretrained`` users decode the
way the run was trained, even after the original tokenizer file moved.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

EOT_TEXT = "<|endoftext|>"
# The GPT-2 pre-tokenization pattern (contractions, letters, numbers, other, whitespace).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Written beside the Hugging Face files of a saved tokenizer: which deltaflow class to rebuild.
META_FILE = "deltaflow_tokenizer.json"
# BPETokenizer.to_hf conversions by tokenizer name (content hash): a lab grid builds one task
# per run, and the conversion takes seconds.
_HF_CONVERSIONS: dict[str, Any] = {}


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class ByteTokenizer:
    """UTF-8 bytes; no merges, nothing unknown, exact round trip for any text."""

    name = "byte"
    kind = "byte"

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

    def to_hf(self) -> Any:
        """Byte-level BPE with no merges: byte b is id b, `<|endoftext|>` 256, as here."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        char_of_byte = bytes_to_unicode()  # the byte-level alphabet GPT-2 style tokenizers use
        tok = Tokenizer(models.BPE(vocab={char_of_byte[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT_TEXT)


class BPETokenizer:
    """GPT-2 byte-level BPE from a local `.tiktoken` file; never touches the network."""

    kind = "tiktoken"

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
        return np.asarray(self.enc.encode_ordinary(text), dtype=_token_dtype(self.vocab_size))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        dtype = _token_dtype(self.vocab_size)
        return [np.asarray(ids, dtype=dtype) for ids in self.enc.encode_ordinary_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        out = np.array(
            [len(self.enc.decode_single_token_bytes(i)) for i in range(self.eot_id)] + [0],
            dtype=np.int64,
        )
        return out

    def to_hf(self) -> Any:
        """The same BPE as a transformers tokenizer (ranks -> merges, built once: ~3 s for
        GPT-2). Ids and decoding match; only a literal "<|endoftext|>" in a text encodes to the
        special id there (Hugging Face's convention), to ordinary tokens here."""
        if self.name not in _HF_CONVERSIONS:
            from transformers import PreTrainedTokenizerFast
            from transformers.convert_slow_tokenizer import TikTokenConverter

            converter = TikTokenConverter(
                vocab_file=str(self.path), pattern=GPT2_PATTERN, extra_special_tokens=[EOT_TEXT]
            )
            _HF_CONVERSIONS[self.name] = PreTrainedTokenizerFast(
                tokenizer_object=converter.converted(), eos_token=EOT_TEXT
            )
        return _HF_CONVERSIONS[self.name]


class HFTokenizer:
    """A local Hugging Face tokenizer folder, through ``AutoTokenizer`` (offline).

    ``vocab_size`` counts added tokens too (``len(tokenizer)``, or the largest id + 1 if that
    is larger), so every id the tokenizer can produce has a row in the model's embedding.
    Text never turns into special tokens: a literal "</s>" in a document is encoded as text,
    the separator comes only from between documents.
    """

    kind = "hf"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"tokenizer folder not found: {self.path} (expected a folder written by a Hugging "
                "Face tokenizer's save_pretrained, with tokenizer.json or tokenizer_config.json)"
            )
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ValueError(
                f"cannot load a Hugging Face tokenizer from {self.path}: {err}"
            ) from None
        eot = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.bos_token_id
        if eot is None:
            raise ValueError(
                f"tokenizer {self.path} has neither an eos_token nor a bos_token; deltaflow "
                "separates documents with one: set tokenizer.eos_token and save_pretrained again"
            )
        self.eot_id = int(eot)
        largest = max(self.hf.get_vocab().values(), default=-1)
        self.vocab_size = max(len(self.hf), largest + 1)
        self._backend = None
        if getattr(self.hf, "is_fast", False):
            from tokenizers import Tokenizer

            serialized = self.hf.backend_tokenizer.to_str()
            # a private copy: the switch below must not change the user's tokenizer object
            self._backend = Tokenizer.from_str(serialized)
            self._backend.encode_special_tokens = True
            digest = hashlib.sha256(serialized.encode()).hexdigest()
        else:
            digest = _folder_digest(self.path)
        self.name = f"hf-{digest[:12]}"

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=_token_dtype(self.vocab_size))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._backend is None:
            return [self.encode_array(t) for t in texts]
        dtype = _token_dtype(self.vocab_size)
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=dtype) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per id: exact for byte-level BPE (GPT-2, Llama 3, ...), byte-fallback
        pieces (``<0x41>``) and SentencePiece's ``▁``; special tokens count 0."""
        tokens = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        special = set(self.hf.all_special_ids)
        byte_level = self._backend is not None and '"ByteLevel"' in json.dumps(
            json.loads(self._backend.to_str()).get("decoder")
        )
        byte_of_char: dict[str, int] = {}
        if byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            byte_of_char = {c: b for b, c in bytes_to_unicode().items()}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i, tok in enumerate(tokens):
            if tok is None or i in special:
                continue
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
                out[i] = 1
            elif byte_level:
                out[i] = sum(1 if c in byte_of_char else len(c.encode()) for c in tok)
            else:
                out[i] = len(tok.replace("\u2581", " ").encode("utf-8"))
        return out

    def to_hf(self) -> Any:
        return self.hf


Tokenizer = ByteTokenizer | BPETokenizer | HFTokenizer


def _folder_digest(folder: Path) -> str:
    """Content hash of a tokenizer folder's small files (weights beside it are skipped)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.stat().st_size < 64 * 2**20:
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def get_tokenizer(tokenizer: str = "byte", path: str | os.PathLike | None = None) -> Tokenizer:
    """``"byte"``; ``"gpt2"``/``"bpe"`` with ``path`` to a .tiktoken file; ``"hf"`` with
    ``path`` to a Hugging Face tokenizer folder; or the path itself as ``tokenizer`` (a
    ``.tiktoken`` file or a tokenizer folder)."""
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer in ("gpt2", "bpe"):
        if path is None:
            raise ValueError(
                f"tokenizer={tokenizer!r} needs tokenizer_path, a GPT-2 .tiktoken file "
                "(deltaflow train: --tokenizer-path FILE)"
            )
        return BPETokenizer(path)
    if tokenizer == "hf":
        if path is None:
            raise ValueError("tokenizer='hf' needs tokenizer_path=<Hugging Face tokenizer folder>")
        return HFTokenizer(path)
    text = str(tokenizer)
    if text.endswith(".tiktoken"):
        return BPETokenizer(text)
    if Path(text).is_dir():
        return HFTokenizer(text)
    if "/" in text or os.sep in text or Path(text).suffix:
        raise FileNotFoundError(
            f"tokenizer {text!r} is neither a .tiktoken file nor a tokenizer folder that exists"
        )
    raise ValueError(
        "tokenizer must be 'byte', 'gpt2' (with tokenizer_path), 'hf' (with tokenizer_path), a "
        f".tiktoken file or a Hugging Face tokenizer folder, got {tokenizer!r}"
    )


# ---------------------------------------------------------------------------- saved copies
def save_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike) -> Path:
    """Write ``tokenizer`` into ``folder`` in Hugging Face form (``AutoTokenizer`` reads it)
    plus ``deltaflow_tokenizer.json``, which `load_tokenizer` uses to rebuild the exact
    deltaflow tokenizer (a `.tiktoken` file is copied in as well)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.to_hf().save_pretrained(str(folder))
    meta: dict[str, Any] = {
        "kind": tokenizer.kind,
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
    }
    if isinstance(tokenizer, BPETokenizer):
        shutil.copyfile(tokenizer.path, folder / tokenizer.path.name)
        meta["file"] = tokenizer.path.name
    (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in ``folder`` by `save_tokenizer`, or any Hugging Face tokenizer
    folder (then an `HFTokenizer`)."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        return HFTokenizer(folder)
    meta = json.loads(meta_path.read_text())
    kind = meta.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return BPETokenizer(folder / meta["file"])
    if kind == "hf":
        return HFTokenizer(folder)
    raise ValueError(f"{meta_path}: unknown tokenizer kind {kind!r}")


def run_tokenizer(checkpoint: str | os.PathLike, task_kwargs: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a language-model checkpoint: the copy saved in it, else (checkpoints
    written before tokenizers were saved) the one its config names."""
    saved = Path(checkpoint) / "tokenizer"
    if saved.is_dir():
        return load_tokenizer(saved)
    return get_tokenizer(task_kwargs.get("tokenizer", "byte"), task_kwargs.get("tokenizer_path"))


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int, tokenizer_desc: str) -> None:
    """A tokenizer whose ids reach past the model's embedding would index out of range (a
    cryptic error on CPU, a device assert on GPU): say so first."""
    if tokenizer_vocab > model_vocab:
        raise ValueError(
            f"tokenizer {tokenizer_desc} has {tokenizer_vocab} tokens but the model's vocabulary "
            f"has {model_vocab}: use the tokenizer the model was trained with, or train a model "
            f"for this tokenizer (its vocab_size comes from the tokenizer)"
        )
