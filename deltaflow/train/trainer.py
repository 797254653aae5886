"""The training loop: AdamW + warmup and cosine/wsd/constant, clipping, bf16 autocast, eval,
logs, checkpoints, DDP and FSDP2.

Design choices a user should know:

- The loss is the token cross-entropy of ALIGNED labels (``labels[t]`` is the target at
  position ``t``; -100 is unscored), as the mean over every scored token of the global batch.
  Any ``nn.Module`` whose forward takes ``input_ids=`` and returns logits ``[B, T, V]`` (or an
  object with ``.logits``) can be trained: the loss is then taken from its logits. A model
  that computes the loss itself chunk by chunk (DeltaFlowForCausalLM: ``build.has_lean_loss``)
  is given the labels instead, and the [B, T, V] logits are never built (issue 31: 9 GB of an
  H100 step at B=8, T=2048, V=32000); the loss and gradients are the same.
- Data comes from ``task.get_batch(batch_size, split="train", step=i)``, deterministic in the
  step. Every rank draws the same global batch and keeps its own rows, so a run's result does
  not depend on the number of GPUs or accumulation micro-steps (up to float rounding), and a
  resumed run sees exactly the batches it would have seen.
- The learning rate is a pure function of the step; resuming restores weights, optimizer and
  RNG state and the step counter, which on CPU reproduces an uninterrupted run bit for bit.
- A run may be given a wall-clock ``deadline`` (and ``checkpoint_seconds``): it then stops
  cleanly, with a checkpoint, once the deadline has passed, and checkpoints every so many
  seconds. Both act only at log steps (``step % log_every == 0``), so a resumed run logs the
  same loss curve as an uninterrupted one (a log window is never split by a stop).
- Under ``torchrun`` (WORLD_SIZE > 1) the model is wrapped in DistributedDataParallel
  automatically; only rank 0 logs, evaluates and checkpoints. With ``parallel="fsdp"`` it is
  sharded with FSDP2 instead (each rank holds 1/world_size of weights, gradients and optimizer
  state); every rank then takes part in evaluation (the forward all-gathers weights) and in
  the sharded checkpoint, and rank 0 still does all the logging.
- ``context_parallel = N`` splits every sequence along T over groups of N ranks (delta-rule
  models; ``deltaflow/parallel/data_layout.py``): the world is data-parallel groups x N.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from deltaflow.models.modeling import check_batch_token_ids, token_ids_checked
from deltaflow.parallel.data_layout import DataLayout
from deltaflow.train.build import (
    IGNORE_INDEX,
    _check_tokenizer_fits,
    _upcast,
    build_model,
    build_task,
    check_batch,
    has_lean_loss,
    lean_loss_sum,
    make_optimizer,
    model_logits,
    param_groups,  # noqa: F401 -- in build.py since issue 36, still importable from here
    task_vocab_size,  # noqa: F401
)
from deltaflow.train.checkpoint import atomic_write_text, latest_checkpoint
from deltaflow.train.compiling import CompileMixin
from deltaflow.train.config import TrainConfig
from deltaflow.train.dist import (
    DistInfo,
    _fsdp_no_sync,
    join_process_group,
    resolve_device,
)
from deltaflow.train.early_stop import EarlyStopMixin
from deltaflow.train.evaluation import EvaluationMixin
from deltaflow.train.export import export_checkpoint, write_pretrained
from deltaflow.train.logging import RunLogger, read_log
from deltaflow.train.memory import MemoryFitMixin
from deltaflow.train.rundir import write_run_config
from deltaflow.train.runfolder import RunFolderMixin, RunPlan  # noqa: F401 (RunPlan: old import)
from deltaflow.train.safety import RunLock
from deltaflow.train.schedule import lr_at
from deltaflow.train.stopping import StoppingMixin


class DivergenceError(RuntimeError):
    """The training loss became NaN/inf (usually: learning rate too high)."""


# ---------------------------------------------------------------------------- the trainer
class Trainer(
    RunFolderMixin, EvaluationMixin, EarlyStopMixin, StoppingMixin, MemoryFitMixin, CompileMixin
):
    """Train ``model`` on ``task`` as ``config`` says. Builds both from the config if not given.

    ``callbacks`` are called as ``fn(trainer, step)`` after every completed optimizer step
    (after any checkpoint of that step); raising from one stops the run like a kill would.

    ``deadline`` (a ``time.time()`` value): at the first log step past it, checkpoint and stop;
    ``train()`` then returns with ``finished`` False, and a new Trainer on the same ``out_dir``
    continues from that step. ``checkpoint_seconds``: checkpoint at the first log step after
    that many seconds since the last checkpoint, so a hard kill loses at most that much
    (default: ``config.ckpt_minutes``). Neither changes what is trained; both need ``out_dir``.

    The run folder (``config.out_dir``) belongs to one config (:mod:`deltaflow.train.rundir`):
    resuming with another training-relevant setting raises ``ValueError`` naming the
    differences; ``resume=False`` moves an old run to ``out_dir/archive/<time>/``.
    ``fork_from``: a run folder whose latest checkpoint (weights, optimizer, step, RNG) starts
    this run when ``out_dir`` has none yet; once it has, ``out_dir`` is resumed as usual.

    ``handle_signals``: SIGINT (Ctrl-C) and SIGTERM make ``train()`` save the current step and
    return with ``finished`` False and ``stopped`` set to the signal's name (a second signal
    quits at once). ``verbose``: say on stderr what happens to the run folder (resuming,
    archived, cleaned). ``trust_checkpoint``: resume a sharded checkpoint whose signed manifest
    does not verify (see :mod:`deltaflow.train.manifest`). ``export_final``: write a finished
    run's model as a ``save_pretrained`` folder, ``out_dir/final/`` (transformers models only).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module | None = None,
        task: Any | None = None,
        callbacks: list[Callable[[Trainer, int], None]] | None = None,
        deadline: float | None = None,
        checkpoint_seconds: float | None = None,
        fork_from: str | Path | None = None,
        handle_signals: bool = False,
        verbose: bool = False,
        trust_checkpoint: bool = False,
        export_final: bool = True,
    ) -> None:
        self._clock_start = time.perf_counter()
        self.config = config
        self.callbacks = list(callbacks or [])
        if checkpoint_seconds is not None and not checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be > 0 (or None), got {checkpoint_seconds}")
        self.deadline = deadline
        if checkpoint_seconds is None and config.ckpt_minutes > 0:
            checkpoint_seconds = 60.0 * config.ckpt_minutes
        self.checkpoint_seconds = checkpoint_seconds
        self.handle_signals = handle_signals
        self.verbose = verbose
        self.export_final = export_final
        self.seconds_before = 0.0  # wall seconds spent on this run by earlier (resumed) trainers
        self.dist = DistInfo.from_env()
        self._owns_process_group = join_process_group(self.dist)
        # Before anything expensive: may this run use out_dir, and how? Rank 0 locks out_dir
        # for the life of the run (released at the end of train() and by close()).
        self._lock = RunLock(config.out_dir) if config.out_dir is not None else None
        self.plan = self._plan_run(fork_from)
        for note in [*self.plan.notes, config.warmup_note()]:
            if note is not None:
                self.note(note)
        if self.plan.error is not None:
            self._release_lock()
            raise ValueError(self.plan.error)
        self.device = resolve_device(config.device, self.dist)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # context_parallel > 1: cp ranks share rows and split their tokens (parallel/data_layout.py)
        self.layout = DataLayout.create(
            config.context_parallel, self.dist.rank, self.dist.world_size
        )
        dp = self.layout.dp_size
        per_rank, rem = divmod(config.batch_size, dp * config.grad_accum)
        if rem or per_rank == 0:
            raise ValueError(
                f"batch_size={config.batch_size} must be a positive multiple of "
                f"world_size ({self.dist.world_size}) / context_parallel "
                f"({config.context_parallel}) x grad_accum ({config.grad_accum})"
            )
        self.micro_batch = per_rank
        use_bf16 = config.precision == "bf16" or (
            config.precision == "auto" and self.device.type == "cuda"
        )
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        # fsdp: sharded model (on > 1 rank) and sharded checkpoints (always, so a run can be
        # resumed on any number of GPUs); ddp: replicated model, rank 0 writes checkpoints.
        self.fsdp = config.parallel == "fsdp"
        self.sharded = self.fsdp and self.dist.world_size > 1

        torch.manual_seed(config.seed)  # identical init on every rank (DDP also broadcasts)
        self.task = task if task is not None else build_task(config)
        base = model if model is not None else build_model(config, self.task.vocab_size)
        _check_tokenizer_fits(base, self.task)
        self.lean_loss = has_lean_loss(base)  # the loss without the logits (and its memory)
        self._plan_compile(base)  # compiled blocks, or eager with one line why (compiling.py)
        rows = config.batch_size // dp  # this rank's rows of a step
        accum = self._fit_memory(base, rows)  # before the first step, not by the OOM killer
        if accum != config.grad_accum:
            self.config = config = config.replace(grad_accum=accum)
            self.micro_batch = rows // accum
        self.layout.attach(base)
        if self.sharded:
            from deltaflow.parallel.fsdp import shard_model

            bf16_weights = use_bf16 and self.device.type == "cuda"
            self.raw_model = shard_model(base, self.device, bf16=bf16_weights)
        else:
            self.raw_model = base.to(self.device)
        self._compile_model()  # as planned above
        # After sharding: the optimizer must hold the sharded (DTensor) parameters.
        self.optimizer = make_optimizer(self.raw_model, config, self.device)
        self.step = 0  # number of optimizer steps completed
        # The log window still open (steps since the last 'train' record): checkpointed, so a
        # resumed run logs the same means as an uninterrupted one whatever ckpt_every is.
        self.window_loss = torch.zeros((), device=self.device)
        self.window_steps = 0
        self.window_tokens = 0
        self.last_eval: dict[str, float] = {}
        self.final_eval_done = False  # resumed from a finished run's final checkpoint
        # the step at which the evaluation reached config.early_stop (the run then ended)
        self.stopped_early_at: int | None = None
        self.stopped: str | None = None  # name of the signal that stopped the run
        self._signal: str | None = None
        self._trust_checkpoint = trust_checkpoint

        start = self.plan.resume or self.plan.fork
        log_state: dict[str, Any] = {}
        if start is not None:
            try:
                log_state = self._resume(Path(start))
            except BaseException:  # a refused checkpoint: the folder is free for a retry
                self._release_lock()
                raise
        log_dir = config.out_dir if self.dist.is_main else None
        sinks = dict(
            tensorboard=config.tensorboard, wandb=config.wandb, run_config=config.to_dict()
        )
        if self.plan.fork is not None:
            source = Path(self.plan.fork).parents[1]  # <run>/checkpoints/step_N -> <run>
            kept = _kept_records(source, log_state, self.step)
            self.logger = RunLogger(log_dir, start_records=kept, **sinks)
            if self.dist.is_main:
                self.logger.log("event", self.step, event="fork", source=str(self.plan.fork))
        else:
            self.logger = RunLogger(
                log_dir,
                resume_step=self.step if start is not None else None,
                keep_records=log_state.get("log_records"),
                **sinks,
            )

        self.model: nn.Module = self.raw_model  # FSDP2 shards in place: no wrapper
        if self.dist.world_size > 1 and not self.fsdp:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.raw_model, device_ids=ids)
        self.num_params = sum(p.numel() for p in self.raw_model.parameters())

    def note(self, text: str) -> None:
        """A line for the person running this (stderr, rank 0, ``verbose`` only)."""
        if self.verbose and self.dist.is_main:
            print(text, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ one step
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step."""
        if sync:
            return contextlib.nullcontext()
        if self.fsdp:
            return _fsdp_no_sync(self.model)
        return self.model.no_sync()

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step on the global batch of ``step``; returns (loss, grad norm, tokens)."""
        cfg = self.config
        batch = self.task.get_batch(cfg.batch_size, split="train", step=step)
        check_batch(batch, cfg.batch_size)
        ids, labels = batch["input_ids"], batch["labels"]
        doc_starts = batch.get("doc_starts")  # packed documents (a CPU tensor, like ids)
        if doc_starts is not None and self.layout.cp_size > 1:
            raise ValueError(
                "context_parallel > 1 does not support packed documents yet: set the task's "
                "pack=false (the rows then run as plain sequences)"
            )
        n_scored = max(1, int((labels != IGNORE_INDEX).sum()))  # over the GLOBAL batch
        # The token ids checked here on the CPU batch (free) instead of by the model on the GPU
        # (a host sync each for ids and labels, which would keep the host from queuing this
        # step while the GPU still runs the last one)
        checked = check_batch_token_ids(self.raw_model, ids, labels)
        ids_context = token_ids_checked if checked else contextlib.nullcontext
        lr = lr_at(
            step,
            base_lr=cfg.lr,
            total_steps=cfg.steps,
            warmup_steps=cfg.resolved_warmup_steps,
            min_lr_ratio=cfg.min_lr_ratio,
            schedule=cfg.schedule,
            decay_fraction=cfg.decay_fraction,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        rank_rows = cfg.batch_size // self.layout.dp_size
        start = self.layout.dp_rank * rank_rows
        for micro in range(cfg.grad_accum):
            lo = start + micro * self.micro_batch
            x = self.layout.tokens(ids[lo : lo + self.micro_batch]).to(
                self.device, non_blocking=True
            )
            y = self.layout.tokens(labels[lo : lo + self.micro_batch]).to(
                self.device, non_blocking=True
            )
            starts = None if doc_starts is None else doc_starts[lo : lo + self.micro_batch]
            sync = micro == cfg.grad_accum - 1 or self.dist.world_size == 1
            if self.cuda_graphs:  # each micro-batch: the last one's graph outputs are done with
                torch.compiler.cudagraph_mark_step_begin()
            with self._grad_sync(sync), ids_context():
                part = self._loss_sum(x, y, starts)
                # DDP and FSDP average gradients over ranks: scale by world_size to get the sum.
                (part * (self.dist.world_size / n_scored)).backward()
            loss_sum += part.detach()
        if self.dist.world_size > 1:
            dist.all_reduce(loss_sum)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()  # FSDP: already reduced over ranks (Replicate)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / n_scored, grad_norm, ids.numel()

    def _loss_sum(
        self, x: torch.Tensor, y: torch.Tensor, doc_starts: torch.Tensor | None
    ) -> torch.Tensor:
        """The cross-entropy of a micro-batch summed over its scored labels: by the model
        itself where it can (no [B, T, V] logits), else from its logits in float32 (whose last
        reference ends here, so they are freed before backward: log-softmax saves its own
        output, not its input)."""
        if self.lean_loss:
            with self._autocast():
                return lean_loss_sum(self.model, x, y, doc_starts)
        with self._autocast():
            logits = model_logits(self.model, x, doc_starts)
        return F.cross_entropy(
            _upcast(logits).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    # ------------------------------------------------------------------ the loop
    def _data_passes(self) -> dict[str, float]:
        """Passes over a finite training split (language modelling), warned about above one:
        past it the training loss falls away from the validation loss (memorising)."""
        if not hasattr(self.task, "train_passes"):
            return {}  # synthetic tasks draw fresh examples (or say their size in their config)
        passes = self.task.train_passes(self.config.steps, self.config.batch_size)
        if passes is None:
            return {}  # a streamed split: its size is unknown
        if passes > 1:
            warnings.warn(
                f"{self.config.steps} steps x batch {self.config.batch_size} read the training "
                f"split ~{passes:.1f} times (random windows): expect memorising, a training loss "
                "well below the validation loss; pass a larger corpus or fewer steps for one pass",
                stacklevel=2,
            )
        return {"train_passes": passes}

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def train(self) -> dict[str, Any]:
        """Run (or continue) training to ``config.steps``; returns a summary dict. The run
        folder stays locked until it returns (or raises)."""
        if self._lock is not None and self.dist.is_main:
            self._lock.acquire()  # again, for a second train() of this trainer
        try:
            return self._train()
        finally:
            self._release_lock()

    def _train(self) -> dict[str, Any]:
        cfg = self.config
        main = self.dist.is_main
        passes = self._data_passes() if main and self.step == 0 else {}  # warns past one pass
        if main and self.step == 0 and cfg.out_dir is not None:
            self.logger.log(
                "event",
                0,
                event="start",
                num_params=self.num_params,
                config=cfg.to_dict(),
                **passes,
                **self._compile_record(),
            )
        elif main and self.plan.extend_from is not None:
            write_run_config(cfg.out_dir, cfg.to_dict())
            (Path(cfg.out_dir) / "final.json").unlink(missing_ok=True)  # not finished any more
            self.logger.log("event", self.step, event="extend", steps=cfg.steps)
        elif main and self.step > 0 and self.plan.resume is not None:
            self.logger.log("event", self.step, event="resume")
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            desc=f"train {cfg.task}",
            unit="step",
            disable=not (cfg.progress and main) or self.step >= cfg.steps or self.final_eval_done,
            dynamic_ncols=True,
        )
        was_finished = self.final_eval_done  # resumed from this run's final checkpoint
        window_start = time.perf_counter()
        last_save = time.perf_counter()  # for checkpoint_seconds
        try:
            with self._signal_handlers():
                while self.step < cfg.steps and self.stopped_early_at is None:
                    loss, grad_norm, tokens = self._train_step_first(self.step)
                    self.step += 1
                    self.window_loss += loss
                    self.window_steps += 1
                    self.window_tokens += tokens
                    bar.update(1)
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                        self._log_window(grad_norm, tokens, window_start, bar)
                        window_start = time.perf_counter()
                    if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                        self.last_eval = self._eval_and_log()
                        if self._early_stop_reached(self.last_eval):
                            self.stopped_early_at = self.step
                            if self.window_steps:  # the log ends on this step's record
                                self._log_window(grad_norm, tokens, window_start, bar)
                    reason = None
                    # the end saves anyway (below), an early stop's end too
                    if self.step < cfg.steps and self.stopped_early_at is None:
                        reason, due = self._stop_or_due(last_save)
                        if reason is not None and main:  # before the save: the record is kept
                            self.logger.log("event", self.step, event="stop", reason=reason)
                        step_due = cfg.ckpt_every and self.step % cfg.ckpt_every == 0
                        if step_due or due or reason is not None:
                            self.save()
                            self.logger.flush()
                            last_save = time.perf_counter()
                    for callback in self.callbacks:
                        callback(self, self.step)
                    if reason is not None:
                        self.stopped = None if reason == "deadline" else reason
                        break
                    if self.stopped_early_at is not None:
                        break
                early = self.stopped_early_at
                finished = self.step >= cfg.steps or early is not None
                if finished and not self.final_eval_done:
                    if early is None:
                        self.last_eval = self._eval_and_log()
                        self.save({"finished": True})
                    else:  # evaluated at this very step: the final checkpoint carries it
                        self.save({"finished": True, "stopped_early_at": early})
                    self.final_eval_done = True
        finally:
            bar.close()
            self.logger.close()
        summary = {
            "step": self.step,
            "finished": finished,  # False: stopped at the deadline or by a signal (resumable)
            "seconds": self.seconds(),
            "num_params": self.num_params,
            "train_loss": next((r["loss"] for r in reversed(self.logger.of_kind("train"))), None),
            "eval": self.last_eval,
        }
        if self.stopped is not None:
            summary["stopped"] = self.stopped
        if self.stopped_early_at is not None:  # finished before config.steps: early_stop
            summary["stopped_early_at"] = self.stopped_early_at
        if finished and cfg.out_dir is not None:
            with self._signal_handlers():  # a signal now waits for the final files
                summary = self._finish(summary, was_finished)
        return summary

    def _log_window(
        self, grad_norm: torch.Tensor, tokens: int, window_start: float, bar: Any
    ) -> None:
        """The mean loss of the steps since the last record; resets the window."""
        cfg = self.config
        mean_loss = float(self.window_loss) / self.window_steps
        if not math.isfinite(mean_loss):
            advice = "lower the learning rate" + (
                " or enable grad_clip" if not cfg.grad_clip else ""
            )
            raise DivergenceError(
                f"training loss is {mean_loss} at step {self.step} (lr={cfg.lr}, "
                f"grad_clip={cfg.grad_clip}); {advice}"
            )
        elapsed = time.perf_counter() - window_start
        record = self.logger.log(
            "train",
            self.step,
            loss=mean_loss,
            grad_norm=float(grad_norm),
            lr=self.optimizer.param_groups[0]["lr"],
            tokens_per_s=self.window_tokens / max(elapsed, 1e-9),
            tokens=self.step * tokens,
            **self._peak_memory(),
        )
        bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{record['tokens_per_s']:.3g}")
        self.window_loss.zero_()
        self.window_steps, self.window_tokens = 0, 0

    def _finish(self, summary: dict[str, Any], was_finished: bool) -> dict[str, Any]:
        """A finished run's outputs: the model as a save_pretrained folder (``final/``), then
        ``final.json`` (the last file: a run killed before it redoes these on its next start).
        A run that was already finished (and has both) returns its recorded summary."""
        out = Path(self.config.out_dir)
        path = out / "final.json"
        final_dir = out / "final"
        exportable = self.export_final and _is_pretrained(self.raw_model)
        done = was_finished and path.is_file() and (final_dir.is_dir() or not exportable)
        recorded = json.loads(path.read_text()) if done else {}
        if done and recorded.get("step") == self.step:
            how = "give a larger --steps to extend it"
            if self.stopped_early_at is not None:  # ended by early_stop: more steps cannot help
                how = f"it stopped early ({self.config.early_stop}): --fork NEWDIR trains on"
            self.note(
                f"{out} already finished at step {self.step}: {how}, --no-resume to start over"
            )
            return {**recorded, "already_finished": True}
        if exportable:
            if self.sharded:
                if self.dist.is_main:
                    export_checkpoint(latest_checkpoint(out), final_dir, guard=False)
            elif self.dist.is_main:
                write_pretrained(self.raw_model, final_dir, self.config.to_dict())
            if self.dist.world_size > 1:
                dist.barrier()
        if self.dist.is_main:
            atomic_write_text(path, json.dumps(summary, indent=2))
        return summary

    def _peak_memory(self) -> dict[str, list[float]]:
        """``peak_mem_gb``: each rank's peak allocated GPU memory so far (CUDA only)."""
        if self.device.type != "cuda":
            return {}
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30])
        peak = peak.to(self.device)
        if self.dist.world_size > 1:
            every = [torch.empty_like(peak) for _ in range(self.dist.world_size)]
            dist.all_gather(every, peak)
            peak = torch.cat(every)
        return {"peak_mem_gb": [round(float(x), 3) for x in peak]}

    def close(self, clean: bool = True) -> None:
        """Release the DDP wrapper and leave the process group this trainer created.

        Order matters: a gloo worker thread frees each finished collective's tensors under the
        GIL, while a process group destroyed by its last reference (DDP's reducer, garbage-
        collected later) joins those threads holding the GIL: a deadlock seen on 2-core
        machines. So a barrier first (all earlier work freed), then the wrapper goes while the
        group is still registered, then the group. ``clean=False`` (after an error) skips the
        barrier: the other ranks may be inside another collective."""
        self._release_lock()
        distributed = self.dist.world_size > 1 and dist.is_initialized()
        if clean and distributed:
            dist.barrier()
        if self.model is not self.raw_model:
            self.model = self.raw_model
            gc.collect()  # the DistributedDataParallel wrapper and its reducer go now
        if self._owns_process_group and distributed:
            dist.destroy_process_group()


def _is_pretrained(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _kept_records(run_dir: Path, log_state: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """A forked run's log starts with its source's records up to the checkpoint it forks."""
    if not (run_dir / "log.jsonl").is_file():
        return []
    records = read_log(run_dir)
    count = log_state.get("log_records")
    if count is not None:
        return records[:count]
    return [r for r in records if r.get("step", 0) <= step]  # checkpoints before log counts


def train_and_close(trainer: Trainer) -> dict[str, Any]:
    """``trainer.train()``, then ``trainer.close()``; after an error (Ctrl-C included)
    ``close(clean=False)``, which skips the barrier, and the error goes on."""
    try:
        summary = trainer.train()
    except BaseException:
        trainer.close(clean=False)
        raise
    trainer.close()
    return summary


def train(config: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Build everything from ``config``, train, return the summary. See :class:`Trainer`."""
    return train_and_close(Trainer(config, **kwargs))
