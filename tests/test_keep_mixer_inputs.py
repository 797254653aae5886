"""Selective checkpointing's opt-in 'mixer_inputs' part (issue 31): the compiled backward takes
the delta-rule op's inputs (q, k, v, β, log α) from the forward's saved tensors instead of
recomputing the short conv, SiLU, L2 norms and gate activations before the op's backward; the
gradients are the same as without it.

The blocks run the Triton op (on the CPU interpreter: TRITON_INTERPRET=1, set in conftest.py)
traced with AOTAutograd and the min-cut partitioner inductor uses, so the partitioned backward
graph is the one a GPU run compiles."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.models.block import SELECTIVE_PARTS, selective_parts
from deltaflow.models.compile import compile_blocks

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

PARTS_OFF = ("mixer", "mlp")
PARTS_ON = ("mixer", "mlp", "mixer_inputs")


def _model() -> DeltaFlowForCausalLM:
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=97,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        rule="delta",
        use_decay=True,
        backend="triton",
    )
    model = DeltaFlowForCausalLM(cfg).train()
    for m in model.modules():  # the GPU training path: one GEMM, one conv over q|k|v
        if hasattr(m, "fused_projections"):
            m.fused_projections = True
    return model


def _step(parts: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], list[fx.GraphModule]]:
    """One compiled forward + backward: the parameter gradients and the backward graphs."""
    torch._dynamo.reset()  # a fresh trace per policy (the blocks' code is the same)
    model = _model()
    backward_graphs: list[fx.GraphModule] = []

    def keep_backward(gm: fx.GraphModule, example_inputs: list) -> object:
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=keep_backward,
        partition_fn=min_cut_rematerialization_partition,  # inductor's
    )
    compile_blocks(model, selective_checkpointing=parts, backend=backend)
    ids = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, backward_graphs


def _op_backward_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The tensors q, k, v, β, log α that the op's backward reads in ``gm``."""
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.deltaflow.chunk_bwd.default]
    return [a for a in node.args[:5] if isinstance(a, fx.Node)]


def _recompute_before_op(gm: fx.GraphModule) -> set[str]:
    """The ops the backward runs to rebuild the op's inputs (the ancestors of those inputs that
    are computed, not read from the forward's saved tensors)."""
    seen, todo = set(), _op_backward_inputs(gm)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.name not in seen:
            seen.add(n.name)
            todo.extend(a for a in n.all_input_nodes)
    return {str(n.target) for n in gm.graph.nodes if n.name in seen}


def test_mixer_inputs_are_kept_not_recomputed_and_gradients_match():
    grads_off, graphs_off = _step(PARTS_OFF)
    grads_on, graphs_on = _step(PARTS_ON)
    assert len(graphs_off) == len(graphs_on) == 1, "one block graph every layer reuses"

    # Off: the backward recomputes the conv, SiLU, L2 norms and β / decay before the op's.
    off = _recompute_before_op(graphs_off[0])
    assert {"aten.silu.default", "aten.rsqrt.default", "aten.sigmoid.default"} <= off, off
    assert "aten.softplus.default" in off and "aten.constant_pad_nd.default" in off, off
    # On: all five inputs are saved tensors of the forward (the marker's outputs), nothing
    # is recomputed for the op's backward.
    inputs = _op_backward_inputs(graphs_on[0])
    assert len(inputs) == 5 and all(n.op == "placeholder" for n in inputs), inputs
    assert _recompute_before_op(graphs_on[0]) == set()

    for name, g in grads_off.items():  # the same math: fp32 gradients equal to rounding
        torch.testing.assert_close(
            grads_on[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_what_the_op_keeps_is_saved_not_recomputed(monkeypatch):
    # triton_backend.SAVE_FOR_BACKWARD = "states" on the same path (selective checkpointing
    # keeps the op's outputs, the kept tensors among them): the partitioned backward hands them
    # to the op's backward as saved tensors, never runs the op's forward again, and the
    # gradients are eager's with the switch off.
    model = _model()
    ids = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    eager = {n: p.grad for n, p in model.named_parameters()}
    monkeypatch.setattr(triton_backend, "SAVE_FOR_BACKWARD", "states")
    grads, graphs = _step(PARTS_OFF)
    (gm,) = graphs
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.deltaflow.chunk_fwd.default]
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.deltaflow.chunk_bwd.default]
    kept = [a for a in node.args[9:15] if a is not None]  # w, t, h, v_new
    assert len(kept) == 4 and all(a.op == "placeholder" for a in kept), kept
    for name, g in eager.items():
        torch.testing.assert_close(
            grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_parts_are_checked_against_one_list():
    assert selective_parts(True) == ("mixer", "mlp") and selective_parts(False) == ()
    assert selective_parts(PARTS_ON) == PARTS_ON and set(PARTS_ON) == set(SELECTIVE_PARTS)
    with pytest.raises(ValueError, match="among"):
        selective_parts(("mixer", "mixer_input"))
    with pytest.raises(ValueError, match="add 'mixer'"):
        selective_parts(("mlp", "mixer_inputs"))
    with pytest.raises(TypeError):
        selective_parts("mixer")  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(ValueError, match="among"):
        compile_blocks(model, selective_checkpointing=("mlps",), backend="aot_eager")
    # the block tells its mixer to mark the op's inputs, and forgets it when the part goes
    block = model.model.layers[0]
    block.selective_checkpointing = PARTS_ON
    assert block.mixer.keep_op_inputs
    block.selective_checkpointing = ()
    assert not block.mixer.keep_op_inputs
