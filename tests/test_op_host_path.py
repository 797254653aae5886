"""The op's host path after issue 31's host-time cuts (benchmarks/host_overhead.py; NOTES.md,
"Issue 31, session 16: the op's host time"): the chunk tables cache, the backward without a
final-state gradient, the shared final-state buffer, and the launch arithmetic that replaced
Triton's host helpers. Each gives exactly (bit for bit) what it replaced; on the CPU interpreter
here, on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs, reduce_overhead_grads

from deltaflow import delta_rule

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402

from deltaflow.ops.triton import common  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]


def test_launch_arithmetic_is_tritons():
    for n in range(0, 1100):
        assert common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64):
            assert common.cdiv(n, b) == triton.cdiv(n, b), (n, b)


def _same_tables(a: common.ChunkTables, b: common.ChunkTables) -> None:
    assert a.n_chunks == b.n_chunks
    for x, y in zip(a[:3], b[:3]):
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x, y)
    assert a.placeholder.dtype == torch.float32 and a.placeholder.numel() == 1


@pytest.mark.parametrize("cu", [None, [0, 5, 69, 69, 70, 200]], ids=["dense", "packed"])
def test_chunk_spans_are_each_chunks_first_token_and_end(cu):
    # what the per-chunk kernels read (common.chunk_bounds): chunk j of sequence n starts at
    # cu[n] + 64 j and ends with its sequence, empty sequences holding no chunk
    B, T = (3, 130) if cu is None else (1, 200)
    offsets = None if cu is None else torch.tensor(cu, device=DEVICE)
    tables = common.build_chunk_tables(offsets, B, T, DEVICE)
    bounds = [0, 130, 260, 390] if cu is None else cu
    want = [[s + j, e] for s, e in zip(bounds, bounds[1:]) for j in range(0, e - s, 64)]
    assert tables.chunk_spans.tolist() == want and tables.n_chunks == len(want)


def test_chunk_tables_are_cached_and_equal_built_ones(monkeypatch):
    monkeypatch.setattr(common, "_tables", type(common._tables)())
    for B, T in ((2, 130), (1, 64), (3, 1)):
        tables = common.chunk_tables(None, B, T, DEVICE)
        assert common.chunk_tables(None, B, T, DEVICE) is tables  # a hit: nothing rebuilt
        _same_tables(tables, common.build_chunk_tables(None, B, T, DEVICE))

    # Packed sequences: cached per offsets tensor, rebuilt when it changes in place or when
    # another tensor (same values or not) comes.
    cu = torch.tensor([0, 5, 69, 69, 70], device=DEVICE)
    tables = common.chunk_tables(cu, 1, 70, DEVICE)
    assert common.chunk_tables(cu, 1, 70, DEVICE) is tables
    _same_tables(tables, common.build_chunk_tables(cu, 1, 70, DEVICE))
    cu[2] = 64  # in place: the version counter moves
    changed = common.chunk_tables(cu, 1, 70, DEVICE)
    assert changed is not tables and changed.n_chunks == 4  # lengths 5, 59, 5, 1
    _same_tables(changed, common.build_chunk_tables(cu, 1, 70, DEVICE))
    other = cu.clone()
    assert common.chunk_tables(other, 1, 70, DEVICE) is not changed

    # An LRU of TABLES_CACHE_SIZE entries: the oldest go, the recent ones stay.
    monkeypatch.setattr(common, "TABLES_CACHE_SIZE", 3)
    for T in range(1, 6):
        common.chunk_tables(None, 1, T, DEVICE)
    assert len(common._tables) == 3
    assert list(common._tables)[-1] == (1, 5, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("initial_state", [False, True])
def test_unused_final_state_gives_the_zero_gradient_bit_for_bit(
    narrow_half_kernels, dtype, initial_state
):
    # A final state that is not used reaches the backward as None (no zeros allocated, the
    # reverse pass starts from zero: HAS_DST off); used with a zero gradient it is the tensor of
    # zeros the backward read before. The gradients are the same to the last bit, with and
    # without an initial state (without one, the state pass's discarded final state and the
    # discarded initial-state gradient share one buffer). float16 on the half-precision kernels
    # (narrow_half_kernels: the op runs a 16-column head on the fp32 kernels otherwise).
    inputs = make_inputs(1, 70, 2, 16, 16, rule="delta", dtype=torch.float32, seed=3)
    inputs["initial_state"] = inputs["initial_state"] if initial_state else None
    grads = []
    for use_state in (False, True):
        leaves = {
            n: None if x is None else x.to(DEVICE, dtype).requires_grad_()
            for n, x in inputs.items()
        }
        leaves["beta"] = leaves["beta"].detach().float().requires_grad_()
        leaves["log_decay"] = leaves["log_decay"].detach().float().requires_grad_()
        o, s = delta_rule(**leaves, output_final_state=use_state, backend="triton")
        loss = o.float().sin().sum() + (0.0 * s.sum() if use_state else 0.0)
        loss.backward()
        grads.append([leaves[n].grad for n in NAMES if leaves[n] is not None])
    for g_none, g_zero in zip(*grads):
        assert g_none.dtype == g_zero.dtype and torch.equal(g_none, g_zero)


def test_poisoned_outputs_are_all_written(monkeypatch):
    # POISON_OUTPUTS fills every buffer with NaN before its launch: a forward + backward with it
    # on gives what it gives with it off (every element written), on the cached tables path.
    inputs = make_inputs(1, 130, 2, 16, 16, rule="delta", dtype=torch.float32, seed=4)
    results = []
    for poison in (False, True):
        monkeypatch.setattr(triton_backend, "POISON_OUTPUTS", poison)
        leaves = {
            n: None if x is None else x.to(DEVICE).requires_grad_() for n, x in inputs.items()
        }
        o, s = delta_rule(**leaves, output_final_state=True, backend="triton")
        (o.sin().sum() + s.pow(2).sum()).backward()
        results.append([o, s, *(leaves[n].grad for n in NAMES)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudagraph trees need a GPU")
def test_reduce_overhead_compile_keeps_the_cached_tables_out_of_the_graph_pool(monkeypatch):
    # torch.compile(mode="reduce-overhead") warms a graph up with the warming thread's
    # allocations sent to the graph's memory pool, and its checks refuse a tensor there that
    # outlives the graph: the tables cache builds its entries on a thread of its own. An empty
    # cache, so the first (warm-up) call builds them. Gradients: eager's (inductor may round the
    # loss's own backward differently, so to bf16's tolerance, not bit for bit).
    monkeypatch.setattr(common, "_tables", type(common._tables)())
    got, eager = reduce_overhead_grads(130)
    common._tables.clear()  # nothing cached for the eager reference either
    for g_compiled, g_eager in zip(got, eager()):
        torch.testing.assert_close(g_compiled, g_eager, rtol=2e-2, atol=1e-3)


def _packed_inputs(lengths: list[int], seed: int, dtype: torch.dtype) -> list:
    """q, k, v, β, log α of sequences of ``lengths`` packed into one row, and their offsets."""
    T, H, D = sum(lengths), 2, 16
    inputs = make_inputs(1, T, H, D, D, rule="delta", dtype=torch.float32, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tensors = [inputs[n].to(DEVICE) for n in ("q", "k", "v", "beta", "log_decay")]
    return [x.to(dtype) for x in tensors[:3]] + tensors[3:] + [cu.to(DEVICE)]


def _packed_loss(q, k, v, beta, log_decay, cu_seqlens):
    o, _ = delta_rule(
        q, k, v, beta, log_decay=log_decay, cu_seqlens=cu_seqlens, backend="triton",
        check_values=False,
    )  # fmt: skip
    return o.float().square().sum()


def test_packed_sequences_run_ops_marked_unsafe_for_cuda_graphs():
    # Packed sequences read their chunk count on the host and launch a grid of that size: no
    # CUDA graph can capture or replay that. Their ops carry the cudagraph_unsafe tag, which
    # inductor's cudagraph trees read to run such a graph without CUDA graphs; dense batches
    # keep ops without it (compile.CUDA_GRAPHS replays them).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    dense = make_inputs(1, 70, 2, 16, 16, rule="delta", dtype=torch.float32, initial_state=False)
    cases = {
        "dense": [dense[n].to(DEVICE) for n in ("q", "k", "v", "beta", "log_decay")] + [None],
        "packed": _packed_inputs([30, 70, 1], seed=1, dtype=torch.float32),
    }
    for name, args in cases.items():
        torch._dynamo.reset()
        graphs.clear()
        leaves = [x if x is None or x.dtype == torch.int32 else x.requires_grad_() for x in args]
        torch.compile(_packed_loss, backend=backend, fullgraph=True)(*leaves).backward()
        fwd, bwd = graphs
        ops = {n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
        unsafe = [get_first_incompatible_cudagraph_node(gm) for gm in graphs]
        deltaflow_ops = {str(op) for op in ops if "deltaflow" in str(op)}
        if name == "dense":
            assert deltaflow_ops == {"deltaflow.chunk_fwd.default", "deltaflow.chunk_bwd.default"}
            assert unsafe == [None, None]
        else:
            assert deltaflow_ops == {
                "deltaflow.chunk_fwd_varlen.default",
                "deltaflow.chunk_bwd_varlen.default",
            }
            assert [str(n.target) for n in unsafe] == [
                "deltaflow.chunk_fwd_varlen.default",
                "deltaflow.chunk_bwd_varlen.default",
            ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudagraph trees need a GPU")
def test_reduce_overhead_compile_of_packed_sequences_follows_each_batch_layout():
    # Under mode="reduce-overhead" a graph with packed sequences runs without CUDA graphs (its
    # ops are cudagraph_unsafe): each batch's own layout, never the first one's replayed.
    compiled = torch.compile(_packed_loss, mode="reduce-overhead")
    for step, lengths in enumerate(([30, 70, 1], [64, 37], [101], [3, 98])):
        args = _packed_inputs(lengths, seed=step, dtype=torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(*args)
        torch.testing.assert_close(got, _packed_loss(*args), rtol=2e-2, atol=1e-3)
