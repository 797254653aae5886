"""The trainer's compiled blocks (``compile`` in the config; issue 31): the decision, the
one-time warm-up line, and the fall-back to eager with one line where compiling cannot run.

- :func:`plan_compile` decides before the model is used: ``models/compile.py`` says what the
  mode asks for on the device (``resolve_compile``: ``auto`` compiles on CUDA) and whether it
  can run (no ``.layers``, no Triton on CUDA); context
  parallelism runs eager (``DataLayout.allows_compile``); ``auto`` leaves models with softmax
  attention eager (``auto_leaves_eager``: not yet verified compiled on the GPU).
- Compiling is lazy: inductor's errors come at the first forward or backward. The first step
  of a trainer that compiles runs under :meth:`CompileMixin._train_step_first`: a failure there
  undoes the compilation, clears the partial gradients and runs the same step eager (the batch
  is a function of the step, so the run is the one ``compile='off'`` would have made). Out of
  memory is not a compile failure (eager needs more); in a distributed run the other ranks
  could be inside a collective, so there the error stops the run, naming ``--compile off``.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import nn

from deltaflow.models.compile import (
    WARMUP_SECONDS,
    auto_leaves_eager,
    compile_blocks,
    compile_obstacle,
    cuda_graphs_on,
    resolve_compile,
    uncompile_blocks,
)


def plan_compile(
    mode: str, device: torch.device, model: nn.Module, allowed: bool = True
) -> tuple[bool, str | None]:
    """(compile the blocks?, the one line to say when compiling was asked for and cannot run).

    ``allowed``: the data layout's answer (False under context parallelism, whose ``auto`` runs
    eager; ``blocks`` is refused there by ``DataLayout.allows_compile`` itself)."""
    if not resolve_compile(mode, device):
        return False, None
    if not allowed:
        reason = "context_parallel > 1 (the layers' collectives sit inside each block)"
        return False, fallback_line(reason)
    reason = compile_obstacle(model, device)
    if reason is None and mode == "auto":
        reason = auto_leaves_eager(model)
    if reason is not None:
        return False, fallback_line(reason)
    return True, None


def fallback_line(reason: str) -> str:
    """The one line a run that goes on eager says: the reason on one line, kept short."""
    reason = " ".join(reason.split())
    if len(reason) > 300:
        reason = reason[:297] + "..."
    return f"compile: running the blocks eager instead: {reason}"


def _headline(error: BaseException) -> str:
    """An error's first line, and the next one where the first only introduces it (dynamo's
    ``backend='inductor' raised:`` is followed by the compiler's own error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def warmup_line(device: torch.device) -> str:
    seconds = WARMUP_SECONDS.get(device.type, WARMUP_SECONDS["cpu"])
    return (
        f"compiling the blocks: first steps take ~{seconds} s "
        "(one graph per block, reused by every layer)"
    )


class CompileMixin:
    """The Trainer's side: ``_plan_compile`` in ``__init__`` before the memory fit (compiled
    blocks save far fewer activations), then ``_compile_model`` on the placed model (before the
    optimizer and the DDP wrapper); ``_train_step_first`` for the loop's steps."""

    def _plan_compile(self, model: nn.Module) -> None:
        allowed = self.layout.allows_compile(self.config.compile)  # refuses 'blocks' under CP
        self.compiled, line = plan_compile(self.config.compile, self.device, model, allowed)
        self.compile_fallback = line  # also recorded in the log's start event
        # the first compiled step's exception, formatted (its tail): the one line above keeps
        # only its headline; a check (benchmarks/_check_packed.py) reports the whole of it
        self.compile_error: str | None = None
        self._compile_pending = self.compiled  # the first step still to run compiled
        self.cuda_graphs = False  # blocks replayed from CUDA graphs (compile.CUDA_GRAPHS)
        if line is not None:
            self.note(line)

    def _compile_model(self) -> None:
        if self.compiled:
            # No CUDA graphs under FSDP: its hooks all-gather each block's weights into fresh
            # buffers around the block (none of it measured under graphs; DDP's reduction runs
            # on the gradients after the graphs and keeps them).
            graphs = cuda_graphs_on(self.raw_model) and not getattr(self, "sharded", False)
            compile_blocks(self.raw_model, cuda_graphs=graphs)  # in place: names unchanged
            self.cuda_graphs = graphs

    def _compile_record(self) -> dict[str, Any]:
        """The start event's fields: what the run compiles (and why not, where it fell back)."""
        record: dict[str, Any] = {"compiled_blocks": self.compiled}
        if self.cuda_graphs:
            record["cuda_graphs"] = True
        if self.compile_fallback is not None:
            record["compile_fallback"] = self.compile_fallback
        return record

    def _train_step_first(self, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``train_step``; the trainer's first compiled step falls back to eager on failure."""
        if not self._compile_pending:
            return self.train_step(step)  # type: ignore[attr-defined]
        self._compile_pending = False
        self.note(warmup_line(self.device))
        try:
            return self.train_step(step)  # type: ignore[attr-defined]
        except torch.cuda.OutOfMemoryError:
            raise  # not a compile failure: eager needs more memory, not less
        except Exception as e:  # noqa: BLE001 - any compile failure; eager re-raises real errors
            reason = f"the first compiled step failed ({type(e).__name__}: {_headline(e)})"
            self.compile_error = "".join(traceback.format_exception(e))[-4000:]
            if self.dist.world_size > 1:
                raise RuntimeError(
                    f"{' '.join(reason.split())[:300]}; other ranks may be inside a collective, "
                    "so the run stops: rerun with --compile off"
                ) from e
        uncompile_blocks(self.raw_model)
        self.compiled = self.cuda_graphs = False
        self.optimizer.zero_grad(set_to_none=True)  # what the failed step had accumulated
        self.compile_fallback = fallback_line(reason)
        self.note(self.compile_fallback)
        if self.dist.is_main:
            self.logger.log("event", step, event="compile_fallback", reason=self.compile_fallback)
        return self.train_step(step)  # type: ignore[attr-defined]
