"""The lean key side split over key blocks (``gradients_lean.key_blocks``: rules whose erase
strength ignores λ, half precision) against the float64 reference and against the unsplit key
side: dq, dk, dv bitwise (each key column's sums are the same), dβ and d log α up to the order of
their fp32 row sums (summed per block, then over blocks). On the interpreter the blocks are 32
key columns of 64 (``K_SPLIT_BK`` 32: the interpreter's half kernels hold 64-column blocks and
128 would be slow), on a GPU the default's 64 of 128."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, rel_err

from deltaflow.rules import RULES, triton_rules

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from test_grads_variants import NAMES, _fwd_bwd  # noqa: E402

from deltaflow.ops.triton import gradients, gradients_lean  # noqa: E402 - after the skip
from deltaflow.ops.triton import rules as rule_table  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
HALF = torch.bfloat16 if GPU else torch.float16  # the interpreter's bf16 tl.dot is wrong
# (K_SPLIT_BK, key head): on a GPU the default's blocks (32 columns miscompile there: session
# 26, call 3), on the interpreter 32
SPLITS = [(64, 128)] if GPU else [(32, 64)]
pytestmark = pytest.mark.usefixtures("narrow_half_kernels")  # 24-48-column value heads in half


@pytest.fixture(params=SPLITS, ids=lambda s: f"bk{s[0]}")
def split(request, monkeypatch) -> tuple[int, list[int]]:
    """The lean kernels on (the fused one off), K_SPLIT_BK as above: the key head to test and
    the key blocks of each lean launch, which the tests check."""
    bk, dk = request.param
    monkeypatch.setattr(gradients, "GRADS_LEAN", "on")
    monkeypatch.setattr(gradients, "GRADS_FUSED", "off")
    monkeypatch.setattr(gradients_lean, "K_SPLIT_BK", bk)
    seen: list[int] = []
    key_blocks = gradients_lean.key_blocks

    def counted(*args) -> int:
        seen.append(key_blocks(*args))
        return seen[-1]

    monkeypatch.setattr(gradients_lean, "key_blocks", counted)
    return dk, seen


def _inputs(rule: str, T: int, Dk: int, Dv: int, seed: int, **kwargs) -> dict:
    inputs = make_inputs(1, T, 2, Dk, Dv, rule=rule, dtype=torch.float32, seed=seed, **kwargs)
    inputs = {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}
    for n in ("q", "k", "v"):
        inputs[n] = inputs[n].to(HALF)
    if not RULES[rule].needs_beta:
        inputs["beta"] = None
    return inputs


def _check(inputs: dict, seen: list[int], monkeypatch, nk: int, **kwargs) -> None:
    """Split against float64 (the half tolerance of tests/test_grads_variants.py) and against
    the unsplit key side (K_SPLIT_BK 0) on the same inputs."""
    ref = _fwd_bwd({n: None if t is None else t.double() for n, t in inputs.items()},
                   "reference", **kwargs)  # fmt: skip
    split = _fwd_bwd(inputs, "triton", **kwargs)
    assert seen == [nk], seen
    monkeypatch.setattr(gradients_lean, "K_SPLIT_BK", 0)
    whole = _fwd_bwd(inputs, "triton", **kwargs)
    assert seen == [nk, 1], seen
    for name, s, w, r in zip(NAMES, split, whole, ref):
        assert (s is None) == (w is None) == (r is None), name
        if s is None:
            continue
        assert torch.isfinite(s).all() and rel_err(s, r) <= 1e-2, f"{name}: {rel_err(s, r):.2e}"
        if name in ("beta", "log_decay"):  # fp32 row sums: per block, then over blocks
            assert rel_err(s, w) <= 1e-5, f"{name}: {rel_err(s, w):.2e}"
        else:
            assert torch.equal(s, w), name


@pytest.mark.parametrize(
    "rule, negative_eigenvalues, decay, state",
    [("delta", False, True, True), ("delta", True, True, False), ("linear", False, False, True)],
)
def test_split_rules(split, monkeypatch, rule, negative_eigenvalues, decay, state):
    # T = 130: two full chunks and a two-token one; the value side wider than one block
    dk, seen = split
    inputs = _inputs(rule, 130, dk, 48, seed=41, decay=decay, initial_state=state)
    _check(inputs, seen, monkeypatch, dk // gradients_lean.K_SPLIT_BK, rule=rule,
           negative_eigenvalues=negative_eigenvalues)  # fmt: skip


def test_split_packed_and_ragged(split, monkeypatch):
    # unequal lengths with empty and one-token sequences, and a key head no block count fits
    # (the last block masked: 3/4 of the head, e.g. 1.5 blocks of 64 columns)
    dk, seen = split
    lengths = [5, 64, 0, 70, 1]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(DEVICE)
    inputs = _inputs("delta", sum(lengths), dk * 3 // 4, 40, seed=42, n_states=len(lengths))
    nk = -(-dk * 3 // 4 // gradients_lean.K_SPLIT_BK)
    _check(inputs, seen, monkeypatch, nk, rule="delta", cu_seqlens=cu)


def test_t_equals_one(split, monkeypatch):
    dk, seen = split
    inputs = _inputs("delta", 1, dk, 24, seed=43, decay=True)
    _check(inputs, seen, monkeypatch, dk // gradients_lean.K_SPLIT_BK, rule="delta")


@pytest.mark.parametrize("rule", triton_rules())
def test_which_launches_split(monkeypatch, rule):
    # the rules of rule_table.ERASE_FREE_OF_NORM in half precision, over as many blocks as the
    # key head needs; never fp32, never another rule, never with the setting 0
    kid = RULES[rule].kernel_id
    free = kid in rule_table.ERASE_FREE_OF_NORM
    assert gradients_lean.key_blocks(128, torch.bfloat16, kid) == (2 if free else 1)
    assert gradients_lean.key_blocks(100, torch.float16, kid) == (2 if free else 1)
    assert gradients_lean.key_blocks(256, torch.bfloat16, kid) == (4 if free else 1)
    assert gradients_lean.key_blocks(128, torch.float32, kid) == 1
    monkeypatch.setattr(gradients_lean, "K_SPLIT_BK", 0)
    assert gradients_lean.key_blocks(128, torch.bfloat16, kid) == 1


@pytest.mark.parametrize("nk", [2, 3, 4])
@pytest.mark.parametrize("which", ["both", "dbeta_ptr", "dg_ptr"])
def test_sum_parts_kernel(nk, which):
    """The split's dβ and d log α parts summed in one launch (``sum_parts``) are the torch sum's
    bit for bit: the same block order in fp32, one rounding into the output's dtype (bf16 and
    fp32 outputs, a size no launch block divides, infinities and NaN carried; fp16 for bf16 on
    the interpreter, whose bf16 cast truncates)."""
    g = torch.Generator().manual_seed(nk)
    names = ["dbeta_ptr", "dg_ptr"] if which == "both" else [which]
    parts, outs, want = {}, {}, {}
    for name, dtype in zip(names, (HALF, torch.float32)):
        part = (torch.randn(nk, 3, 1001, 2, generator=g) * 10).to(DEVICE)
        part[0, 0, 5, 0], part[nk - 1, 2, 7, 1] = float("inf"), float("nan")
        parts[name] = part
        outs[name] = torch.full((3, 1001, 2), -7.0, device=DEVICE, dtype=dtype)
        total = part[0]
        for i in range(1, nk - 1):
            total = total + part[i]
        want[name] = torch.add(total, part[nk - 1]).to(dtype)
    gradients_lean.sum_parts(parts, outs)
    for name in names:
        torch.testing.assert_close(outs[name], want[name], rtol=0, atol=0, equal_nan=True)
