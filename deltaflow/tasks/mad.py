"""The six MAD synthetic tasks (Poli et al., "Mechanistic Design and Scaling of Hybrid
Architectures", the `mad-lab` benchmark), with the benchmark's baseline settings as defaults.

| task | vocab | seq_len | what is scored |
| --- | --- | --- | --- |
| in_context_recall | 16 | 128 | value of every key seen before (multi-query) |
| fuzzy_recall | 16 | 128 | value tokens of keys seen before; keys/values are 1-3 token motifs |
| noisy_recall | 32 (16 noise) | 128 | as in-context recall, 20% of pairs replaced by noise |
| selective_copy | 16 | 256 | the 16 content tokens, in order, after the copy token |
| compress | 16 | 64 | the 32 tokens before the compress token, in order, after it |
| memorize | 256 | 32 | the value of a fixed key-value map at each insert token |

Like MAD, each task has a finite training set (`num_train_examples`, 12,800; 256 for
memorize): training batches sample from it. `num_train_examples=None` gives a fresh stream.
Like MAD, the recall tasks train on every next token (`train_on_all_tokens=True`) and
evaluate only the recall positions. Differences from mad-lab (all documented in
docs/tasks.md): inputs are exactly `seq_len` tokens (mad-lab feeds seq_len - 1), compress is
a causal-LM version of MAD's auto-encoder task, selective-copy content positions are a uniform
random subset, fuzzy recall does not train on its left padding.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaflow.tasks.base import (
    IGNORE_INDEX,
    Batch,
    Task,
    check_float,
    check_int,
    numpy_seed,
)
from deltaflow.validation import check_bool


def _shift_targets(tokens: torch.Tensor, targets: torch.Tensor) -> Batch:
    """Inputs are the tokens; labels[t] = target of token t+1 (nothing after the last)."""
    labels = torch.full_like(targets, IGNORE_INDEX)
    labels[:, :-1] = targets[:, 1:]
    return {"input_ids": tokens, "labels": labels}


def _check_no_options(name: str, kw: dict) -> None:
    if kw:
        raise TypeError(f"{name} takes no evaluation options, got {sorted(kw)}")


class _MADTask(Task):
    default_eval_examples = 1280  # MAD's num_test_examples

    def __init__(self, seed: int, num_train_examples: int | None) -> None:
        super().__init__(seed)
        if num_train_examples is not None:
            check_int("num_train_examples", num_train_examples, 1)
        self.num_train_examples = num_train_examples


class InContextRecall(_MADTask):
    """Key-value pairs `k v k v ...`; each key keeps its value within a sequence and the
    model must predict the value whenever a key reappears. Keys come from the first half of the
    (non-noise) vocabulary, values from the second; with `frac_noise > 0` each pair slot is
    replaced, with that probability, by two tokens of a separate noise vocabulary."""

    name = "in_context_recall"

    def __init__(
        self,
        vocab_size: int = 16,
        seq_len: int = 128,
        noise_vocab_size: int = 0,
        frac_noise: float = 0.0,
        num_train_examples: int | None = 12_800,
        train_on_all_tokens: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(seed, num_train_examples)
        self.vocab_size = check_int("vocab_size", vocab_size, 4)
        self.seq_len = check_int("seq_len", seq_len, 4)
        if seq_len % 2:
            raise ValueError(f"seq_len must be even (key-value pairs), got {seq_len}")
        self.noise_vocab_size = check_int("noise_vocab_size", noise_vocab_size, 0, vocab_size - 4)
        self.frac_noise = check_float("frac_noise", frac_noise, 0.0, 1.0, high_open=True)
        if frac_noise > 0 and noise_vocab_size == 0:
            raise ValueError("frac_noise > 0 needs noise_vocab_size > 0")
        self.train_on_all_tokens = check_bool("train_on_all_tokens", train_on_all_tokens)
        plain = vocab_size - noise_vocab_size
        self.num_keys = plain // 2
        self.num_values = plain - self.num_keys
        self.chance = 1.0 / self.num_values

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        _check_no_options(self.name, kw)
        K, Vv, P = self.num_keys, self.num_values, self.seq_len // 2
        kv_map = torch.randint(0, Vv, (n, K), generator=g) + K  # values may repeat across keys
        keys = torch.randint(0, K, (n, P), generator=g)
        noise = torch.rand(n, P, generator=g) < self.frac_noise
        # one guaranteed pair among the first P-1, and the last pair is always a real probe
        keep = torch.randint(0, P - 1, (n,), generator=g)
        noise[torch.arange(n), keep] = False
        noise[:, -1] = False
        # first real slot of each key among the first P-1 pairs (P if never presented)
        slot = torch.arange(P).expand(n, P)
        first = torch.full((n, K), P, dtype=torch.long)
        first.scatter_reduce_(1, keys[:, :-1], torch.where(noise, P, slot)[:, :-1], reduce="amin")
        # the closing pair probes one of the distinct keys presented so far (as in MAD)
        keys[:, -1] = torch.multinomial((first < P).float(), 1, generator=g).squeeze(1)
        values = kv_map.gather(1, keys)
        noise_tok = torch.randint(0, max(self.noise_vocab_size, 1), (n, P, 2), generator=g)
        noise_tok += K + Vv
        pairs = torch.stack([keys, values], dim=2)
        tokens = torch.where(noise[..., None], noise_tok, pairs).reshape(n, 2 * P)

        # a value is scored when its key appeared in an earlier real pair
        seen_before = first.gather(1, keys) < slot
        scored = seen_before & ~noise
        if split == "train" and self.train_on_all_tokens:
            targets = tokens.clone()
        else:
            targets = torch.full((n, P, 2), IGNORE_INDEX, dtype=torch.long)
            targets[..., 1] = torch.where(scored, values, IGNORE_INDEX)
            targets = targets.reshape(n, 2 * P)
        return _shift_targets(tokens, targets)


class NoisyRecall(InContextRecall):
    """In-context recall with 20% of the pairs replaced by noise tokens (MAD defaults)."""

    name = "noisy_recall"

    def __init__(
        self,
        vocab_size: int = 32,
        seq_len: int = 128,
        noise_vocab_size: int = 16,
        frac_noise: float = 0.2,
        num_train_examples: int | None = 12_800,
        train_on_all_tokens: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            vocab_size, seq_len, noise_vocab_size, frac_noise, num_train_examples,
            train_on_all_tokens, seed,
        )  # fmt: skip


class FuzzyRecall(_MADTask):
    """Recall where keys and values are motifs of 1..3 distinct tokens (keys always 3 tokens
    at evaluation). Sequences are left-padded with a pad token to `seq_len`."""

    name = "fuzzy_recall"

    def __init__(
        self,
        vocab_size: int = 16,
        seq_len: int = 128,
        k_motif_size: int = 3,
        v_motif_size: int = 3,
        num_train_examples: int | None = 12_800,
        train_on_all_tokens: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(seed, num_train_examples)
        self.vocab_size = check_int("vocab_size", vocab_size, 5)
        self.seq_len = check_int("seq_len", seq_len, 8)
        plain = vocab_size - 1  # last token is the pad
        self.pad_id = vocab_size - 1
        self.num_keys = plain // 2
        self.num_values = plain - self.num_keys
        self.k_motif_size = check_int("k_motif_size", k_motif_size, 1, self.num_keys)
        self.v_motif_size = check_int("v_motif_size", v_motif_size, 1, self.num_values)
        if seq_len < 4 * (k_motif_size + v_motif_size):
            raise ValueError(
                f"seq_len={seq_len} too short for motifs of {k_motif_size}+{v_motif_size} tokens"
            )
        self.train_on_all_tokens = check_bool("train_on_all_tokens", train_on_all_tokens)
        self.chance = 1.0 / self.num_values

    def _one(self, rng: np.random.Generator, train: bool) -> tuple[list[int], list[int]]:
        K, kmax, vmax, L = self.num_keys, self.k_motif_size, self.v_motif_size, self.seq_len + 1

        def key(size: int) -> tuple[int, ...]:
            return tuple(rng.permutation(K)[:size].tolist())

        def value(size: int) -> tuple[int, ...]:
            return tuple((rng.permutation(self.num_values)[:size] + K).tolist())

        def key_size() -> int:
            return int(rng.integers(1, kmax + 1)) if train else kmax

        kp, vp = key(key_size()), value(int(rng.integers(1, vmax + 1)))
        budget = L - len(kp) - len(vp) - (kmax + vmax)  # leaves room for the closing probe
        # the probe pair goes in before `budget` is reached (steps are <= kmax + vmax tokens)
        probe_at = int(rng.integers(0, budget - (kmax + vmax)))
        kv: dict[tuple[int, ...], tuple[int, ...]] = {}
        tokens: list[int] = []
        targets: list[int] = []
        while len(tokens) < budget:
            k = kp if (kp not in kv and len(tokens) >= probe_at) else key(key_size())
            if k == kp:
                v = vp
            elif k in kv:
                v = kv[k]
            else:
                v = value(int(rng.integers(1, vmax + 1)))
            # a value is scored when its key was presented before (multi-query)
            targets += [IGNORE_INDEX] * len(k) + (list(v) if k in kv else [IGNORE_INDEX] * len(v))
            tokens += k + v
            kv[k] = v
        assert kp in kv and len(tokens) + len(kp) + len(vp) <= L
        tokens += kp + vp
        targets += [IGNORE_INDEX] * len(kp) + list(vp)
        return tokens, targets

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        _check_no_options(self.name, kw)
        rng = np.random.default_rng(numpy_seed(g))
        L = self.seq_len + 1
        tok = np.full((n, L), self.pad_id, dtype=np.int64)
        tgt = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
        train = split == "train"
        for i in range(n):
            t, y = self._one(rng, train)
            tok[i, L - len(t) :] = t
            tgt[i, L - len(y) :] = t if (train and self.train_on_all_tokens) else y
        tok_t, tgt_t = torch.from_numpy(tok), torch.from_numpy(tgt)
        return {"input_ids": tok_t[:, :-1].contiguous(), "labels": tgt_t[:, 1:].contiguous()}


class SelectiveCopy(_MADTask):
    """`num_tokens_to_copy` content tokens scattered among blanks, then a copy token and
    blanks: at those final blanks the model must output the content tokens in order."""

    name = "selective_copy"

    def __init__(
        self,
        vocab_size: int = 16,
        seq_len: int = 256,
        num_tokens_to_copy: int = 16,
        num_train_examples: int | None = 12_800,
        seed: int = 0,
    ) -> None:
        super().__init__(seed, num_train_examples)
        self.vocab_size = check_int("vocab_size", vocab_size, 3)
        self.num_tokens_to_copy = check_int("num_tokens_to_copy", num_tokens_to_copy, 1)
        self.seq_len = check_int("seq_len", seq_len, 2 * num_tokens_to_copy + 2)
        self.copy_id, self.blank_id = vocab_size - 1, vocab_size - 2
        self.chance = 1.0 / (vocab_size - 2)

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        _check_no_options(self.name, kw)
        m, T = self.num_tokens_to_copy, self.seq_len
        region = T - m - 1
        content = torch.randint(0, self.vocab_size - 2, (n, m), generator=g)
        pos = torch.rand(n, region, generator=g).topk(m, dim=1).indices.sort(dim=1).values
        input_ids = torch.full((n, T), self.blank_id, dtype=torch.long)
        input_ids.scatter_(1, pos, content)
        input_ids[:, region] = self.copy_id
        labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
        labels[:, T - m :] = content
        return {"input_ids": input_ids, "labels": labels}


class Compress(_MADTask):
    """Causal-LM version of MAD's compression task: `seq_len/2` random tokens, then the
    compress token repeated `seq_len/2` times; the i-th compress token must output the i-th
    token. A recurrent model has to squeeze the whole prefix into its state (MAD instead
    encodes the prefix into one vector and decodes it with an MLP)."""

    name = "compress"

    def __init__(
        self,
        vocab_size: int = 16,
        seq_len: int = 64,
        num_train_examples: int | None = 12_800,
        seed: int = 0,
    ) -> None:
        super().__init__(seed, num_train_examples)
        self.vocab_size = check_int("vocab_size", vocab_size, 3)
        self.seq_len = check_int("seq_len", seq_len, 4)
        if seq_len % 2:
            raise ValueError(f"seq_len must be even (prefix + reconstruction), got {seq_len}")
        self.compress_id = vocab_size - 1
        self.chance = 1.0 / (vocab_size - 1)

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        _check_no_options(self.name, kw)
        m = self.seq_len // 2
        content = torch.randint(0, self.vocab_size - 1, (n, m), generator=g)
        input_ids = torch.full((n, 2 * m), self.compress_id, dtype=torch.long)
        input_ids[:, :m] = content
        labels = torch.full((n, 2 * m), IGNORE_INDEX, dtype=torch.long)
        labels[:, m:] = content
        return {"input_ids": input_ids, "labels": labels}


class Memorize(_MADTask):
    """`key insert key insert ...`: at each insert token output the key's value under a fixed
    map (drawn once from the task seed). Values never appear in the input, so the map must be
    stored in the weights; the test set uses the same map with fresh keys."""

    name = "memorize"

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 32,
        num_train_examples: int | None = 256,
        seed: int = 0,
    ) -> None:
        super().__init__(seed, num_train_examples)
        self.vocab_size = check_int("vocab_size", vocab_size, 4)
        self.seq_len = check_int("seq_len", seq_len, 2)
        if seq_len % 2:
            raise ValueError(f"seq_len must be even (key, insert pairs), got {seq_len}")
        self.insert_id = vocab_size - 1
        plain = vocab_size - 1
        self.num_keys = plain // 2
        self.num_values = plain - self.num_keys
        g = self._generator("kv_map")
        self.kv_map = torch.randperm(self.num_values, generator=g)[: self.num_keys] + self.num_keys
        self.chance = 1.0 / self.num_values

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        _check_no_options(self.name, kw)
        P = self.seq_len // 2
        keys = torch.randint(0, self.num_keys, (n, P), generator=g)
        input_ids = torch.stack([keys, torch.full_like(keys, self.insert_id)], 2).reshape(n, -1)
        labels = torch.stack([torch.full_like(keys, IGNORE_INDEX), self.kv_map[keys]], 2)
        return {"input_ids": input_ids, "labels": labels.reshape(n, -1)}


MAD_TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (InContextRecall, FuzzyRecall, NoisyRecall, SelectiveCopy, Compress, Memorize)
}
