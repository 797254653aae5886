"""Invariants of every task generator: labels are right, batches are deterministic, splits
are disjoint, evaluation sets are fixed, metrics are exact, tokenizers round-trip."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from deltaflow.tasks import IGNORE_INDEX, TASKS, get_task
from deltaflow.tasks.language import BPETokenizer, ByteTokenizer, LanguageModeling
from deltaflow.tasks.mqar import MQAR, PRESETS

SHARED = Path(__file__).parents[2] / "shared"
GPT2 = SHARED / "tokenizers" / "gpt2.tiktoken"
CORPUS = SHARED / "corpus"

# small, odd-shaped configurations so every test is quick
SMALL = {
    "mqar": dict(seq_len=70, num_kv_pairs=5, vocab_size=301),
    "in_context_recall": dict(seq_len=46, num_train_examples=300),
    "fuzzy_recall": dict(seq_len=58, num_train_examples=None),
    "noisy_recall": dict(seq_len=46, num_train_examples=None),
    "selective_copy": dict(seq_len=37, num_tokens_to_copy=5, vocab_size=11),
    "compress": dict(seq_len=22, vocab_size=13),
    "memorize": dict(seq_len=18, vocab_size=67),
    "parity": dict(max_len=23),
    "mod_arith": dict(max_len=23),
    "mod_arith_brackets": dict(max_len=23),
    "s5": dict(max_len=23),
}
SYNTHETIC = sorted(SMALL)


def small(name: str, **kw):
    return get_task(name, **{**SMALL[name], **kw})


def test_registry_lists_every_task_and_rejects_unknown_names():
    assert set(TASKS) == set(SMALL) | {"lm"}
    assert type(get_task("in-context-recall")).__name__ == "InContextRecall"
    with pytest.raises(ValueError, match="unknown task"):
        get_task("mqar2")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_batches_are_well_formed_and_deterministic(name):
    task = small(name, seed=3)
    b = task.get_batch(7, "train", step=5)
    ids, labels = b["input_ids"], b["labels"]
    assert ids.shape == labels.shape == (7, task.seq_len)
    assert ids.dtype == labels.dtype == torch.long
    assert 0 <= ids.min() and ids.max() < task.vocab_size
    scored = labels != IGNORE_INDEX
    assert scored.any() and (labels[scored] >= 0).all() and labels.max() < task.vocab_size
    assert 0 < task.chance < 1
    assert len({tuple(r) for r in ids.tolist()}) > 1  # examples differ within a batch
    # same (seed, split, step) -> same batch, from a fresh task object too
    again = small(name, seed=3).get_batch(7, "train", step=5)
    assert torch.equal(ids, again["input_ids"]) and torch.equal(labels, again["labels"])
    # any change of step, split or seed -> a different batch
    for other in (
        task.get_batch(7, "train", step=6),
        task.get_batch(7, "test", step=5),
        small(name, seed=4).get_batch(7, "train", step=5),
    ):
        assert not torch.equal(ids, other["input_ids"])


@pytest.mark.parametrize("name", SYNTHETIC)
def test_eval_set_is_fixed_finite_and_batch_size_independent(name):
    task = small(name)
    a = list(task.eval_batches("valid", num_examples=300, batch_size=128))
    assert [x["input_ids"].shape[0] for x in a] == [128, 128, 44]
    b = torch.cat([x["input_ids"] for x in task.eval_batches("valid", 300, batch_size=7)])
    assert torch.equal(torch.cat([x["input_ids"] for x in a]), b)
    # a smaller evaluation set is a prefix of a larger one; valid and test differ
    fresh = small(name)
    assert torch.equal(fresh.eval_set("valid", 100)["input_ids"], b[:100])
    assert not torch.equal(fresh.eval_set("test", 100)["input_ids"], b[:100])


@pytest.mark.parametrize("name", ["mqar", "in_context_recall", "selective_copy", "compress"])
def test_train_and_test_examples_are_disjoint(name):
    task = small(name)
    train = task.get_batch(256, "train", 0)["input_ids"]
    test = task.eval_set("test", 256)["input_ids"]
    rows = {tuple(r) for r in train.tolist()}
    assert not any(tuple(r) in rows for r in test.tolist())


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="num_kv_pairs"):
        MQAR(seq_len=64, num_kv_pairs=17)
    with pytest.raises(ValueError, match="even"):
        MQAR(seq_len=65, num_kv_pairs=4)
    with pytest.raises(TypeError, match="seq_len"):
        MQAR(seq_len=64.0)
    with pytest.raises(ValueError, match="frac_noise"):
        get_task("noisy_recall", frac_noise=1.0)
    task = small("mqar")
    with pytest.raises(ValueError, match="split"):
        task.get_batch(2, "validation")
    with pytest.raises(ValueError, match="batch_size"):
        task.get_batch(0)
    with pytest.raises(ValueError, match="logits"):
        task.metrics(torch.randn(2, 5, task.vocab_size), task.get_batch(2))
    with pytest.raises(ValueError, match="length"):
        small("parity").eval_set("test", 10, length=1)
    with pytest.raises(ValueError, match="even"):
        small("mod_arith").eval_set("test", 10, length=41)


# ------------------------------------------------------------------------------------ MQAR
@pytest.mark.parametrize("random_fill", [True, False])
def test_mqar_every_query_label_is_the_value_bound_to_its_key(random_fill):
    task = MQAR(seq_len=70, num_kv_pairs=5, vocab_size=301, random_non_queries=random_fill)
    b = task.get_batch(64, "train", 1)
    P, half = 5, 301 // 2
    for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        keys, values = ids[0 : 2 * P : 2], ids[1 : 2 * P : 2]
        assert len(set(keys)) == P and all(1 <= k < half for k in keys)
        assert len(set(values)) == P and all(half <= v < 301 for v in values)
        bound = dict(zip(keys, values))
        qpos = [t for t, y in enumerate(labels) if y != IGNORE_INDEX]
        assert len(qpos) == P and min(qpos) >= 2 * P and all((t - 2 * P) % 2 == 0 for t in qpos)
        assert sorted(ids[t] for t in qpos) == sorted(keys)  # every key queried once
        assert all(labels[t] == bound[ids[t]] for t in qpos)
        if not random_fill:
            assert all(ids[t] == 0 for t in range(2 * P, 70) if t not in qpos)


@pytest.mark.parametrize("score_rebinds", [True, False])
def test_mqar_rebinding_labels_are_the_latest_binding(score_rebinds):
    """A token-by-token replay of every example: walk the sequence keeping a dict of the
    current binding; every scored key's label must be that dict's entry (the latest value),
    and the final queries must differ from every earlier binding of their key."""
    P, R, V, T = 4, 3, 40, 34
    task = MQAR(T, P, V, bindings_per_key=R, score_rebinds=score_rebinds, seed=3)
    b = task.get_batch(64, "train", 2)
    half = V // 2
    for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        context = ids[: 2 * P * R]
        keys, values = context[0::2], context[1::2]
        assert len(set(values)) == P * R and all(half <= v < V for v in values)  # fresh values
        for r in range(R):  # every round binds each of the same P keys once
            assert sorted(keys[r * P : (r + 1) * P]) == sorted(keys[:P])
        history: dict[int, list[int]] = {}
        scored = 0
        for t in range(0, 2 * P * R, 2):
            key, value = ids[t], ids[t + 1]
            expected = history[key][-1] if key in history and score_rebinds else IGNORE_INDEX
            assert labels[t] == expected and labels[t + 1] == IGNORE_INDEX
            scored += expected != IGNORE_INDEX
            history.setdefault(key, []).append(value)
        assert scored == (P * (R - 1) if score_rebinds else 0)
        qpos = [t for t in range(2 * P * R, T) if labels[t] != IGNORE_INDEX]
        assert sorted(ids[t] for t in qpos) == sorted(keys[:P])  # each key queried once
        for t in qpos:
            assert labels[t] == history[ids[t]][-1]  # only the latest binding counts
            assert labels[t] not in history[ids[t]][:-1]


def test_mqar_rebinding_checks_sizes_and_keeps_zoology_default():
    with pytest.raises(ValueError, match="bindings_per_key"):
        MQAR(seq_len=32, num_kv_pairs=4, vocab_size=64, bindings_per_key=4)  # needs 40 tokens
    with pytest.raises(ValueError, match="distinct values"):
        MQAR(seq_len=40, num_kv_pairs=4, vocab_size=16, bindings_per_key=4)  # 16 > 8 values
    with pytest.raises(ValueError, match="bindings_per_key"):
        MQAR(seq_len=40, num_kv_pairs=4, vocab_size=64, bindings_per_key=0)
    a = MQAR(64, 4, 64, seed=1).get_batch(8, "train", 5)
    b = MQAR(64, 4, 64, bindings_per_key=1, seed=1).get_batch(8, "train", 5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mqar_gaps_follow_the_power_law_and_presets_build():
    task = MQAR(seq_len=512, num_kv_pairs=8, vocab_size=8192)
    labels = task.get_batch(256, "train", 0)["labels"]
    gaps = ((labels != IGNORE_INDEX).nonzero()[:, 1] - 16) // 2  # 0-based gap index
    # p(g) ∝ g^-0.99: far more mass on short gaps than a uniform draw over 248 slots
    assert (gaps < 31).float().mean() > 0.5
    assert [(t.seq_len, t.num_kv_pairs) for t in MQAR.presets()] == list(PRESETS)


# ------------------------------------------------------------------------------------- MAD
def _pairs(ids, labels):
    return list(zip(ids[0::2], ids[1::2])), labels


@pytest.mark.parametrize("name", ["in_context_recall", "noisy_recall"])
def test_recall_labels_are_the_value_of_a_key_seen_before(name):
    task = small(name)
    K = task.num_keys
    batch = task.eval_set("test", 64)
    n_noise = 0
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        bound: dict[int, int] = {}
        for t in range(0, len(ids), 2):
            k, v = ids[t], ids[t + 1]
            if k >= 2 * K:  # a noise pair: both tokens noise, nothing scored
                assert v >= 2 * K and labels[t] == IGNORE_INDEX
                n_noise += 1
                continue
            assert k < K <= v < 2 * K
            assert bound.setdefault(k, v) == v  # a key keeps its value within a sequence
            expected = v if (k in bound and t > 0 and _seen(ids, k, t, K)) else IGNORE_INDEX
            assert labels[t] == expected
        assert labels[-1] == IGNORE_INDEX
    assert (n_noise > 0) == (name == "noisy_recall")
    # the closing pair always probes a key presented before
    assert (batch["labels"][:, -2] != IGNORE_INDEX).all()
    # training labels are every next token (MAD trains on the whole sequence)
    train = task.get_batch(4, "train", 0)
    assert torch.equal(train["labels"][:, :-1], train["input_ids"][:, 1:])


def _seen(ids, k, t, K):
    return any(ids[s] == k for s in range(0, t, 2))


def test_fuzzy_recall_motifs_are_consistent_and_labelled():
    task = small("fuzzy_recall")
    K, pad = task.num_keys, task.pad_id
    for split in ("train", "test"):
        b = task.get_batch(32, split, 0) if split == "train" else task.eval_set("test", 32)
        for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
            start = next(i for i, x in enumerate(ids) if x != pad)
            assert all(x == pad for x in ids[:start]) and pad not in ids[start:]
            # runs of key tokens (< K) alternate with runs of value tokens
            runs = [(k, list(g)) for k, g in itertools.groupby(ids[start:], lambda x: x < K)]
            assert runs[0][0]  # starts with a key
            bound: dict[tuple, tuple] = {}
            pos = start
            for (is_key, key), (_, val) in zip(runs[0::2], runs[1::2]):
                assert is_key and len(set(key)) == len(key) <= task.k_motif_size
                if split == "test":
                    assert len(key) == task.k_motif_size
                    want = val if tuple(key) in bound else [IGNORE_INDEX] * len(val)
                    # labels[t] is the target for position t, i.e. token t + 1
                    first_val = pos + len(key)
                    assert labels[first_val - 1 : first_val - 1 + len(val)] == want
                # the input drops the sequence's last token: the final value may be cut short
                got = bound.setdefault(tuple(key), tuple(val))
                last = pos + len(key) + len(val) == len(ids)
                assert got[: len(val)] == tuple(val) if last else got == tuple(val)
                pos += len(key) + len(val)


def test_selective_copy_labels_are_the_content_in_order():
    task = small("selective_copy")
    b = task.get_batch(32, "train", 2)
    m, T = task.num_tokens_to_copy, task.seq_len
    for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        region = ids[: T - m - 1]
        content = [x for x in region if x != task.blank_id]
        assert len(content) == m and ids[T - m - 1] == task.copy_id
        assert all(x == task.blank_id for x in ids[T - m :])
        assert labels[T - m :] == content and set(labels[: T - m]) == {IGNORE_INDEX}


def test_compress_reconstructs_the_prefix():
    task = small("compress")
    b = task.get_batch(16, "valid", 0)
    m = task.seq_len // 2
    assert (b["input_ids"][:, m:] == task.compress_id).all()
    assert (b["input_ids"][:, :m] != task.compress_id).all()
    assert torch.equal(b["labels"][:, m:], b["input_ids"][:, :m])
    assert (b["labels"][:, :m] == IGNORE_INDEX).all()


def test_memorize_uses_one_fixed_map_and_never_shows_values():
    task = small("memorize")
    kv = {}
    for b in (task.get_batch(16, "train", 0), task.eval_set("test", 64)):
        ids, labels = b["input_ids"], b["labels"]
        assert (ids[:, 1::2] == task.insert_id).all() and (ids[:, 0::2] < task.num_keys).all()
        assert (labels[:, 0::2] == IGNORE_INDEX).all()
        for k, v in zip(ids[:, 0::2].flatten().tolist(), labels[:, 1::2].flatten().tolist()):
            assert kv.setdefault(k, v) == v and task.num_keys <= v < task.insert_id
    assert len(set(kv.values())) == len(kv)  # injective map
    # the finite training set: every train batch comes from the same 256 examples
    pool = {tuple(r) for r in task._train_pool()["input_ids"].tolist()}
    assert len(task._train_pool()["input_ids"]) == 256
    assert all(tuple(r) in pool for r in task.get_batch(32, "train", 9)["input_ids"].tolist())


# ------------------------------------------------------------------------- state tracking
def _rows(batch):
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        L = sum(1 for x in ids if x != 0)
        assert all(x == 0 for x in ids[L:]) and all(y == IGNORE_INDEX for y in labels[L:])
        yield ids[:L], labels[:L]


def test_parity_labels_final_or_every_prefix():
    task = small("parity")
    lengths = set()
    for ids, labels in _rows(task.get_batch(128, "train", 0)):
        lengths.add(len(ids))
        assert set(ids) <= {1, 2}
        assert labels[:-1] == [IGNORE_INDEX] * (len(ids) - 1)
        assert labels[-1] == 1 + sum(x - 1 for x in ids) % 2
    assert min(lengths) >= 3 and max(lengths) <= 23 and len(lengths) > 10
    dense = small("parity", label_every_token=True)
    for ids, labels in _rows(dense.eval_set("test", 64, length=41)):
        assert len(ids) == 41
        assert labels == [1 + sum(x - 1 for x in ids[: t + 1]) % 2 for t in range(41)]
    mixed = task.eval_set("test", 256)
    assert mixed["input_ids"].shape[1] == 256
    lens = (mixed["input_ids"] != 0).sum(1)
    assert lens.min() >= 40 and lens.max() <= 256 and task.eval_lengths == [40, 64, 128, 256]


SYMBOLS = {1: "+", 2: "-", 3: "*", 4: "(", 5: ")"}


@pytest.mark.parametrize("name", ["mod_arith", "mod_arith_brackets"])
def test_modular_arithmetic_answers_are_the_expression_value(name):
    task = small(name)
    num0, eq = task.NUM0, task.EQ
    syms = {1: "+", 2: "-", 3: "*"} if name == "mod_arith" else SYMBOLS
    for batch in (task.get_batch(64, "train", 0), task.eval_set("test", 32, length=64)):
        for ids, labels in _rows(batch):
            assert ids[-1] == eq and eq not in ids[:-1]
            assert labels[:-1] == [IGNORE_INDEX] * (len(ids) - 1)
            text = "".join(str(x - num0) if x >= num0 else syms[x] for x in ids[:-1])
            assert labels[-1] - num0 == eval(text) % task.modulus, text
            if name == "mod_arith_brackets":
                depth = 0
                for ch in text:  # brackets balanced, never closing an unopened one
                    depth += (ch == "(") - (ch == ")")
                    assert depth >= 0
                assert depth == 0
            else:
                assert len(ids) % 2 == 0 and all(x >= num0 for x in ids[0:-1:2])


def test_s5_labels_are_running_products():
    task = small("s5")
    perms = [tuple(p) for p in itertools.permutations(range(5))]
    for ids, labels in _rows(task.get_batch(32, "train", 0)):
        state = tuple(range(5))
        for x, y in zip(ids, labels):
            g = perms[x - 1]
            state = tuple(g[state[i]] for i in range(5))  # p_t[i] = g_t[p_{t-1}[i]]
            assert perms[y - 1] == state


# ------------------------------------------------------------------------------- metrics
def test_metrics_are_exact_for_perfect_and_wrong_predictions():
    task = small("mod_arith")
    batch = task.eval_set("test", 300)
    labels = batch["labels"]
    perfect = torch.nn.functional.one_hot(labels.clamp_min(0), task.vocab_size).float() * 20
    m = task.metrics(perfect, batch)
    assert m["accuracy"] == 1.0 and m["scaled_accuracy"] == 1.0 and m["loss"] < 1e-6
    wrong = torch.nn.functional.one_hot((labels.clamp_min(0) + 1) % 5 + 5, task.vocab_size)
    m = task.metrics(wrong.float(), batch)
    assert m["accuracy"] == 0.0 and m["scaled_accuracy"] == pytest.approx(-0.25)
    # evaluate() pools exactly: a predictor right on even rows only scores 50%
    table = dict(zip(map(tuple, batch["input_ids"].tolist()), perfect))

    def half_right(ids):  # right on rows whose first number is even
        out = torch.stack([table[tuple(r)] for r in ids.tolist()])
        odd = (ids[:, 0] - task.NUM0) % 2 == 1
        out[odd] = out[odd].roll(1, dims=-1)
        return out

    n_even = int(((batch["input_ids"][:, 0] - task.NUM0) % 2 == 0).sum())
    m = task.evaluate(half_right, "test", num_examples=300, batch_size=7)
    assert m["num_scored"] == 300 and m["accuracy"] == pytest.approx(n_even / 300)
    assert m["sequence_accuracy"] == pytest.approx(n_even / 300)


# ------------------------------------------------------------------------------ language
TEXTS = {
    "a.txt": "Hello, world! Ünïcödé → ✓\nSecond line.\n" * 40,
    "sub/b.txt": "The quick brown fox jumps over the lazy dog. " * 60,
    "sub/c.txt": "Lorem ipsum dolor sit amet, 12345 — ‘quotes’.\n" * 50,
    "d.txt": "Validation text is held out by file, not by offset. " * 30,
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for rel, text in TEXTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS.values():
        ids = tok.encode(text)
        assert max(ids) < 256 and tok.decode(ids) == text
        assert tok.encode_array(text).tolist() == ids
    assert tok.vocab_size == 257 and tok.decode([72, 105, tok.eot_id]) == "Hi"


def test_language_task_split_cache_batches_and_extrapolation(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    task = LanguageModeling(corpus, seq_len=16, valid_files=["d.txt"], cache_dir=cache)
    assert [p.name for p in task.files["valid"]] == ["d.txt"]
    assert not set(task.files["train"]) & set(task.files["valid"])
    train, valid = task.stream("train"), task.stream("valid")
    assert task.tokenizer.decode(valid.tolist()) == TEXTS["d.txt"]
    assert int((np.asarray(train) == 256).sum()) == 3  # one <|endoftext|> per document
    # a second task reads the cache instead of tokenizing again
    monkeypatch.setattr(ByteTokenizer, "encode_array", lambda *a: pytest.fail("re-tokenized"))
    task2 = LanguageModeling(corpus, seq_len=16, valid_files=["d.txt"], cache_dir=cache)
    assert np.array_equal(task2.stream("train"), train)
    b = task2.get_batch(5, "train", 3)
    assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    assert torch.equal(b["input_ids"], task.get_batch(5, "train", 3)["input_ids"])
    row = b["input_ids"][0].numpy()
    starts = [i for i in range(len(train) - 16) if np.array_equal(train[i : i + 16], row)]
    assert starts  # windows are real slices of the stream
    assert_same_tokens_at_every_length(task)


def scored_positions(task: LanguageModeling, length: int, num_examples=None) -> list[tuple]:
    """(stream position of the label, label, context length) of every scored token, windows
    mode: label j of a window starting at w is stream[w + j + 1], seen after j + 1 inputs."""
    stream = np.asarray(task.stream("valid"))
    assert len(set(stream.tolist())) == len(stream)  # distinct tokens: a token is its position
    out = []
    for batch in task.eval_batches("valid", num_examples, batch_size=3, length=length):
        assert batch["input_ids"].shape[1] == length
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            w = int(ids[0])
            assert np.array_equal(stream[w : w + length], ids)
            for j in torch.nonzero(labels != -100).flatten().tolist():
                assert labels[j] == stream[w + j + 1]
                out.append((w + j + 1, int(labels[j]), j + 1))
    return out


def assert_same_tokens_at_every_length(task: LanguageModeling) -> None:
    # issue 24: 1x, 2x and 4x score the same tokens at the same stream positions (also with a
    # num_examples cap, which used to keep more text at 2x), each with as much context as the
    # length allows: at 2x every row but the first sees seq_len more tokens
    T = task.seq_len
    valid = np.arange(9 * T + 5, dtype=np.int64)  # distinct ids, not a multiple of 4T
    task._data = {"train": task._split("train"), "valid": (valid, np.array([0, len(valid)]))}
    for cap in (None, 5):
        base = scored_positions(task, T, cap)
        assert len(base) == (cap or len(task.eval_starts("valid"))) * T
        assert all(ctx <= T for _, _, ctx in base)
        for m in (2, 4):
            longer = scored_positions(task, m * T, cap)
            assert [p[:2] for p in longer] == [p[:2] for p in base]
            for (pos, _, ctx), (_, _, ctx1) in zip(longer, base):
                assert ctx == min(pos, (m - 1) * T + ctx1)  # the window [0, mT) for the first rows


def test_language_train_passes_count_the_training_split(corpus, tmp_path):
    task = LanguageModeling(corpus, seq_len=16, valid_files=["d.txt"], cache_dir=tmp_path)
    n = len(task.stream("train"))
    assert task.train_passes(10, 4) == pytest.approx(10 * 4 * 16 / n)
    assert task.train_passes(n, 1) == pytest.approx(16.0)  # n windows of 16 tokens


def test_language_metrics_bits_per_byte(corpus, tmp_path):
    task = LanguageModeling(corpus, seq_len=12, valid_files=["a.txt"], cache_dir=tmp_path)
    batch = next(task.eval_batches("valid", batch_size=4))
    logits = torch.randn(4, 12, task.vocab_size, generator=torch.Generator().manual_seed(0))
    m = task.metrics(logits, batch)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"])
    assert m["loss"] == pytest.approx(nll.item(), rel=1e-5)
    assert m["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-5)
    assert m["bpb"] == pytest.approx(nll.item() / math.log(2), rel=1e-5)  # 1 byte per token


def test_language_task_rejects_bad_inputs(corpus, tmp_path):
    with pytest.raises(FileNotFoundError):
        LanguageModeling(tmp_path / "nope")
    with pytest.raises(ValueError, match="valid_files"):
        LanguageModeling(corpus, valid_files=["missing.txt"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        LanguageModeling(corpus, tokenizer="gpt2", cache_dir=tmp_path)


@pytest.mark.skipif(not GPT2.is_file(), reason="shared/tokenizers/gpt2.tiktoken not present")
def test_gpt2_bpe_loads_from_local_file_and_round_trips():
    tok = BPETokenizer(GPT2)
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    for text in TEXTS.values():
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_bytes()[15496] == len(b"Hello")


@pytest.mark.skipif(not CORPUS.is_dir(), reason="shared/corpus not present")
def test_shared_corpus_default_split_is_the_readme_one(tmp_path):
    task = LanguageModeling(CORPUS, cache_dir=tmp_path)
    names = sorted(p.name for p in task.files["valid"])
    assert names == ["austen_persuasion.txt", "shakespeare_hamlet.txt", "shakespeare_sonnets.txt"]
    assert len(task.files["train"]) > 40


def test_uniform_eval_lengths_are_every_valid_test_length():
    # issue 24: the paper's test distribution is uniform over lengths 40-256
    assert get_task("mod_arith", eval_lengths="uniform").eval_lengths == list(range(40, 257, 2))
    assert get_task("parity", eval_lengths="uniform").eval_lengths == list(range(40, 257))
    brackets = get_task("mod_arith_brackets", eval_lengths="uniform", eval_max_len=60)
    assert brackets.eval_lengths == list(range(40, 61))
    with pytest.raises(ValueError, match="eval_lengths must be a list of lengths or 'uniform'"):
        get_task("parity", eval_lengths="all")
    with pytest.raises(ValueError, match="no length in"):
        get_task("mod_arith", eval_lengths="uniform", eval_min_len=41, eval_max_len=41)


def test_uniform_headline_is_the_mean_over_every_length_and_keeps_per_length_numbers():
    from deltaflow.train import TrainConfig, Trainer

    cfg = TrainConfig(
        task="mod_arith",
        task_kwargs={"eval_lengths": "uniform", "eval_max_len": 50},
        model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "backend": "torch"},
        steps=1,
        batch_size=4,
        eval_kwargs={"num_examples": 8, "batch_size": 8},
        progress=False,
        device="cpu",
    )
    metrics = Trainer(cfg).evaluate()
    lengths = range(40, 51, 2)
    per_length = [metrics[f"scaled_accuracy@{L}"] for L in lengths]
    assert metrics["scaled_accuracy"] == pytest.approx(sum(per_length) / len(per_length))
    assert not any(f"scaled_accuracy@{L}" in metrics for L in range(41, 51, 2))
