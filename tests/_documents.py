"""Small document corpora and a tiny Hugging Face tokenizer, made at test time (nothing is
downloaded), in every format the language task reads."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a of and to in is was that he she it for with as his her on be at by this had not "
    "are but from or have an they which one you were all we there been if more when will "
    "would who so no river stone garden window letter morning evening captain sister "
    "brother music silence shadow journey harbour lantern meadow"
).split()


def make_documents(n: int = 40, seed: int = 0) -> list[str]:
    """``n`` documents of 1-4 paragraphs of 20-60 words (lengths vary a lot, some unicode),
    every paragraph ending with a word and a full stop."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        paragraphs = []
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 60))]
            words[0] = words[0].capitalize()
            paragraphs.append(" ".join(words) + ".")
        if i % 7 == 3:
            paragraphs.append("Ünïcödé → ✓ “quotes” — naïve café.")
        docs.append("\n\n".join(paragraphs))
    return docs


def write_txt(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": i, field: d}, ensure_ascii=False) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=7)
    return path


def write_dataset(
    path: Path, docs: list[str], valid: list[str] | None = None, test: list[str] | None = None
) -> Path:
    """A ``datasets.save_to_disk`` folder: a Dataset, or with ``valid`` a DatasetDict with
    train, validation (and ``test``) splits."""
    from datasets import Dataset, DatasetDict

    train = Dataset.from_dict({"text": docs})
    if valid is None:
        train.save_to_disk(str(path))
        return path
    splits = {"train": train, "validation": Dataset.from_dict({"text": valid})}
    if test is not None:
        splits["test"] = Dataset.from_dict({"text": test})
    DatasetDict(splits).save_to_disk(str(path))
    return path


def make_hf_tokenizer(folder: Path, docs: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE trained on ``docs`` with the ``tokenizers`` library, saved with
    ``save_pretrained`` (tokenizer.json + tokenizer_config.json), eos ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(folder))
    return folder
