"""The segmented state passes (issue 32) made safe under CUDA graphs and cheap on the host
(benchmarks/NOTES.md, "Issue 32, session 18"): the one-launch chain across segments
(``deltaflow/ops/triton/segment_chain.py``) against ``segments.chain``, the dense batches' segment
tables built from shapes on the device (equal to the host build, no host sync, built once per
shape), and the cache that a CUDA-graph capture finds warm (``common.GraphSafeCache``). On the
CPU interpreter; the compiled ``mode="reduce-overhead"`` check runs where there is a GPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _inputs import make_inputs, reduce_overhead_grads, rel_err
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from deltaflow import delta_rule

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from deltaflow.ops.segments import chain  # noqa: E402
from deltaflow.ops.triton import common, segment_chain, segment_states  # noqa: E402
from deltaflow.ops.triton.common import CHUNK, GraphSafeCache, chunk_tables  # noqa: E402
from deltaflow.ops.triton.segment_states import (  # noqa: E402
    build_dense_segment_tables,
    build_segment_tables,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
C = CHUNK.value


def _poisoned(*shape: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer of NaN: an entry the chain forgot to write shows."""
    return torch.full(shape, float("nan"), device=like.device, dtype=dtype)


# ---------------------------------------------------------------------------- the chain
# Every (outer, reverse) specialization (constexprs of the kernel) at the small shapes; the two
# wide ones (the widest key tile, CHAIN_MAX_DK; the longest chain) each direction once, one with
# an outer state and one without: their size is what they add.
CHAIN_CASES = [
    (R, Dk, Dv, outer, reverse)
    for R, Dk, Dv in [(1, 16, 16), (2, 16, 24), (3, 24, 40), (5, 32, 16)]
    for outer in (False, True)
    for reverse in (False, True)
] + [(2, 128, 128, False, True), (2, 128, 128, True, False), (9, 64, 128, True, True),
     (9, 64, 128, False, False)]  # fmt: skip


@pytest.mark.parametrize("R, Dk, Dv, outer, reverse", CHAIN_CASES)
def test_triton_chain_matches_segments_chain(R, Dk, Dv, outer, reverse):
    # R segments a sequence (R − 1 chain rows: R = 1 has none) for N = 2 sequences of H = 3
    # heads; random [P | S] of norm ~1 a step, so a wrong row or order shows at once
    N, H = 2, 3
    g = torch.Generator().manual_seed(R * 100 + Dk)
    trans = torch.randn(R - 1, N, H, Dk, Dk + Dv, generator=g) / Dk**0.5
    x0 = torch.randn(N, H, Dk, Dv, generator=g) if outer else None
    trans, x0 = (None if t is None else t.to(DEVICE) for t in (trans, x0))
    first = torch.arange(N, device=DEVICE) * R
    last = first + R - 1
    # segment first + r is chain position r forward, R − 1 − r in reverse: row position·N + n
    position = [R - 1 - r if reverse else r for r in range(R)]
    rows = torch.tensor([p * N + n for n in range(N) for p in position], device=DEVICE)
    got = segment_chain.chain_segments(
        trans, x0, first=first, last=last, rows=rows, reverse=reverse, output=_poisoned
    )
    X = chain(trans.double())  # the one definition of the math, in float64
    if x0 is not None:
        X[0] = x0.double()
    want = X.flatten(0, 1)[rows]
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-6, rel_err(got, want)
    # the torch fallback is the same function
    fallback = segment_chain.torch_chain(trans, x0, rows)
    assert rel_err(fallback, want) <= 1e-6


def test_triton_chain_with_unequal_segment_counts():
    # packed sequences: 1, 4, 0 (empty: one segment), 2 and 3 segments; the chain rows a
    # sequence does not have hold NaN, which the kernel must never read
    lengths = [40, 4 * C, 0, 2 * C - 1, 2 * C + 1]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    tables = chunk_tables(torch.tensor(cu, device=DEVICE), 1, cu[-1], DEVICE)
    seg = build_segment_tables(cu, 1, tables, DEVICE)
    N, H, Dk, Dv = len(lengths), 2, 16, 24
    g = torch.Generator().manual_seed(7)
    trans = torch.randn(seg.slots, N, H, Dk, Dk + Dv, generator=g) / 4
    R = (seg.last - seg.first + 1).tolist()
    for n in range(N):
        trans[R[n] - 1 :, n] = float("nan")
    trans = trans.to(DEVICE)
    x0 = torch.randn(N, H, Dk, Dv, generator=g).to(DEVICE)
    for reverse, rows in ((False, seg.fwd_row), (True, seg.rev_row)):
        got = segment_chain.chain_segments(
            trans, x0, first=seg.first, last=seg.last, rows=rows, reverse=reverse, output=_poisoned
        )
        want = segment_chain.torch_chain(trans, x0, rows)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-6


def test_chain_switch(monkeypatch):
    # SEGMENT_CHAIN picks the form; a bad value is refused by name; key heads wider than the
    # kernel's tile take the torch form
    calls: list[str] = []
    real = segment_chain.torch_chain
    monkeypatch.setattr(segment_chain, "torch_chain", lambda *a: calls.append("torch") or real(*a))
    trans = torch.randn(1, 1, 1, 16, 32, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    args = dict(first=one, last=one + 1, rows=torch.tensor([0, 1], device=DEVICE), reverse=False)
    segment_chain.chain_segments(trans, None, output=_poisoned, **args)
    assert calls == []
    monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", "torch")
    segment_chain.chain_segments(trans, None, output=_poisoned, **args)
    assert calls == ["torch"]
    monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", "triton")
    monkeypatch.setattr(segment_chain, "CHAIN_MAX_DK", 8)
    segment_chain.chain_segments(trans, None, output=_poisoned, **args)
    assert calls == ["torch"] * 2
    monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", "scan")
    with pytest.raises(ValueError, match="must be 'triton' or 'torch'"):
        segment_chain.chain_segments(trans, None, output=_poisoned, **args)


# ---------------------------------------------------------------------------- dense tables
@pytest.mark.parametrize(
    "B, T, L",
    [(1, 64, 1), (2, 65, 1), (2, 200, 2), (3, 321, 2), (1, 130, 1), (2, 1000, 3), (2, 8192, 16)],
)
def test_dense_tables_equal_the_host_build(B, T, L):
    tables = chunk_tables(None, B, T, DEVICE)
    host = build_segment_tables([b * T for b in range(B + 1)], L, tables, DEVICE)
    dense = build_dense_segment_tables(B, T, L, tables, DEVICE)
    assert (dense.chunks, dense.slots) == (host.chunks, host.slots)
    for a, b in zip(pytree.tree_leaves(dense), pytree.tree_leaves(host)):
        if a is b:  # the chunk tables' own, shared: their placeholder is uninitialized (NaN at
            continue  # times, which torch.equal called unequal to itself: a flaky failure)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)
        else:
            assert a == b


class SyncWatch(TorchDispatchMode):
    """Every aten op dispatched inside, and those that make a GPU's host wait for it (the ops
    host_overhead.py's OpWatch lists: a scalar read, a data-dependent shape)."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops[name] += 1
        data_dependent = name == "repeat_interleave" and kwargs.get("output_size") is None
        if name in self.SYNCING or data_dependent:
            self.syncs[name] += 1
        return func(*args, **kwargs)


@pytest.fixture
def watch(monkeypatch) -> SyncWatch:
    """A :class:`SyncWatch` that also counts ``.tolist()``, ``.cpu()``, ``.numpy()`` and
    ``.item()`` (a CPU tensor's dispatch nothing, a GPU tensor's wait for the GPU)."""
    w = SyncWatch()
    for name in ("tolist", "cpu", "numpy", "item"):
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            w.syncs[_name] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return w


def _op_call(x: dict, cu: torch.Tensor | None):
    """(forward, backward) of the backend (no autograd, no input checks: what the custom ops'
    bodies run), delta with decay and an initial state."""
    kw = dict(beta=x["beta"], log_decay=x["log_decay"], initial_state=x["initial_state"])
    kw.update(cu_seqlens=cu, kernel_id=triton_backend.kernel_id_of("delta"))
    kw.update(negative_eigenvalues=False, eps=1e-6, scale=x["q"].shape[-1] ** -0.5)

    def forward():
        return triton_backend._forward(x["q"], x["k"], x["v"], **kw)

    def backward():
        grad_o = torch.ones_like(x["v"])
        return triton_backend._backward(
            x["q"], x["k"], x["v"], grad_o=grad_o, grad_state=None, **kw
        )

    return forward, backward


def _clear_caches(monkeypatch) -> None:
    monkeypatch.setattr(common, "_tables", type(common._tables)())
    monkeypatch.setattr(segment_states, "_segment_cache", type(segment_states._segment_cache)())
    monkeypatch.setattr(segment_states, "_dense_cache", GraphSafeCache(16))


def test_dense_path_makes_no_host_sync(monkeypatch, watch):
    # switch on, segments of one chunk: T = 130 is three segments a row. A cold call (every
    # cache empty) and a warm one, forward and backward: no sync at all. The torch chain cold
    # only: a warm call runs a subset of a cold one's ops (the tables' build skipped), which the
    # triton chain's warm call checks. One head: syncs do not depend on heads. Packed
    # sequences (a tables miss reads the offsets on the host) show that the watch sees syncs.
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    chains: list[str] = []
    real = segment_chain.chain_segments
    monkeypatch.setattr(
        segment_states,
        "chain_segments",
        lambda *a, **k: chains.append(segment_chain.SEGMENT_CHAIN) or real(*a, **k),
    )
    x = make_inputs(2, 130, 1, 16, 16, rule="delta", dtype=torch.float32, seed=1)
    x = {n: t.to(DEVICE) for n, t in x.items()}
    for form, calls in (("triton", 2), ("torch", 1)):  # cold, warm; cold
        monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", form)
        _clear_caches(monkeypatch)
        for _ in range(calls):
            for call in _op_call(x, None):
                with watch:
                    call()
    assert dict(watch.syncs) == {}
    assert chains == ["triton"] * 6 + ["torch"] * 3  # forward; backward: recompute, reverse

    _clear_caches(monkeypatch)
    cu = torch.tensor([0, 70, 200], device=DEVICE)
    packed = make_inputs(1, 200, 2, 16, 16, rule="delta", dtype=torch.float32, n_states=2)
    with watch:
        _op_call({n: t.to(DEVICE) for n, t in packed.items()}, cu)[0]()
    assert watch.syncs


def test_dense_tables_are_built_once_per_shape(monkeypatch):
    # The property that makes a capture safe: on a cache hit the segment path creates no tensor
    # (no aten op at all: no allocation, no copy from the host) and hands back the same tables.
    _clear_caches(monkeypatch)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    B, T, H, Dv = 2, 200, 2, 16
    first = triton_backend._segments(chunk_tables(None, B, T, DEVICE), B, T, False, H, Dv, 64)
    assert first is not None and first.slots == 3
    with SyncWatch() as w:
        tables = chunk_tables(None, B, T, DEVICE)
        again = triton_backend._segments(tables, B, T, False, H, Dv, 64)
    assert again is first and dict(w.ops) == {}
    # another chunk-tables object of the same shape (a capture builds its own): the same entry
    other = common.build_chunk_tables(None, B, T, DEVICE)
    assert triton_backend._segments(other, B, T, False, H, Dv, 64) is first
    # another shape or segment length: a new entry
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 2)
    assert triton_backend._segments(tables, B, T, False, H, Dv, 64) is not first


def test_graph_safe_cache_under_capture(monkeypatch):
    # GraphSafeCache with a CUDA device faked on the CPU: outside a capture a miss builds
    # through _outside_graph_pools (off the warming thread's pool); under a capture a hit is
    # pinned (never evicted: a graph replays reading it) and a miss builds in place, uncached.
    outside: list[object] = []
    monkeypatch.setattr(common, "_outside_graph_pools", lambda b, d: outside.append(d) or b())
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda")
    builds: Counter[str] = Counter()

    def build(key: str):
        def run():
            builds[key] += 1
            return (torch.zeros(1), key)

        return run

    cache = GraphSafeCache(2)
    a = cache.get("a", build("a"), cuda)  # warm-up: built outside the graph pools
    assert outside == [cuda] and builds == {"a": 1}
    capturing[0] = True
    assert cache.get("a", build("a"), cuda) is a  # capture: the warm-up's entry, nothing built
    assert "a" in cache.pinned and builds == {"a": 1}
    b = cache.get("b", build("b"), cuda)  # capture miss: built in the capture, not cached
    assert builds["b"] == 1 and "b" not in cache.lru and "b" not in cache.pinned
    assert len(outside) == 1
    capturing[0] = False
    for key in "cdef":  # more shapes than the LRU holds: the pinned entry stays
        cache.get(key, build(key), cuda)
    assert cache.get("a", build("a"), cuda) is a and builds["a"] == 1
    assert list(cache.lru) == ["e", "f"]
    assert cache.get("b", build("b"), cuda) is not b  # its capture copy was never cached


# ---------------------------------------------------------------------------- the whole op
def _fwd_bwd(inputs: dict, backend: str, **kwargs) -> list:
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in inputs.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kwargs)
    (o.sin().sum() + s.pow(2).sum()).backward()
    return [o, s] + [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def test_op_with_the_torch_chain_matches_the_reference(monkeypatch):
    # The torch chain (SEGMENT_CHAIN = "torch", the fallback) through the whole op: dense rows of
    # 4 segments (T = 193, segments of one chunk, the last of one token), and packed sequences of
    # 0 to 4 segments with initial states, against float64. The triton chain (the default) runs
    # the same checks in every test of tests/test_segment_states.py (dense rows of 4 segments,
    # T = 65 / 1 chunk: a last segment of one token, packed sequences of 0 to 4 segments).
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(segment_chain, "SEGMENT_CHAIN", "torch")
    dense = make_inputs(2, 193, 2, 16, 24, rule="delta", dtype=torch.float32, seed=11)
    lengths = [0, 5, 200, 1, 129]
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    packed = make_inputs(1, sum(lengths), 2, 16, 16, rule="efla", n_states=5, seed=12)
    for x, kw in ((dense, dict(rule="delta")), (packed, dict(rule="efla", cu_seqlens=cu))):
        x = {n: None if t is None else t.float().to(DEVICE) for n, t in x.items()}
        ref = _fwd_bwd(
            {n: None if t is None else t.double() for n, t in x.items()}, "reference", **kw
        )
        got = _fwd_bwd(x, "triton", **kw)
        for name, g, g_ref in zip(["o", "state", *NAMES], got, ref):
            assert torch.isfinite(g).all() and rel_err(g, g_ref) <= 1e-4, (name, rel_err(g, g_ref))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudagraph trees need a GPU")
def test_reduce_overhead_compile_with_segmented_passes(monkeypatch):
    # torch.compile(mode="reduce-overhead"): warm-up, capture, replays of a dense forward +
    # backward with the switch on. The capture finds the warm-up's segment tables (pinned, not
    # rebuilt: a host copy during capture would raise) and the gradients are eager's.
    _clear_caches(monkeypatch)
    monkeypatch.setattr(triton_backend, "SEQUENCE_PARALLEL_STATES", "on")
    monkeypatch.setattr(triton_backend, "SEGMENT_CHUNKS", 1)
    got, eager = reduce_overhead_grads(300)
    assert segment_states._dense_cache.pinned  # the capture used the warm-up's tables
    for g_compiled, g_eager in zip(got, eager()):
        torch.testing.assert_close(g_compiled, g_eager, rtol=2e-2, atol=1e-3)
