"""Multi-GPU helpers: FSDP2 sharding and the full (unsharded) weights of a sharded model.

DDP keeps a full copy of the model on every GPU and all-reduces gradients; it needs nothing
here. FSDP2 (``torch.distributed.fsdp.fully_shard``, the per-parameter DTensor API) splits
every parameter, gradient and optimizer state across the ranks and all-gathers one block's
weights just before it runs, so a model only has to fit on the GPUs together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: modules whose class is in ``model._no_split_modules``
    (transformers' name for "a transformer block"; ``DeltaFlowBlock`` for our models)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def shard_model(model: nn.Module, device: torch.device, *, bf16: bool) -> nn.Module:
    """Apply FSDP2 in place: each block is its own shard unit, the rest (embedding, final norm,
    tied head) is the root's. ``bf16``: compute in bf16, reduce gradients in fp32.

    The model may still be on the CPU: fully_shard moves each unit to ``device`` as it shards
    it, so at no point does one GPU hold the whole model.
    """
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    for block in shard_units(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (tied lm_head):
    dropping them from a saved state dict stores each tensor once, as safetensors requires."""
    seen: set[int] = set()
    aliases: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights, gathered to rank 0's CPU (every rank must call; others get {}).

    Tied aliases are dropped; ``safetensors.torch.load_model`` re-ties them on load.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    aliases = tied_aliases(model)
    return {k: v.contiguous() for k, v in state.items() if k not in aliases}
