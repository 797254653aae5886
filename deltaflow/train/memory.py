"""Memory of one training step, estimated before the first one, against the device's memory.

A run whose step does not fit used to die unannounced (``Killed``, rc 137, after a minute of
swapping): ``--task lm --hidden-size 32 --num-layers 1`` has 1.6M parameters but its default
batch of 64 x 512 tokens x a 50,257-token vocabulary makes 6.6 GB of logits per copy. The
trainer now estimates a step (:func:`estimate_step`) and, when it does not fit, splits the
batch into micro-batches with gradient accumulation (the same effective batch, the same
gradient up to float rounding), or, when not even one sequence fits, refuses in one line.

The estimate (bytes, fp32 training):

- parameters, gradients and AdamW's two moments: 16 bytes per parameter (sharded: / world);
- logits: 4 copies of micro-batch x tokens x vocab in fp32 (the logits, the log-softmax saved
  for backward, and the gradients of both); bf16 autocast keeps the same total. A model that
  computes the loss itself (``build.has_lean_loss``: the chunked linear + cross-entropy of
  ``deltaflow/models/loss.py``) holds one chunk of rows at a time instead: 2 fp32 copies of
  ``min(tokens, chunk)`` x vocab (the chunk's logits, turned into their gradient in place, and
  the log-sum-exp's temporary; under autocast the bf16 matmul output and gradient are smaller);
- activations: 64 floats per token, per layer and per unit of ``hidden_size`` (the default
  delta-rule block with its SwiGLU; measured 53-65 at widths 128-512, head dims 16-128).
  Compiled blocks on CUDA (``compile``; selective checkpointing keeps matmul and mixer outputs
  only): 16. Measured on an H100, 400M model, B=8 x T=2048 with bf16 weights: 14.16 GB at
  the peak, ~10.5 GB of it activations, 6.5 floats (issue 27); under the trainer's autocast
  the residual stream between blocks is fp32 (+1): 16 leaves twice that. With 64 the trainer
  planned 110 GB for that step and split it into 4 micro-batches on an 80 GB GPU.

Measured on CPU (peak RSS of a step minus the RSS before it, tests/test_memory.py): 1.02x the
estimate when logits dominate, 0.82x when activations do. The once-seen 1.33x inside the whole
test suite was most likely the set-up's peak, not the step's (seen since: 1.6x, the step alone
1.11x): the test now resets the peak before the step. Since issue 31 the trainer lets go of
the logits before backward: the logits' loss measures 0.78x (~3 copies; 4 are kept as
margin), the chunked loss 1.05x (one chunk of all rows) and 1.11x (chunks of half the rows),
0.82-0.86x when activations dominate.
Evaluation (no gradients, its own batch) is not included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
LOGIT_COPIES = 4
CHUNK_LOGIT_COPIES = 2  # the chunked loss: one chunk's fp32 logits and logsumexp's temporary
ACTIVATION_FLOATS = 64  # per token x layer x hidden unit
ACTIVATION_FLOATS_COMPILED_CUDA = 16  # compiled blocks with selective checkpointing, on CUDA
# Share of the available memory a step may plan to use: the rest is left for the allocator's
# fragmentation, the data and whatever else the machine runs.
USABLE_FRACTION = 0.7  # the peak measured once at 1.33x the estimate (tests/test_memory.py)
GB = 2**30


@dataclass
class StepMemory:
    """Bytes of one training step, by part."""

    parameters: int
    logits: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.logits + self.activations

    def describe(self) -> str:
        return (
            f"~{_gb(self.total)} (logits {_gb(self.logits)}, activations "
            f"{_gb(self.activations)}, parameters + AdamW {_gb(self.parameters)})"
        )


def _gb(n: float) -> str:
    return f"{n / GB:.2g} GB" if n < 10 * GB else f"{n / GB:.0f} GB"


def estimate_step(
    *,
    num_params: int,
    micro_batch: int,
    seq_len: int,
    vocab_size: int,
    hidden_size: int = 0,
    num_layers: int = 0,
    param_shards: int = 1,
    activation_floats: int = ACTIVATION_FLOATS,
    loss_chunk_rows: int | None = None,
) -> StepMemory:
    """The estimate of the module docstring (``hidden_size``/``num_layers`` 0: unknown model,
    no activation term; ``activation_floats``: ACTIVATION_FLOATS_COMPILED_CUDA for compiled
    blocks on CUDA; ``loss_chunk_rows``: the rows of a chunk of the model's own chunked loss,
    None where the loss is taken from the full logits)."""
    tokens = micro_batch * seq_len
    if loss_chunk_rows is None:
        logits = LOGIT_COPIES * 4 * tokens * vocab_size
    else:
        logits = CHUNK_LOGIT_COPIES * 4 * min(tokens, loss_chunk_rows) * vocab_size
    return StepMemory(
        parameters=BYTES_PER_PARAMETER * num_params // max(1, param_shards),
        logits=logits,
        activations=activation_floats * 4 * tokens * hidden_size * num_layers,
    )


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can get: free GPU memory (CUDA), else the smallest of the
    kernel's MemAvailable, the cgroup's limit minus its usage (what the OOM killer counts in
    a container) and the address-space limit (``ulimit -v``) minus this process's size.
    None where none can be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGESIZE")
            found.append(limit - size)
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else None


def model_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(hidden_size, num_layers) of a transformers-style model; (0, 0) when unknown."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", 0)
    layers = getattr(config, "num_layers", None) or getattr(config, "num_hidden_layers", 0)
    return (int(hidden), int(layers)) if isinstance(hidden, int) else (0, 0)


def plan_accumulation(
    rows: int,
    grad_accum: int,
    usable: int,
    estimate: callable,
) -> tuple[int, StepMemory, StepMemory]:
    """The smallest ``accum >= grad_accum`` dividing ``rows`` (this rank's rows of a step)
    whose micro-batch ``rows // accum`` fits in ``usable`` bytes: (accum, its estimate, the
    estimate of the asked ``grad_accum``). ``estimate(micro_batch) -> StepMemory``. Raises a
    one-line ``MemoryError`` when not even a micro-batch of one row fits."""
    asked = estimate(rows // grad_accum)
    for accum in range(grad_accum, rows + 1):
        if rows % accum:
            continue
        need = asked if accum == grad_accum else estimate(rows // accum)
        if need.total <= usable:
            return accum, need, asked
    raise MemoryError(estimate(1).describe())


def shortest_fit(usable: int, seq_len: int, estimate_tokens: callable) -> int:
    """The longest sequence (a power of two below ``seq_len``) whose one-row step fits."""
    length = seq_len
    while length > 1 and estimate_tokens(length).total > usable:
        length //= 2
    return length


def loss_chunk_rows(model: nn.Module) -> int:
    """Rows per chunk of a model's own chunked loss (``loss_chunk_size``, as
    DeltaFlowForCausalLM has; else the loss's default)."""
    from deltaflow.models.loss import DEFAULT_CHUNK_SIZE

    return int(getattr(model, "loss_chunk_size", DEFAULT_CHUNK_SIZE))


def env_local_world() -> int:
    """Processes sharing this host's memory (torchrun's LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


class MemoryFitMixin:
    """A Trainer's fit of its step to the device's memory."""

    def _fit_memory(self, model: nn.Module, rows: int) -> int:
        """The gradient-accumulation steps a training step needs to fit in this device's
        memory (:mod:`deltaflow.train.memory`): ``grad_accum`` when its micro-batch fits, else
        the smallest larger one that does (said in one line); a one-line error when not even
        one row fits. Every rank uses the largest any rank needs."""
        from deltaflow.models.compile import blocks_compiled
        from deltaflow.train import memory
        from deltaflow.train.build import has_lean_loss

        accum = self.config.grad_accum
        seq_len = getattr(self.task, "seq_len", None)
        available = memory.available_bytes(self.device)
        if isinstance(seq_len, int) and available is not None:
            if self.device.type == "cpu":  # ranks on one host share its RAM
                available //= memory.env_local_world()
            usable = int(available * memory.USABLE_FRACTION)
            hidden, layers = memory.model_shape(model)
            floats = memory.ACTIVATION_FLOATS
            # compiled here (planned before this fit) or by the caller (compile='off' then)
            if (self.compiled or blocks_compiled(model)) and self.device.type == "cuda":
                floats = memory.ACTIVATION_FLOATS_COMPILED_CUDA
            vocab = getattr(getattr(model, "config", None), "vocab_size", self.task.vocab_size)
            chunk = memory.loss_chunk_rows(model) if has_lean_loss(model) else None  # as the step

            def estimate(micro_batch: int, tokens: int = seq_len) -> memory.StepMemory:
                return memory.estimate_step(
                    num_params=sum(p.numel() for p in model.parameters()),
                    micro_batch=micro_batch,
                    seq_len=max(1, tokens // self.layout.cp_size),
                    vocab_size=vocab,
                    hidden_size=hidden,
                    num_layers=layers,
                    param_shards=self.dist.world_size if self.sharded else 1,
                    activation_floats=floats,
                    loss_chunk_rows=chunk,
                )

            try:
                accum, need, asked = memory.plan_accumulation(rows, accum, usable, estimate)
            except MemoryError:
                fits = memory.shortest_fit(usable, seq_len, lambda t: estimate(1, t))
                raise ValueError(
                    f"memory: one training step needs {estimate(1).describe()} even at "
                    f"micro-batch 1 x {seq_len} tokens x vocabulary {vocab}, more than the "
                    f"{memory._gb(usable)} usable of {memory._gb(available)} available on "
                    f"{self.device}; use a shorter --seq-len"
                    + (f" ({fits} fits)" if fits < seq_len else "")
                    + ", a smaller model or vocabulary, or a device with more memory"
                ) from None
            if accum != self.config.grad_accum:
                self.note(
                    f"memory: a step of {rows} x {seq_len} tokens needs {asked.describe()}, "
                    f"more than the {memory._gb(usable)} usable of {memory._gb(available)} "
                    f"available on {self.device}: running it as {accum} micro-batches of "
                    f"{rows // accum} (grad_accum {accum}; the same effective batch of "
                    f"{self.config.batch_size}, ~{memory._gb(need.total)} a micro-step)"
                )
        if self.dist.world_size > 1:  # the micro-steps' collectives must match on every rank
            box = torch.tensor([accum], device=self.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            accum = int(box.item())
        return accum
