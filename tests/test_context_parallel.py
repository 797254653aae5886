"""Context parallelism: one sequence split along T, in one process and over 2 and 4 gloo ranks.

Single process: the segment plan of packed documents, and the segmented op (segments computed
apart, chained, corrected) against the op, outputs, final states and every gradient in float64.

Processes (``-m "not multiprocess"`` skips them): one spawn of 2 ranks and one of 4, each
checking many cases inside: the context-parallel op against the one-process op (every rule,
decay, negative eigenvalues, initial and final states, segment boundaries inside and between
chunks, packed documents crossing one or several ranks, starting at a boundary, empty ones),
the tiny language model's loss and gradients (2 ranks; plain and packed rows, op-by-op and
fused projections, with gradient checkpointing), and the trainer's ``context_parallel`` (2
ranks: cp 2 with DDP; 4 ranks: cp 2 x dp 2 with FSDP2) against one process on the same global
batch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _distributed import free_port, set_rank_env, spawn_ranks
from _inputs import make_inputs, reads_decay, rel_err

from deltaflow import delta_rule
from deltaflow.ops.segments import plan_segment, segmented_delta_rule, split_bounds
from deltaflow.rules import RULES

RULE_NAMES = sorted(RULES)
TOL = 1e-10  # float64: rounding only


# ---------------------------------------------------------------------------- shared helpers
def packed_offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0)


def weights(shape: torch.Size, seed: int) -> torch.Tensor:
    """A fixed random cotangent (the loss is sum(x * weights))."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def reference(
    inputs: dict, cu, op_kwargs: dict, final_state_loss: bool = True
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The one-process op: outputs, final states and the gradients of every input."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
    o, s = delta_rule(**leaves, cu_seqlens=cu, output_final_state=True, **op_kwargs)
    loss = (o * weights(o.shape, 1)).sum()
    if final_state_loss:
        loss = loss + (s * weights(s.shape, 2)).sum()
    loss.backward()
    return o.detach(), s.detach(), {k: v.grad for k, v in leaves.items()}


# ---------------------------------------------------------------------------- one process
def test_plan_of_packed_documents():
    cu = [0, 3, 3, 10, 12, 20]  # documents 0..4; document 1 is empty
    first = plan_segment(0, 5, 20, cu)
    assert (first.docs, first.cu, first.continues_in, first.continues_out) == (
        (0, 2),
        (0, 3, 5),
        False,
        True,
    )
    assert first.empty_docs == (1,)  # segment 0 owns the empty documents
    middle = plan_segment(5, 10, 20, cu)  # inside document 2, which ends at the boundary
    assert (middle.docs, middle.cu, middle.continues_in, middle.continues_out) == (
        (2,),
        (0, 5),
        True,
        False,
    )
    assert middle.first_start == 3 and middle.empty_docs == ()
    starts = plan_segment(10, 20, 20, cu)  # a document starts exactly at the boundary
    assert (starts.docs, starts.cu, starts.continues_in, starts.continues_out) == (
        (3, 4),
        (0, 2, 10),
        False,
        False,
    )
    rows = plan_segment(4, 8, 8)
    assert rows.rows and rows.continues_in and not rows.continues_out
    assert split_bounds(10, 3) == [0, 3, 6, 10]
    with pytest.raises(ValueError, match="non-empty"):
        plan_segment(3, 3, 8)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_segmented_op_equals_the_op(rule, seed_and_one_thread):
    """Segments [0, 3, 5, 6, 29, 30, 40, 55) cut documents, fall on document starts and on
    empty documents; chunks of 4 put boundaries inside and between chunks."""
    lengths = [0, 5, 0, 23, 1, 0, 17, 9, 0]
    cu = packed_offsets(lengths)
    T = sum(lengths)
    cases = [
        (True, True, cu, [0, 3, 5, 6, 29, 30, 40, T]),
        (False, False, cu, [0, 8, 29, T]),
        (True, False, None, [0, 7, 8, 20, T]),
        (False, True, None, [0, 1, T]),
    ]
    for decay, neg, cu_, bounds in cases:
        decay = decay or reads_decay(rule)  # such a rule is refused without a decay
        B = 1 if cu_ is not None else 2
        n_states = len(lengths) if cu_ is not None else None
        inputs = make_inputs(B, T, 2, 4, 3, rule=rule, decay=decay, n_states=n_states, seed=3)
        op_kwargs = dict(rule=rule, negative_eigenvalues=neg, chunk_size=4, backend="torch")
        o_ref, s_ref, g_ref = reference(inputs, cu_, op_kwargs)
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if v is not None}
        o, s = segmented_delta_rule(
            **leaves, bounds=bounds, cu_seqlens=cu_, output_final_state=True, **op_kwargs
        )
        ((o * weights(o.shape, 1)).sum() + (s * weights(s.shape, 2)).sum()).backward()
        what = f"{rule} decay={decay} neg={neg} packed={cu_ is not None}"
        assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL, what
        for name, grad in g_ref.items():
            if grad is not None:  # beta of 'linear'/'kaczmarz' gets none
                assert rel_err(leaves[name].grad, grad) <= TOL, f"{what}: d{name}"


def test_enable_refuses_attention_layers():
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.parallel import enable_context_parallel

    config = DeltaFlowConfig(vocab_size=16, hidden_size=16, num_layers=2, num_heads=2, attn_every=2)
    hybrid = DeltaFlowForCausalLM(config)
    with pytest.raises(ValueError, match="softmax attention layers"):
        enable_context_parallel(hybrid)


def test_layout_of_ranks_and_tokens():
    from deltaflow.parallel.data_layout import DataLayout

    layout = DataLayout(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    ids = torch.arange(16).reshape(2, 8)
    assert layout.tokens(ids).tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="multiple of it"):
        layout.tokens(ids[:, :7])
    assert not layout.allows_compile("auto")  # eager under context parallelism
    with pytest.raises(ValueError, match="compile='blocks' does not support"):
        layout.allows_compile("blocks")
    assert DataLayout().allows_compile("blocks")


def test_cli_flag_sets_the_config(capsys):
    from deltaflow.cli import main

    assert main(["train", "--context-parallel", "2", "--print-config"]) == 0
    assert "context_parallel: 2" in capsys.readouterr().out
    assert main(["train", "--context-parallel", "0", "--print-config"]) == 2
    assert "context_parallel must be a positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------------------- on the ranks
def op_cases(world: int) -> list[dict]:
    """Cases for ``world`` ranks: (rule, decay, negative eigenvalues, layout)."""
    cases = []
    for rule in RULE_NAMES:
        for decay, neg in ((True, True), (False, False)) if world == 2 else ((True, True),):
            # unpacked rows, 7 tokens per rank: the boundaries fall inside chunks of 4
            cases.append(dict(rule=rule, decay=decay or reads_decay(rule), neg=neg, L=7))
        # packed documents crossing the boundaries, 8 tokens per rank: between chunks
        cases.append(dict(rule=rule, decay=True, neg=True, L=8, lengths=[3, 0, 6, 2]))
    L = 6
    T = L * world
    cases += [
        dict(rule="delta", decay=True, neg=False, L=7, init=False),  # no initial/final states
        dict(rule="linear", decay=True, neg=False, L=5, no_beta=True),
        # a document starting exactly at every boundary, empty documents on them
        dict(rule="efla", decay=True, neg=True, L=L, lengths=[L, 0] * (world - 1)),
        # one document across every rank, then a short one on the last
        dict(rule="longhorn", decay=True, neg=False, L=L, lengths=[T - 2]),
        # segments of different lengths (explicit bounds), documents across several of them
        dict(
            rule="trapezoid",
            decay=True,
            neg=False,
            bounds=[0, 1, 9, 10, 20][:world] + [23],
            lengths=[2, 12, 5],
        ),
    ]
    return cases


def check_op_case(rank: int, world: int, case: dict) -> None:
    from deltaflow.parallel import context_parallel_delta_rule

    bounds = case.get("bounds") or [r * case["L"] for r in range(world + 1)]
    T = bounds[-1]
    cu = None
    if "lengths" in case:
        cu = packed_offsets(case["lengths"] + [T - sum(case["lengths"])])
    B = 1 if cu is not None else 2
    with_states = case.get("init", True)
    inputs = make_inputs(
        B,
        T,
        2,
        4,
        3,
        rule=case["rule"],
        decay=case["decay"],
        initial_state=with_states,
        n_states=None if cu is None else len(cu) - 1,
        seed=len(bounds) * 100 + T,
    )
    if case.get("no_beta"):
        inputs["beta"] = None
    op_kwargs = dict(
        rule=case["rule"], negative_eigenvalues=case["neg"], chunk_size=4, backend="torch"
    )
    o_ref, s_ref, g_ref = reference(inputs, cu, op_kwargs, with_states)

    sl = slice(bounds[rank], bounds[rank + 1])
    leaves = {
        k: (v if k == "initial_state" else v[:, sl]).clone().requires_grad_(True)
        for k, v in inputs.items()
        if v is not None
    }
    o, s = context_parallel_delta_rule(
        **leaves,
        cu_seqlens=cu,
        bounds=case.get("bounds"),
        output_final_state=with_states,
        **op_kwargs,
    )
    loss = (o * weights(o_ref.shape, 1)[:, sl]).sum()
    if with_states:
        # every rank holds the final states; the ranks' shares of their loss sum to one
        share = (rank + 1) / (world * (world + 1) / 2)
        loss = loss + share * (s * weights(s_ref.shape, 2)).sum()
    loss.backward()

    what = f"rank {rank}/{world}: {case}"
    assert rel_err(o, o_ref[:, sl]) <= TOL, what
    if with_states:
        assert rel_err(s, s_ref) <= TOL, what
    else:
        assert s is None
    for name, ref_grad in g_ref.items():
        if ref_grad is None:
            continue
        grad = leaves[name].grad
        if name == "initial_state":  # each rank holds its share of the gradient
            grad = torch.zeros_like(ref_grad) if grad is None else grad.clone()
            dist.all_reduce(grad)
            assert rel_err(grad, ref_grad) <= TOL, f"{what}: d{name}"
        else:
            assert rel_err(grad, ref_grad[:, sl]) <= TOL, f"{what}: d{name}"


def check_model(
    rank: int, world: int, packed: bool, checkpointing: bool, fused: bool = False
) -> None:
    """The tiny LM on this rank's segment: loss and every weight gradient (summed over the
    ranks) equal one process on the whole batch (float64). ``fused``: the layers' fused
    projections and q|k|v conv (the CUDA default) instead of the op-by-op path."""
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.parallel import enable_context_parallel

    config = DeltaFlowConfig(
        vocab_size=40,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        rule="delta",
        use_decay=True,
        chunk_size=4,
        backend="torch",
    )
    torch.manual_seed(0)
    ref = DeltaFlowForCausalLM(config).double().train()
    for layer in ref.model.layers:
        layer.mixer.fused_projections = fused
    model = copy.deepcopy(ref)
    cp = enable_context_parallel(model)
    if checkpointing:  # the backward recomputes each block, collectives included
        model.model.gradient_checkpointing = True
    L, B = 9, 1 if packed else 2
    T = L * world
    ids = torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(3))
    targets = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # shifted globally
    cu = None
    if packed:
        cu = packed_offsets([2, 0, 6, 3, T - 11])  # documents across the boundary at 9
        targets[0, cu[1:-1] - 1] = -100  # no document predicts the next one's first token
    out = ref(input_ids=ids, labels=targets, labels_are_shifted=True, cu_seqlens=cu)
    out.loss.backward()

    cp.set_documents(cu)
    sl = slice(rank * L, (rank + 1) * L)
    local = model(input_ids=ids[:, sl], labels=targets[:, sl], labels_are_shifted=True)
    share = int((targets[:, sl] != -100).sum()) / int((targets != -100).sum())
    (local.loss * share).backward()
    loss = (local.loss * share).detach()
    dist.all_reduce(loss)
    what = f"rank {rank}, packed={packed}, checkpointing={checkpointing}, fused={fused}"
    assert abs(loss.item() - out.loss.item()) <= 1e-10 * out.loss.item(), what
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        assert rel_err(grad, ref_params[name].grad) <= TOL, f"{what}: {name}"

    left_padded = torch.ones_like(ids[:, sl])
    left_padded[:, 0] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=ids[:, sl], attention_mask=left_padded)
    with cp.disabled():  # whole sequences on one process again
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def trainer_config(tmp: Path, **changes):
    from deltaflow.train import TrainConfig

    base = dict(
        task="mqar",
        task_kwargs={"seq_len": 32, "num_kv_pairs": 4, "vocab_size": 64},
        model={
            "hidden_size": 16,
            "num_layers": 2,
            "num_heads": 2,
            "use_decay": True,
            "chunk_size": 4,
            "backend": "torch",
        },
        steps=3,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        eval_kwargs={"num_examples": 4, "batch_size": 4},
        progress=False,
        device="cpu",
        precision="fp32",
        seed=0,
        out_dir=str(tmp),
    )
    base.update(changes)
    return TrainConfig(**base)


def train_losses(run_dir: Path) -> list[float]:
    from deltaflow.train import read_log

    return [r["loss"] for r in read_log(run_dir) if r["kind"] == "train"]


def _worker(rank: int, world: int, port: int, tmp_dir: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for case in op_cases(world):
            check_op_case(rank, world, case)
        if world == 2:
            check_model(rank, world, packed=False, checkpointing=False)
            check_model(rank, world, packed=True, checkpointing=True, fused=True)
            check_model(rank, world, packed=True, checkpointing=False)
            check_model(rank, world, packed=False, checkpointing=False, fused=True)
        from deltaflow.train import Trainer

        parallel = "ddp" if world == 2 else "fsdp"  # 4 ranks: 2 data-parallel x 2 context
        config = trainer_config(Path(tmp_dir) / "cp", context_parallel=2, parallel=parallel)
        trainer = Trainer(config)
        trainer.train()
        trainer.close()
    finally:
        dist.destroy_process_group()


def spawn(world: int, tmp: Path) -> None:
    spawn_ranks(_worker, (world, free_port(), str(tmp)), world=world, timeout=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_ranks_match_one_process(world, tmp_path):
    spawn(world, tmp_path)
    from deltaflow.train import Trainer

    Trainer(trainer_config(tmp_path / "one")).train()
    one, cp = train_losses(tmp_path / "one"), train_losses(tmp_path / "cp")
    assert len(cp) == 3
    torch.testing.assert_close(cp, one, rtol=1e-4, atol=0)
    final = json.loads((tmp_path / "cp" / "final.json").read_text())
    assert final["finished"] and "loss" in final["eval"]
