"""Issue 31: the trainer takes a DeltaFlow model's loss from its chunked linear + cross-entropy
(no [B, T, V] logits); one step's loss and every gradient match the logits path, and the
memory plan counts one chunk of logits instead of four copies of them all."""

from __future__ import annotations

import pytest
import torch
from test_train import ToyModel, ToyTask, toy_config

from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.models.loss import DEFAULT_CHUNK_SIZE
from deltaflow.models.loss import IGNORE_INDEX as LOSS_IGNORE_INDEX
from deltaflow.tasks import IGNORE_INDEX as TASK_IGNORE_INDEX
from deltaflow.train import Trainer, memory
from deltaflow.train.build import IGNORE_INDEX, has_lean_loss

pytestmark = pytest.mark.usefixtures("seed_and_one_thread")  # conftest.py

GB = 2**30


class EdgeTask(ToyTask):
    """ToyTask with the cases the loss must keep: a micro-batch of rows with nothing scored
    (rows 0-3 of step 0), ignored positions, and optionally packed documents."""

    def __init__(self, packed: bool = False):
        super().__init__()
        self.packed = packed

    def get_batch(self, batch_size: int, split: str = "train", step: int = 0, length=None):
        batch = super().get_batch(batch_size, split, step, length)
        batch["labels"][:4] = IGNORE_INDEX
        if self.packed:
            g = torch.Generator().manual_seed(step)
            batch["doc_starts"] = torch.rand(batch["input_ids"].shape, generator=g) < 0.2
        return batch


def tiny_model(dtype: torch.dtype, fused: bool = True) -> DeltaFlowForCausalLM:
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=11, hidden_size=32, num_layers=2, num_heads=2, chunk_size=8, backend="torch"
    )
    model = DeltaFlowForCausalLM(cfg).to(dtype)
    model.loss_chunk_size = 5  # several chunks per micro-batch, the last one partial
    if not fused:
        model.config.fuse_linear_cross_entropy = False  # the opt-out: the logits path
    return model


def one_step(model: torch.nn.Module, task: ToyTask, grad_accum: int):
    """(loss, gradients before the optimizer uses them, calls of lm_head, logits returned)."""
    trainer = Trainer(toy_config(grad_accum=grad_accum), model=model, task=task)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    head_calls, logits = [], []
    model.lm_head.register_forward_hook(lambda *args: head_calls.append(1))
    model.register_forward_hook(lambda m, args, out: logits.append(out.logits))
    loss, _, _ = trainer.train_step(0)
    return trainer, loss, grads, len(head_calls), logits


@pytest.mark.parametrize(
    "dtype, packed, grad_accum",
    [
        (torch.float32, False, 1),
        (torch.float32, False, 2),
        (torch.float32, True, 2),
        (torch.float64, True, 4),
    ],
)
def test_the_lean_loss_step_matches_the_logits_step(dtype, packed, grad_accum):
    lean, loss, grads, head_calls, logits = one_step(
        tiny_model(dtype), EdgeTask(packed), grad_accum
    )
    assert lean.lean_loss and head_calls == 0 and logits == [None] * grad_accum
    plain, ref_loss, ref_grads, head_calls, logits = one_step(
        tiny_model(dtype, fused=False), EdgeTask(packed), grad_accum
    )
    assert not plain.lean_loss and head_calls == grad_accum and logits[0] is not None
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name  # every parameter takes part
        torch.testing.assert_close(grads[name], g, **tol, msg=name)


def test_only_models_with_the_lean_contract_take_that_path():
    assert has_lean_loss(tiny_model(torch.float32))
    assert not has_lean_loss(tiny_model(torch.float32, fused=False))
    assert not has_lean_loss(ToyModel())  # a plain module: the loss from its logits
    wrapped = torch.nn.Module()
    wrapped.module = tiny_model(torch.float32)  # DDP's wrapper: the model inside decides
    assert has_lean_loss(wrapped)
    # the trainer counts scored labels with the ignore index the model's loss skips
    assert IGNORE_INDEX == LOSS_IGNORE_INDEX == TASK_IGNORE_INDEX


def test_the_memory_plan_counts_one_chunk_of_logits():
    """The issue's shape (B=8, T=2048, V=32000): 4 fp32 copies of all 16384 x 32000 logits
    (7.8 GB) become 2 of one 4096-row chunk (0.98 GB)."""
    shape = dict(num_params=0, seq_len=2048, vocab_size=32000)
    full = memory.estimate_step(micro_batch=8, **shape)
    lean = memory.estimate_step(micro_batch=8, loss_chunk_rows=DEFAULT_CHUNK_SIZE, **shape)
    assert full.logits == memory.LOGIT_COPIES * 4 * 8 * 2048 * 32000
    assert lean.logits == memory.CHUNK_LOGIT_COPIES * 4 * DEFAULT_CHUNK_SIZE * 32000
    assert round(full.logits / GB, 2) == 7.81 and round(lean.logits / GB, 2) == 0.98
    # a micro-batch below one chunk holds all its rows, once per copy
    one_row = memory.estimate_step(micro_batch=1, loss_chunk_rows=DEFAULT_CHUNK_SIZE, **shape)
    assert one_row.logits == memory.CHUNK_LOGIT_COPIES * 4 * 2048 * 32000
