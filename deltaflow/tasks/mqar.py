"""Multi-query associative recall (MQAR), following the conventions of Zoology (Arora et al.).

Layout of one example (seq_len T, P key-value pairs, vocab V):

    [k1 v1 k2 v2 ... kP vP | fill ... kj fill ... ki fill ...]
     context: 2P tokens      queries: each key once, at even offsets, power-law gaps

- keys are distinct draws from [1, V/2) (0 marks "no query" before filling), values distinct
  draws from [V/2, V);
- query i sits at offset 2*g_i of the query region, with the offsets g drawn without
  replacement from p(g) ∝ a * g^(a-1), g = 1..(T-2P)/2 (power_a = a = 0.01: short gaps
  are much more likely, like repeated bigrams in text);
- every other query-region token is a random token from the whole vocabulary
  (`random_non_queries=True`);
- the model must output the bound value at the query key's position; only those positions
  are scored (labels -100 elsewhere);
- ``num_train_examples=N``: a fixed training set of N examples, as Zoology's (100,000);
  default None, a fresh example every step.

Re-binding (``bindings_per_key = R > 1``, not in Zoology): the context holds R rounds of the P
pairs, each round the P keys in a fresh random order bound to fresh values (all P*R values of
an example distinct), and a query asks for the key's value in the *last* round. An additive
memory (linear attention) holds the sum of all R bindings of a key and cannot tell the latest
one apart; an overwriting memory (DeltaNet, β → 1: ``S ← S − k kᵀS + k vᵀ``) keeps only the
latest. This is the setting where the delta rule's erase step is the whole difference.
"""

from __future__ import annotations

import torch

from deltaflow.tasks.base import IGNORE_INDEX, Batch, Task, check_float, check_int
from deltaflow.validation import check_bool

# (seq_len, num_kv_pairs) settings of the Zoology sweep used here (vocab 8192).
PRESETS: tuple[tuple[int, int], ...] = ((64, 4), (128, 8), (256, 16), (512, 64))


class MQAR(Task):
    name = "mqar"
    default_eval_examples = 1024

    def __init__(
        self,
        seq_len: int = 256,
        num_kv_pairs: int = 16,
        vocab_size: int = 8192,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        bindings_per_key: int = 1,
        score_rebinds: bool = True,
        num_train_examples: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        # None: a fresh example every training step. A number: a fixed training set of that
        # many examples (Zoology trains on 100,000), drawn once from the seed; batches sample it
        if num_train_examples is not None:
            check_int("num_train_examples", num_train_examples, 1)
        self.num_train_examples = num_train_examples
        self.seq_len = check_int("seq_len", seq_len, 4)
        if seq_len % 2:
            raise ValueError(f"seq_len must be even (key-value pairs are 2 tokens), got {seq_len}")
        self.num_kv_pairs = check_int("num_kv_pairs", num_kv_pairs, 1)
        self.bindings_per_key = R = check_int("bindings_per_key", bindings_per_key, 1)
        P = num_kv_pairs
        if 2 * P * R + 2 * P > seq_len:
            raise ValueError(
                f"num_kv_pairs={P} with bindings_per_key={R} needs seq_len >= "
                f"{2 * P * R + 2 * P} (2*P*R context tokens + 2P query slots), got "
                f"seq_len={seq_len}"
            )
        self.vocab_size = check_int("vocab_size", vocab_size, 4)
        half = vocab_size // 2
        if num_kv_pairs > half - 1:
            raise ValueError(
                f"num_kv_pairs={num_kv_pairs} needs at least as many keys: vocab_size // 2 - 1 "
                f"= {half - 1}"
            )
        if P * R > vocab_size - half:
            raise ValueError(
                f"num_kv_pairs * bindings_per_key = {P * R} distinct values need "
                f"vocab_size - vocab_size // 2 >= {P * R}, got {vocab_size - half}"
            )
        self.score_rebinds = check_bool("score_rebinds", score_rebinds)
        self.power_a = check_float("power_a", power_a, 1e-6, 1.0)
        self.random_non_queries = check_bool("random_non_queries", random_non_queries)
        self.chance = 1.0 / (vocab_size - half)
        # log of the (unnormalised) power-law weights over query gaps 1..space
        space = (seq_len - 2 * P * R) // 2
        gaps = torch.arange(1, space + 1, dtype=torch.float64)
        self._log_p = ((power_a - 1.0) * gaps.log()).float()

    def _sample(self, n: int, g: torch.Generator, split: str, **kw) -> Batch:
        if kw:
            raise TypeError(f"mqar takes no evaluation options, got {sorted(kw)}")
        V, T, P, R = self.vocab_size, self.seq_len, self.num_kv_pairs, self.bindings_per_key
        half = V // 2
        # distinct keys / values per example: the top-P of iid uniforms is a uniform P-subset
        keys = torch.rand(n, half - 1, generator=g).topk(P, dim=1).indices + 1
        values = torch.rand(n, V - half, generator=g).topk(P * R, dim=1).indices + half

        # query gaps without replacement, p ∝ g^(a-1): Gumbel top-k == sequential sampling
        u = torch.rand(n, self._log_p.numel(), generator=g).clamp_(1e-12, 1.0 - 1e-7)
        gaps = (self._log_p - torch.log(-torch.log(u))).topk(P, dim=1).indices

        input_ids = torch.zeros(n, T, dtype=torch.long)
        if R == 1:  # Zoology's layout (and its random stream, so old results reproduce)
            input_ids[:, 0 : 2 * P : 2] = keys
            input_ids[:, 1 : 2 * P : 2] = values
            latest = values
        else:
            # round r binds key i to values[:, r, i]; its pairs appear in a fresh random order
            values = values.view(n, R, P)
            labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
            for r in range(R):
                order = torch.rand(n, P, generator=g).argsort(dim=1)
                start = 2 * P * r
                input_ids[:, start : start + 2 * P : 2] = keys.gather(1, order)
                input_ids[:, start + 1 : start + 2 * P : 2] = values[:, r].gather(1, order)
                if r > 0 and self.score_rebinds:  # a re-bound key is first a query of its binding
                    labels[:, start : start + 2 * P : 2] = values[:, r - 1].gather(1, order)
            latest = values[:, -1]  # only the last binding counts
        qpos = 2 * P * R + 2 * gaps
        input_ids.scatter_(1, qpos, keys)
        if R == 1:
            labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
        labels.scatter_(1, qpos, latest)
        if self.random_non_queries:
            fill = torch.randint(0, V, (n, T), generator=g)
            input_ids = torch.where(input_ids == 0, fill, input_ids)
        return {"input_ids": input_ids, "labels": labels}

    @classmethod
    def presets(cls, vocab_size: int = 8192, seed: int = 0) -> list[MQAR]:
        """The four (seq_len, num_kv_pairs) settings of the sweep."""
        return [cls(T, P, vocab_size=vocab_size, seed=seed) for T, P in PRESETS]
