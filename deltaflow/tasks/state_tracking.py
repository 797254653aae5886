"""State-tracking tasks of "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues" (Grazzi et al., arXiv 2411.12537): parity, modular arithmetic without and with
brackets (mod 5), and the S5 word problem.

Protocol (the paper's): train on lengths 3-40, evaluate on lengths 40-256, report scaled
accuracy (acc - chance) / (1 - chance). A sequence of length L is L input tokens; shorter
sequences in a batch are right-padded with PAD (id 0) and labelled -100.

Labels follow the paper's code (the xLSTM formal-language generators it builds on):
- parity and modular arithmetic: one label per sequence, the answer, at the last input token
  (the last bit, or the '=' token). `label_every_token=True` makes parity label every prefix
  with its running parity instead.
- S5 (Merrill et al., "The Illusion of State"): every position is labelled with the running
  product of the permutations so far.
Length here counts the tokens the model reads; the xLSTM code's `sequence_length` also
counts the answer slot, so its lengths are ours + 1.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import numpy as np
import torch

from deltaflow.tasks.base import IGNORE_INDEX, Batch, Task, check_int, numpy_seed
from deltaflow.validation import check_bool

PAD = 0


UNIFORM = "uniform"  # eval_lengths="uniform": every valid length in [eval_min_len, eval_max_len]


class StateTrackingTask(Task):
    """Shared length handling. `get_batch` draws lengths uniformly in [min_len, max_len]
    (padded to max_len); `eval_batches(split, length=L)` gives sequences of exactly L tokens,
    `length=None` lengths uniform in [eval_min_len, eval_max_len] padded to eval_max_len.

    `eval_lengths` are the lengths the trainer evaluates at; its headline metric is their
    mean. The default (40, 64, 128, 256) weighs those four equally, which is not the paper's
    test distribution (uniform over lengths 40-256: it weighs long sequences far more).
    ``eval_lengths="uniform"`` lists every length in [eval_min_len, eval_max_len] the task can
    express (mod_arith: the even ones), so the headline is the paper's metric, stratified: the
    same number of examples at every length (issue 24); the per-length numbers stay in the
    log (``scaled_accuracy@64``, ...)."""

    default_eval_examples = 1024
    min_length: ClassVar[int] = 2  # shortest sequence the task can express

    def __init__(
        self,
        min_len: int = 3,
        max_len: int = 40,
        eval_min_len: int = 40,
        eval_max_len: int = 256,
        eval_lengths: tuple[int, ...] | str = (40, 64, 128, 256),
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.min_len = check_int("min_len", min_len, self.min_length)
        self.max_len = check_int("max_len", max_len, min_len)
        self.eval_min_len = check_int("eval_min_len", eval_min_len, self.min_length)
        self.eval_max_len = check_int("eval_max_len", eval_max_len, eval_min_len)
        if isinstance(eval_lengths, str):
            if eval_lengths != UNIFORM:
                raise ValueError(
                    f"eval_lengths must be a list of lengths or {UNIFORM!r}, got {eval_lengths!r}"
                )
            eval_lengths = self.valid_lengths(self.eval_min_len, self.eval_max_len)
            if not eval_lengths:
                raise ValueError(
                    f"no length in [eval_min_len, eval_max_len] = [{self.eval_min_len}, "
                    f"{self.eval_max_len}] is valid for {self.name}"
                )
        self.eval_lengths = [check_int("eval_lengths[i]", L, self.min_length) for L in eval_lengths]
        self.seq_len = self.max_len

    @classmethod
    def valid_lengths(cls, lo: int, hi: int) -> list[int]:
        """The lengths in [lo, hi] a sequence of this task can have."""
        return list(range(max(lo, cls.min_length), hi + 1))

    def _lengths(self, n: int, g: torch.Generator, lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, (n,), generator=g)

    def _sample(
        self,
        n: int,
        g: torch.Generator,
        split: str,
        length: int | None = None,
        length_range: tuple[int, int] | None = None,
    ) -> Batch:
        if length is not None:
            lengths, T = torch.full((n,), length, dtype=torch.long), length
        else:
            lo, hi = length_range if length_range is not None else (self.min_len, self.max_len)
            lengths, T = self._lengths(n, g, lo, hi), hi
        return self._generate(lengths, T, g)

    def eval_set(
        self, split: str = "valid", num_examples: int | None = None, length: int | None = None
    ) -> Batch:
        """Evaluation set at exactly `length` tokens, or (None) at lengths drawn uniformly in
        [eval_min_len, eval_max_len], padded to eval_max_len."""
        if length is None:
            return super().eval_set(
                split, num_examples, length_range=(self.eval_min_len, self.eval_max_len)
            )
        self._check_length("length", length)
        return super().eval_set(split, num_examples, length=length)

    def _check_length(self, name: str, length: int) -> int:
        return check_int(name, length, self.min_length)

    def _generate(self, lengths: torch.Tensor, T: int, g: torch.Generator) -> Batch:
        raise NotImplementedError

    @staticmethod
    def _valid(lengths: torch.Tensor, T: int) -> torch.Tensor:
        return torch.arange(T)[None, :] < lengths[:, None]


class Parity(StateTrackingTask):
    """Bits as tokens 1 (zero) and 2 (one); the answer is the bit token of the parity."""

    name = "parity"

    def __init__(self, *, label_every_token: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.label_every_token = check_bool("label_every_token", label_every_token)
        self.vocab_size = 3
        self.chance = 0.5

    def _generate(self, lengths: torch.Tensor, T: int, g: torch.Generator) -> Batch:
        n = lengths.numel()
        bits = torch.randint(0, 2, (n, T), generator=g)
        valid = self._valid(lengths, T)
        bits = bits * valid
        running = (bits.cumsum(1) % 2) + 1
        input_ids = torch.where(valid, bits + 1, PAD)
        if self.label_every_token:
            labels = torch.where(valid, running, IGNORE_INDEX)
        else:
            labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
            last = (lengths - 1)[:, None]
            labels.scatter_(1, last, running.gather(1, last))
        return {"input_ids": input_ids, "labels": labels}


class ModularArithmetic(StateTrackingTask):
    """`n op n op ... n =` with ops + - * (usual precedence: * first), numbers 0..m-1, the
    answer is the value mod m. Even lengths only (k numbers, k-1 ops, '='); odd lengths drawn
    for training are rounded down. Tokens: PAD 0, + 1, - 2, * 3, = 4, number v is 5 + v."""

    name = "mod_arith"
    min_length = 4
    OPS = {"+": 1, "-": 2, "*": 3}
    EQ = 4
    NUM0 = 5

    def __init__(self, *, modulus: int = 5, ops: str = "+-*", min_len: int = 4, **kw) -> None:
        super().__init__(min_len=min_len, **kw)
        self.modulus = check_int("modulus", modulus, 2)
        if not ops or set(ops) - set(self.OPS) or len(set(ops)) != len(ops):
            raise ValueError(f"ops must be distinct characters from '+-*', got {ops!r}")
        self.op_ids = torch.tensor([self.OPS[o] for o in ops])
        self.vocab_size = self.NUM0 + modulus
        self.chance = 1.0 / modulus
        for L in self.eval_lengths:
            self._check_length("eval_lengths[i]", L)

    @classmethod
    def valid_lengths(cls, lo: int, hi: int) -> list[int]:
        return [L for L in super().valid_lengths(lo, hi) if L % 2 == 0]

    def _check_length(self, name: str, length: int) -> int:
        check_int(name, length, self.min_length)
        if length % 2:
            raise ValueError(f"{name} must be even for mod_arith (n op ... n =), got {length}")
        return length

    def _generate(self, lengths: torch.Tensor, T: int, g: torch.Generator) -> Batch:
        n, m = lengths.numel(), self.modulus
        k = (lengths // 2).clamp_min(2)  # numbers per sequence
        lengths = 2 * k
        nums = torch.randint(0, m, (n, T // 2), generator=g)
        ops = self.op_ids[torch.randint(0, len(self.op_ids), (n, T // 2), generator=g)]
        # evaluate left to right with precedence: total + sign * (running product term)
        total = torch.zeros(n, dtype=torch.long)
        term = nums[:, 0].clone()
        sign = torch.ones(n, dtype=torch.long)
        for i in range(1, int(k.max())):
            live = i < k
            op, x = ops[:, i - 1], nums[:, i]
            mul = live & (op == self.OPS["*"])
            new = live & ~mul
            total = torch.where(new, (total + sign * term) % m, total)
            sign = torch.where(new, torch.where(op == self.OPS["-"], -1, 1), sign)
            term = torch.where(mul, term * x % m, torch.where(new, x, term))
        answer = (total + sign * term) % m

        pos = torch.arange(T)[None, :]
        idx = (pos // 2).clamp_max(T // 2 - 1).expand(n, T)
        input_ids = torch.where(pos % 2 == 0, nums.gather(1, idx) + self.NUM0, ops.gather(1, idx))
        input_ids = torch.where(pos == (lengths - 1)[:, None], self.EQ, input_ids)
        input_ids = torch.where(pos < lengths[:, None], input_ids, PAD)
        labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
        labels.scatter_(1, (lengths - 1)[:, None], (answer + self.NUM0)[:, None])
        return {"input_ids": input_ids, "labels": labels}


class ModularArithmeticBrackets(StateTrackingTask):
    """Fully bracketed expressions such as `((3+-2)-(4))=` of exactly L tokens (the
    expression is L - 1 tokens), value mod m. Subexpressions of 1-4 tokens are `n`, `-n`,
    `(n)`, `(-n)`; longer ones are `(left op right)` with a random split. Ops + and -
    (`mult=True` adds *). Tokens: PAD 0, + 1, - 2, * 3, ( 4, ) 5, = 6, number v is 7 + v."""

    name = "mod_arith_brackets"
    min_length = 3
    PLUS, MINUS, TIMES, LPAR, RPAR, EQ, NUM0 = 1, 2, 3, 4, 5, 6, 7

    def __init__(self, *, modulus: int = 5, mult: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.modulus = check_int("modulus", modulus, 2)
        self.mult = check_bool("mult", mult)
        self.vocab_size = self.NUM0 + modulus
        self.chance = 1.0 / modulus

    def _expr(self, size: int, rng: np.random.Generator, out: list[int]) -> int:
        """Append an expression of exactly `size` tokens to `out`; return its value mod m."""
        m = self.modulus
        if size <= 4:
            v = int(rng.integers(m))
            neg = size in (2, 4)
            body = [self.MINUS, self.NUM0 + v] if neg else [self.NUM0 + v]
            out += [self.LPAR, *body, self.RPAR] if size >= 3 else body
            return (-v) % m if neg else v
        left = int(rng.integers(1, size - 3))  # size - 3 tokens for the operands
        out.append(self.LPAR)
        a = self._expr(left, rng, out)
        op = int(rng.integers(3 if self.mult else 2))
        out.append((self.PLUS, self.MINUS, self.TIMES)[op])
        b = self._expr(size - 3 - left, rng, out)
        out.append(self.RPAR)
        return ((a + b) if op == 0 else (a - b) if op == 1 else (a * b)) % m

    def _generate(self, lengths: torch.Tensor, T: int, g: torch.Generator) -> Batch:
        rng = np.random.default_rng(numpy_seed(g))
        n = lengths.numel()
        input_ids = torch.full((n, T), PAD, dtype=torch.long)
        labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
        for i, L in enumerate(lengths.tolist()):
            toks: list[int] = []
            value = self._expr(L - 1, rng, toks)
            toks.append(self.EQ)
            input_ids[i, :L] = torch.tensor(toks)
            labels[i, L - 1] = self.NUM0 + value
        return {"input_ids": input_ids, "labels": labels}


class S5(StateTrackingTask):
    """The S5 word problem: tokens are the 120 permutations of 5 elements (id 1 + index in
    lexicographic order); position t is labelled with the product p_t = g_t ∘ p_{t-1}
    (apply p_{t-1} first, as arrays p_t[i] = g_t[p_{t-1}[i]]), p_0 = identity."""

    name = "s5"

    def __init__(self, *, label_every_token: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.label_every_token = check_bool("label_every_token", label_every_token)
        self.perms = torch.tensor(list(itertools.permutations(range(5))))  # [120, 5]
        index = {tuple(p): i for i, p in enumerate(self.perms.tolist())}
        # table[a, b] = index of g_a ∘ g_b (b first)
        self.table = torch.tensor(
            [
                [index[tuple(pa[j] for j in pb)] for pb in self.perms.tolist()]
                for pa in self.perms.tolist()
            ]
        )
        self.vocab_size = 1 + len(self.perms)
        self.chance = 1.0 / len(self.perms)

    def _generate(self, lengths: torch.Tensor, T: int, g: torch.Generator) -> Batch:
        n = lengths.numel()
        elems = torch.randint(0, len(self.perms), (n, T), generator=g)
        prods = torch.empty_like(elems)
        prods[:, 0] = elems[:, 0]
        for t in range(1, T):
            prods[:, t] = self.table[elems[:, t], prods[:, t - 1]]
        valid = self._valid(lengths, T)
        input_ids = torch.where(valid, elems + 1, PAD)
        if self.label_every_token:
            labels = torch.where(valid, prods + 1, IGNORE_INDEX)
        else:
            labels = torch.full((n, T), IGNORE_INDEX, dtype=torch.long)
            last = (lengths - 1)[:, None]
            labels.scatter_(1, last, prods.gather(1, last) + 1)
        return {"input_ids": input_ids, "labels": labels}


STATE_TRACKING_TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (Parity, ModularArithmetic, ModularArithmeticBrackets, S5)
}
