"""Data at scale (issue 35): tokenization in worker processes (the same cache bytes for any
worker count), streaming without a cache, weighted mixtures of sources; all deterministic in
(seed, step), so a run killed and resumed reads the same batches as a straight run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _documents import (
    make_documents,
    make_hf_tokenizer,
    write_dataset,
    write_jsonl,
    write_parquet,
    write_txt,
)

import deltaflow.tasks.corpus as corpus_mod
from deltaflow.tasks import LanguageModeling
from deltaflow.tasks.corpus import Corpus, cache_paths, tokenize_corpus
from deltaflow.tasks.tokenizers import HFTokenizer, get_tokenizer
from deltaflow.train import TrainConfig, Trainer, latest_checkpoint

DOCS = make_documents(60)
GPT2 = Path(__file__).parents[2] / "shared" / "tokenizers" / "gpt2.tiktoken"
OTHER = [d.upper() for d in make_documents(20, seed=1)]  # a second source, told apart by case


def lm(data, tmp_path, **kw) -> LanguageModeling:
    kw.setdefault("valid_fraction", 0.1)
    return LanguageModeling(data, seq_len=kw.pop("seq_len", 16), cache_dir=tmp_path / "c", **kw)


def units(task: LanguageModeling, n: int) -> list[str]:
    """The first ``n`` training documents of a streaming / mixture task, decoded."""
    it = task._train_units()
    out = [task.tokenizer.decode(next(it)[:-1].tolist()) for _ in range(n)]
    it.close()
    return out


# ---------------------------------------------------------------------------- workers
@pytest.mark.parametrize("kind", ["byte", "hf", "gpt2"])
def test_parallel_tokenization_writes_the_same_cache_bytes(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "_BATCH_DOCS", 7)  # many batches: every worker gets some
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    if kind == "gpt2" and not GPT2.is_file():
        pytest.skip(f"{GPT2} not found")
    tok = {
        "byte": lambda: get_tokenizer("byte"),
        "hf": lambda: HFTokenizer(make_hf_tokenizer(tmp_path / "tok", DOCS)),
        "gpt2": lambda: get_tokenizer("gpt2", GPT2),
    }[kind]()
    corpus = Corpus(data, valid_fraction=0.1)
    files = {}
    for workers in (1, 2, 3):
        cache = tmp_path / f"cache{workers}"
        tokenize_corpus(corpus, tok, cache, progress=False, workers=workers)
        files[workers] = [
            p.read_bytes()
            for split in ("train", "valid")
            for p in cache_paths(corpus, tok, cache, split)
        ]
    assert files[1] == files[2] == files[3]


def test_workers_is_checked_in_one_line(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(ValueError, match=r"^workers \(tokenizer processes\) must be an int >= 1"):
        lm(data, tmp_path, workers=0)


# ---------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset"])
def test_streaming_reads_the_cached_split_without_writing_a_cache(fmt, tmp_path):
    if fmt == "jsonl":
        data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    elif fmt == "parquet":
        pytest.importorskip("pyarrow")
        data = write_parquet(tmp_path / "d.parquet", DOCS)
    else:
        pytest.importorskip("datasets")
        data = write_dataset(tmp_path / "saved", DOCS)
    cached = lm(data, tmp_path / "a")
    streamed = lm(data, tmp_path / "b", streaming=True, workers=2, shuffle_buffer=8)
    train = [d for i, d in enumerate(DOCS) if i % 10]
    first_epoch = units(streamed, len(train))
    assert sorted(first_epoch) == sorted(train) and first_epoch != train  # shuffled, complete
    # validation: the same documents and tokens as the cached task's
    assert np.array_equal(streamed.stream("valid"), cached.stream("valid"))
    assert torch.equal(
        next(streamed.eval_batches("valid"))["input_ids"],
        next(cached.eval_batches("valid"))["input_ids"],
    )
    assert not (tmp_path / "b" / "c").exists()  # nothing cached
    assert streamed.train_passes(10, 4) is None


def test_streaming_batches_are_deterministic_and_resume_mid_epoch(tmp_path):
    data = write_txt(tmp_path / "txt", DOCS[:20])  # .txt sources stream too
    straight = lm(data, tmp_path, streaming=True, seq_len=64)
    batches = [straight.get_batch(4, "train", s) for s in range(12)]  # several epochs
    assert straight._packer.replays == 1  # consecutive steps continue the sequence
    fresh = lm(data, tmp_path, streaming=True, seq_len=64, workers=2)
    for step in (7, 8, 3):  # a resumed run jumps forward; an earlier step replays
        again = fresh.get_batch(4, "train", step)
        assert all(torch.equal(again[k], batches[step][k]) for k in again), step
    # rows keep the packed layout: inputs are the labels shifted by one, documents start at sep
    b = batches[5]
    sep = straight.tokenizer.eot_id
    inside = ~b["doc_starts"][:, 1:]
    assert torch.equal(b["input_ids"][:, 1:][inside], b["labels"][:, :-1][inside])
    assert (b["input_ids"][b["doc_starts"] & (b["input_ids"] == sep)] == sep).all()


# ---------------------------------------------------------------------------- mixtures
@pytest.mark.parametrize("streaming", [False, True])
def test_mixture_draws_documents_by_weight_deterministically(streaming, tmp_path):
    write_jsonl(tmp_path / "d" / "low.jsonl", DOCS)
    write_jsonl(tmp_path / "d" / "up" / "x.jsonl", OTHER)
    mixture = {"low.jsonl": 1, "up": 3}
    task = lm(tmp_path / "d", tmp_path, mixture=mixture, streaming=streaming)
    drawn = units(task, 800)
    upper = sum(d.isupper() for d in drawn) / len(drawn)
    assert 0.7 < upper < 0.8  # weight 3 of 4, though "up" has a third of the documents
    assert drawn == units(lm(tmp_path / "d", tmp_path, mixture=mixture, streaming=streaming), 800)
    # validation: each source's held-out documents, one source after the other
    valid = task.stream("valid")
    expected = lm(tmp_path / "d" / "low.jsonl", tmp_path).stream("valid")
    assert np.array_equal(valid[: len(expected)], expected)
    assert task.pack and task.get_batch(3, "train", 5)["doc_starts"].shape == (3, 16)
    if not streaming:  # the most-read source: "up", 3/4 of the tokens
        passes = task.train_passes(100, 4)
        assert passes == pytest.approx(100 * 4 * 16 * 0.75 / len(task._cached(1)["train"][0]))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mixture": {"low.jsonl": 0}}, r"mixture weight of 'low.jsonl' must be a number > 0"),
        ({"mixture": {"nope": 1}}, r"mixture source 'nope' not found"),
        ({"mixture": []}, r"mixture must be a non-empty mapping"),
        ({"streaming": True, "pack": False}, r"pack=false .* does not combine with streaming"),
        ({"streaming": "yes"}, r"streaming must be true or false"),
    ],
)
def test_mixture_and_streaming_errors_are_one_line(kw, message, tmp_path):
    write_jsonl(tmp_path / "d" / "low.jsonl", DOCS)
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message) as err:
        lm(tmp_path / "d", tmp_path, **kw)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- resume
@pytest.mark.parametrize("streaming", [False, True])
def test_killed_and_resumed_mixture_run_reads_the_same_batches(streaming, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d" / "low.jsonl", DOCS)
    write_jsonl(tmp_path / "d" / "up.jsonl", OTHER)
    task_kwargs = {
        "data_dir": str(tmp_path / "d"),
        "seq_len": 32,
        "cache_dir": str(tmp_path / "cache"),
        "mixture": {"low.jsonl": 2, "up.jsonl": 1},
        "streaming": streaming,
        "valid_fraction": 0.1,
    }
    model = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "backend": "torch"}

    def config(out: str) -> TrainConfig:
        return TrainConfig(
            task="lm",
            task_kwargs=task_kwargs,
            model=model,
            steps=8,
            batch_size=4,
            lr=1e-2,
            log_every=2,
            ckpt_every=3,
            eval_kwargs={"num_examples": 2},
            progress=False,
            device="cpu",
            out_dir=out,
        )

    seen: list = []  # (step, input_ids) of every training batch the trainers read
    read = LanguageModeling.get_batch

    def spy(self, batch_size, split="train", step=0):
        batch = read(self, batch_size, split, step)
        if split == "train":
            seen.append((step, batch["input_ids"]))
        return batch

    monkeypatch.setattr(LanguageModeling, "get_batch", spy)
    straight = Trainer(config(str(tmp_path / "straight")))
    straight.train()
    by_step, _ = dict(seen), seen.clear()

    class Killed(Exception):
        pass

    def die_at_5(trainer, step):
        if step == 5:
            raise Killed

    with pytest.raises(Killed):
        Trainer(config(str(tmp_path / "r")), callbacks=[die_at_5]).train()
    assert latest_checkpoint(tmp_path / "r").name == "step_0000003"
    resumed = Trainer(config(str(tmp_path / "r")))  # a new process would build a new task
    assert resumed.step == 3
    resumed.train()
    assert [s for s, _ in seen] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    for step, ids in seen:
        assert torch.equal(ids, by_step[step]), step
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
