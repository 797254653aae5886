"""Bring-your-own data and tokenizer (issue 25): every data format, the split by document,
Hugging Face tokenizer folders, tokenizers saved with checkpoints, document packing (a packed
row scores each document as if it ran alone), TensorBoard / W&B logs, the errors users hit."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _documents import (
    make_documents,
    make_hf_tokenizer,
    write_dataset,
    write_jsonl,
    write_parquet,
    write_txt,
)

from deltaflow.cli import main
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.tasks import LanguageModeling
from deltaflow.tasks.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    get_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from deltaflow.train import TrainConfig, Trainer, latest_checkpoint
from deltaflow.train.trainer import model_logits

DOCS = make_documents(40)
GPT2 = Path(__file__).parents[2] / "shared" / "tokenizers" / "gpt2.tiktoken"
TINY_MODEL = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Path:
    return make_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"), DOCS)


def lm(data: Path, cache: Path, **kw) -> LanguageModeling:
    return LanguageModeling(data, seq_len=kw.pop("seq_len", 32), cache_dir=cache, **kw)


def split_docs(task: LanguageModeling, split: str) -> list[str]:
    """The split's documents decoded back from the token cache (each ends in the separator)."""
    stream, offsets = task.stream(split), task.doc_offsets(split)
    out = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        assert stream[b - 1] == task.tokenizer.eot_id
        out.append(task.tokenizer.decode(np.asarray(stream[a : b - 1]).tolist()))
    return out


# ---------------------------------------------------------------------------- data formats
def write_data(fmt: str, root: Path) -> Path:
    if fmt == "txt":
        return write_txt(root / "txt", DOCS)
    if fmt == "jsonl":
        return write_jsonl(root / "data.jsonl", DOCS)
    if fmt == "jsonl_folder":  # two files: documents are numbered across them
        write_jsonl(root / "jl" / "a.jsonl", DOCS[:25])
        write_jsonl(root / "jl" / "sub" / "b.jsonl", DOCS[25:])
        return root / "jl"
    if fmt == "parquet":
        return write_parquet(root / "data.parquet", DOCS)
    assert fmt == "dataset"
    return write_dataset(root / "saved", DOCS)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl_folder", "parquet", "dataset"])
def test_every_format_gives_the_same_documents_and_split(fmt, tmp_path, monkeypatch):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    if fmt == "dataset":
        pytest.importorskip("datasets")
    data = write_data(fmt, tmp_path)
    # 40 documents: .txt folders hold out every tenth file, records every tenth document
    task = lm(data, tmp_path / "cache", valid_fraction=0.1)
    assert split_docs(task, "valid") == DOCS[::10]
    assert split_docs(task, "train") == [d for i, d in enumerate(DOCS) if i % 10]
    assert task.pack == (fmt != "txt")  # packing is the default for record data
    # a second task reads the cache instead of tokenizing again
    monkeypatch.setattr(ByteTokenizer, "encode_array", lambda *a: pytest.fail("re-tokenized"))
    again = lm(data, tmp_path / "cache", valid_fraction=0.1)
    assert np.array_equal(again.stream("train"), task.stream("train"))


def test_validation_from_a_dataset_dict_split_and_from_valid_files(tmp_path):
    pytest.importorskip("datasets")
    data = write_dataset(tmp_path / "dd", DOCS[:30], valid=DOCS[30:35], test=DOCS[35:])
    task = lm(data, tmp_path / "cache")
    assert split_docs(task, "train") == DOCS[:30] and split_docs(task, "valid") == DOCS[30:35]
    write_jsonl(tmp_path / "jl" / "a.jsonl", DOCS[:30])
    write_jsonl(tmp_path / "jl" / "b.jsonl", DOCS[30:], field="body")
    task = lm(tmp_path / "jl", tmp_path / "cache", valid_files=["b.jsonl"], text_field="body")
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no field 'body'.*text_field"):
        task.stream("train")
    write_jsonl(tmp_path / "jl" / "a.jsonl", DOCS[:30], field="body")
    task = lm(tmp_path / "jl", tmp_path / "cache", valid_files=["b.jsonl"], text_field="body")
    assert split_docs(task, "train") == DOCS[:30] and split_docs(task, "valid") == DOCS[30:]


# ---------------------------------------------------------------------------- tokenizers
def test_hugging_face_tokenizer_folder(hf_tok, tmp_path):
    from transformers import AutoTokenizer

    tok = get_tokenizer(str(hf_tok))  # a folder path is a Hugging Face tokenizer
    reference = AutoTokenizer.from_pretrained(str(hf_tok))
    assert isinstance(tok, HFTokenizer) and tok.name == get_tokenizer("hf", hf_tok).name
    assert tok.eot_id == reference.eos_token_id and tok.vocab_size == len(reference)
    text = DOCS[3]  # has unicode
    ids = tok.encode(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size
    assert tok.eot_id not in tok.encode("one </s> two")  # text never becomes the separator
    nbytes = tok.token_bytes()  # byte-level BPE: bytes per token are exact
    assert nbytes[ids].sum() == len(text.encode()) and nbytes[tok.eot_id] == 0
    # the name is the tokenizer's content: a copy elsewhere shares the token cache
    assert get_tokenizer(str(shutil.copytree(hf_tok, tmp_path / "copy"))).name == tok.name
    task = lm(write_jsonl(tmp_path / "d.jsonl", DOCS), tmp_path / "cache", tokenizer=str(hf_tok))
    assert task.vocab_size == tok.vocab_size
    assert split_docs(task, "train")[0] == DOCS[1]  # document 0 is held out


@pytest.mark.parametrize("kind", ["byte", "hf", "tiktoken"])
def test_saved_tokenizer_reads_back_in_deltaflow_and_in_transformers(kind, hf_tok, tmp_path):
    from transformers import AutoTokenizer

    if kind == "tiktoken" and not GPT2.is_file():
        pytest.skip("shared/tokenizers/gpt2.tiktoken not present")
    tok = {
        "byte": ByteTokenizer,
        "hf": lambda: HFTokenizer(hf_tok),
        "tiktoken": lambda: BPETokenizer(GPT2),
    }[kind]()
    folder = save_tokenizer(tok, tmp_path / "saved")
    back = load_tokenizer(folder)
    assert type(back) is type(tok) and back.name == tok.name
    assert (back.vocab_size, back.eot_id) == (tok.vocab_size, tok.eot_id)
    text = DOCS[3] + "\n  tabs\tand  spaces "
    assert back.encode(text) == tok.encode(text)
    hf = AutoTokenizer.from_pretrained(str(folder))  # what from_pretrained users load
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text and hf.eos_token_id == tok.eot_id


# ---------------------------------------------------------------------------- packing
def test_packed_rows_lay_whole_documents_end_to_end(tmp_path):
    task = lm(write_jsonl(tmp_path / "d.jsonl", DOCS), tmp_path / "cache", seq_len=64)
    T, sep = 64, task.tokenizer.eot_id
    stream = np.asarray(task.stream("train"))
    rows_per_epoch = len(stream) // T
    batches = [task.get_batch(4, "train", s) for s in range(math.ceil(rows_per_epoch / 4))]
    assert torch.equal(batches[1]["input_ids"], task.get_batch(4, "train", 1)["input_ids"])
    epoch = {
        k: torch.cat([b[k] for b in batches])[:rows_per_epoch].reshape(-1).numpy()
        for k in batches[0]
    }
    labels, inputs, starts = epoch["labels"], epoch["input_ids"], epoch["doc_starts"]
    # laid end to end, an epoch is [sep] doc [sep] doc ...: inputs are the labels shifted by one
    assert np.array_equal(inputs, np.r_[sep, labels[:-1]])
    # a sequence starts at every document and at every row (a document cut by a row's end
    # continues in the next row as its own piece)
    unit_start = np.r_[True, labels[:-1] == sep]
    row_start = np.arange(len(labels)) % T == 0
    assert np.array_equal(starts, unit_start | row_start)
    # every training document once (the last one may be cut by the epoch's end), shuffled
    offsets = task.doc_offsets("train")
    docs = {tuple(stream[a : b - 1]) for a, b in zip(offsets[:-1], offsets[1:])}
    seen = [tuple(d) for d in np.split(labels, np.flatnonzero(labels == sep) + 1)[:-1]]
    seen = [d[:-1] for d in seen]
    assert len(seen) == len(set(seen)) >= len(docs) - 3 and set(seen) <= docs
    order = [
        next(
            i
            for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))
            if tuple(stream[a : b - 1]) == d
        )
        for d in seen
    ]
    assert order != sorted(order)
    # the next epoch is another order
    nxt = task.get_batch(1, "train", rows_per_epoch)["labels"][0].numpy()
    assert not np.array_equal(nxt, labels[:T])


@pytest.mark.parametrize("attn_every", [0, 2], ids=["delta", "hybrid"])
def test_a_packed_row_scores_every_document_as_if_it_ran_alone(attn_every, tmp_path):
    """float64: per-token losses of the packed rows equal each document (piece) run alone;
    the state, the short convolution and attention restart at every document."""
    short = [d[: 12 + 5 * i] for i, d in enumerate(DOCS[:16])]  # 12-87 bytes: whole in a row
    data = write_jsonl(tmp_path / "d.jsonl", short + DOCS[16:24])
    task = lm(data, tmp_path / "cache", seq_len=96, valid_fraction=0.1)
    batch = task.get_batch(2, "train", 0)
    torch.manual_seed(0)
    config = DeltaFlowConfig(
        vocab_size=task.vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        use_decay=True,
        attn_every=attn_every,
        backend="torch",
    )
    model = DeltaFlowForCausalLM(config).double().eval()
    with torch.no_grad():
        packed = model_logits(model, batch["input_ids"], batch["doc_starts"])
        loss = F.cross_entropy(packed.transpose(1, 2), batch["labels"], reduction="none")
        whole_documents = 0
        for b in range(2):
            cut = [*torch.nonzero(batch["doc_starts"][b]).flatten().tolist(), 96]
            for lo, hi in zip(cut[:-1], cut[1:]):
                ids = batch["input_ids"][b : b + 1, lo:hi]
                alone = model(input_ids=ids).logits
                ref = F.cross_entropy(alone[0], batch["labels"][b, lo:hi], reduction="none")
                torch.testing.assert_close(loss[b, lo:hi], ref, atol=1e-10, rtol=1e-10)
                sep = task.tokenizer.eot_id
                whole_documents += int(ids[0, 0] == sep and batch["labels"][b, hi - 1] == sep)
        assert whole_documents >= 2  # some pieces are whole documents, run exactly alone
        # without the offsets the rows would read across documents: the losses differ
        plain = model_logits(model, batch["input_ids"])
        assert not torch.allclose(plain, packed)


# ---------------------------------------------------------------------------- training
def test_train_on_jsonl_with_a_tokenizer_folder_keeps_the_tokenizer_and_logs_everywhere(
    hf_tok, tmp_path, capsys, monkeypatch
):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tok_dir = shutil.copytree(hf_tok, tmp_path / "tok")
    data = write_jsonl(tmp_path / "data.jsonl", DOCS)
    out = tmp_path / "run"
    argv = ["train", "--task", "lm", "--data-dir", str(data), "--tokenizer", str(tok_dir)]
    argv += ["--seq-len", "32", *TINY_MODEL, "--steps", "3", "--log-every", "1"]
    argv += ["--batch-size", "4", "--device", "cpu", "--no-progress", "--out", str(out)]
    argv += ["--task-arg", f"cache_dir={tmp_path / 'cache'}", "--tensorboard", "--wandb"]
    argv += ["--set", "eval_kwargs={num_examples: 4}"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["finished"] and math.isfinite(summary["eval"]["loss"])
    saved = latest_checkpoint(out) / "tokenizer"
    assert load_tokenizer(saved).name == HFTokenizer(tok_dir).name
    # generate decodes with the checkpoint's copy: the original folder may be gone
    shutil.rmtree(tok_dir)
    gen = ["generate", str(out), "--prompt", "the river", "--max-new-tokens", "6"]
    assert main([*gen, "--device", "cpu", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the river")
    # TensorBoard: train and eval scalars at their steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/ppl")] == [3]
    # W&B: an offline run in the run folder, to be uploaded with `wandb sync`
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"content": "x"}',
            r"bad\.jsonl:2: no field 'text' \(it has 'content'\); pass text_field",
        ),
        ('{"text": "  "}', r"bad\.jsonl:2: field 'text' is empty; .*skip_empty=true"),
        ('{"text": null}', r"bad\.jsonl:2: field 'text' is null"),
        ('{"text": 3}', r"bad\.jsonl:2: field 'text' is a int, expected a string"),
        ("text, not json", r"bad\.jsonl:2: not valid JSON"),
    ],
)
def test_bad_jsonl_records_name_the_file_the_line_and_the_fix(line, message, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": DOCS[0]}) + "\n" + line + "\n" + json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match=message):
        lm(bad, tmp_path / "cache").stream("train")


def test_skip_empty_and_a_parquet_without_the_column(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", DOCS[0], "", DOCS[1]]))
    task = lm(data, tmp_path / "cache", skip_empty=True, valid_fraction=0.5)
    assert split_docs(task, "valid") == [DOCS[0]] and split_docs(task, "train") == [DOCS[1]]
    pytest.importorskip("pyarrow")
    parquet = write_parquet(tmp_path / "p.parquet", DOCS, field="body")
    with pytest.raises(ValueError, match=r"p\.parquet: no field 'text' \(it has 'id', 'body'\)"):
        lm(parquet, tmp_path / "cache").stream("train")


def test_a_dataset_too_small_for_one_batch(tmp_path):
    task = lm(write_jsonl(tmp_path / "d.jsonl", DOCS[:3]), tmp_path / "cache", valid_fraction=0.5)
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl: the train split has \d+ tokens, fewer than "
        r"one batch of 64 x 32 = 2048; add documents, or lower --batch-size",
    ):
        task.get_batch(64, "train", 0)
    with pytest.raises(ValueError, match="the train split has no documents"):
        lm(write_jsonl(tmp_path / "one.jsonl", DOCS[:1]), tmp_path / "cache").stream("train")


def test_a_tokenizer_larger_than_the_model(hf_tok, tmp_path):
    task = lm(write_jsonl(tmp_path / "d.jsonl", DOCS), tmp_path / "cache", tokenizer=str(hf_tok))
    small = DeltaFlowForCausalLM(
        DeltaFlowConfig(vocab_size=257, hidden_size=16, num_layers=1, num_heads=2, backend="torch")
    )
    config = TrainConfig(task="lm", device="cpu", progress=False)
    with pytest.raises(
        ValueError,
        match=rf"tokenizer {hf_tok} has {task.vocab_size} tokens but "
        "the model's vocabulary has 257",
    ):
        Trainer(config, model=small, task=task)
