"""The training loop: AdamW + warmup and cosine/wsd/constant, clipping, bf16 autocast, eval,
logs, checkpoints, DDP and FSDP2.

Design choices a user should know:

- The loss is computed here from the model's logits and ALIGNED labels (``labels[t]`` is the
  target at position ``t``; -100 is unscored), as the mean over every scored token of the
  global batch. Any ``nn.Module`` whose forward takes ``input_ids=`` and returns logits
  ``[B, T, V]`` (or an object with ``.logits``) can be trained.
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
import errno
import gc
import inspect
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from deltaflow.models.compile import compile_blocks, resolve_compile
from deltaflow.parallel.data_layout import DataLayout
from deltaflow.train.checkpoint import (
    CheckpointSaveError,
    atomic_write_text,
    gather_rng_states,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_checkpoint,
    read_config,
    read_state_json,
    recover_checkpoints,
    save_checkpoint,
    save_sharded_checkpoint,
)
from deltaflow.train.config import TrainConfig
from deltaflow.train.export import clean_stale_exports, export_checkpoint, write_pretrained
from deltaflow.train.logging import RunLogger, read_log
from deltaflow.train.packing import packed_forward
from deltaflow.train.rundir import (
    RUN_CONFIG,
    archive_run,
    clean_run_temporaries,
    describe,
    has_run,
    read_run_config,
    training_differences,
    undo_interrupted_archive,
    write_run_config,
)
from deltaflow.train.safety import RunLock
from deltaflow.train.schedule import lr_at

IGNORE_INDEX = -100


class DivergenceError(RuntimeError):
    """The training loss became NaN/inf (usually: learning rate too high)."""


# ---------------------------------------------------------------------------- building blocks
def build_task(config: TrainConfig) -> Any:
    from deltaflow.tasks import get_task

    return get_task(config.task, **config.task_kwargs)


def task_vocab_size(config: TrainConfig) -> int:
    """The vocabulary of ``config``'s task, without building a language model's data."""
    if config.task == "lm":
        from deltaflow.tasks.language import get_tokenizer

        kw = config.task_kwargs
        return get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path")).vocab_size
    return build_task(config).vocab_size


def build_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    model_config = DeltaFlowConfig(vocab_size=vocab_size, **config.model)
    try:
        return DeltaFlowForCausalLM(model_config)
    except (RuntimeError, MemoryError) as err:  # torch: "can't allocate", "size ... overflowed"
        text = str(err)
        if not isinstance(err, MemoryError) and "allocate" not in text and "overflow" not in text:
            raise
        reason = text.splitlines()[0] if text else type(err).__name__
        raise ValueError(
            f"the model (hidden_size {model_config.hidden_size}, {model_config.num_layers} "
            f"layers, vocabulary {vocab_size}) is too large to create here ({reason}); "
            "make model.hidden_size or model.num_layers smaller"
        ) from None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: never norms, biases, scalars (A_log, dt_bias), embeddings."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() already de-duplicates tied weights
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_ids else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: nn.Module, config: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.adam_eps,
        fused=device.type == "cuda",
    )


def model_logits(
    model: nn.Module, input_ids: torch.Tensor, doc_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [B, T, V] from a plain module or a transformers model (no labels, no cache).
    ``doc_starts`` [B, T] (packed documents): run the rows with ``cu_seqlens`` (packing.py)."""
    kwargs: dict[str, Any] = {}
    forward = model.module.forward if hasattr(model, "module") else model.forward
    if "use_cache" in inspect.signature(forward).parameters:
        kwargs["use_cache"] = False  # training/eval never need the recurrent cache
    if doc_starts is not None:
        out = packed_forward(model, input_ids, doc_starts, **kwargs)
    else:
        out = model(input_ids=input_ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    if logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"model must return logits [B, T, V] for input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    return logits


def check_batch(batch: dict[str, torch.Tensor], batch_size: int | None = None) -> None:
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"task batch is missing {key!r} (has {sorted(batch)})")
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.ndim != 2 or labels.shape != ids.shape:
        raise ValueError(
            f"task batch must have input_ids and labels of equal shape [B, T], got "
            f"{tuple(ids.shape)} and {tuple(labels.shape)}"
        )
    if batch_size is not None and ids.shape[0] != batch_size:
        raise ValueError(f"task returned batch of {ids.shape[0]} rows, asked for {batch_size}")


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, dist_info: DistInfo) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_info.local_rank)
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r}: no CUDA GPU is available here (torch.cuda.is_available() "
                "is False); use --device cpu or auto"
            )
        if device.index is None:
            device = torch.device("cuda", dist_info.local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )
    return device


# ---------------------------------------------------------------------------- the trainer
@dataclass
class RunPlan:
    """What a trainer does with its ``out_dir`` (decided on rank 0, shared with every rank)."""

    resume: str | None = None  # checkpoint to continue
    fork: str | None = None  # checkpoint of another run to start from (a fork)
    extend_from: int | None = None  # a finished run of this many steps is being extended
    error: str | None = None
    notes: list[str] = field(default_factory=list)


class Trainer:
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
        self._owns_process_group = False
        if self.dist.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
            self._owns_process_group = True
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
        self.compiled = resolve_compile(config.compile, self.device)
        self.compiled = self.compiled and self.layout.allows_compile(config.compile)
        if self.compiled:
            compile_blocks(self.raw_model)  # in place: parameter names are unchanged
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

    def _fit_memory(self, model: nn.Module, rows: int) -> int:
        """The gradient-accumulation steps a training step needs to fit in this device's
        memory (:mod:`deltaflow.train.memory`): ``grad_accum`` when its micro-batch fits, else
        the smallest larger one that does (said in one line); a one-line error when not even
        one row fits. Every rank uses the largest any rank needs."""
        from deltaflow.train import memory

        accum = self.config.grad_accum
        seq_len = getattr(self.task, "seq_len", None)
        available = memory.available_bytes(self.device)
        if isinstance(seq_len, int) and available is not None:
            if self.device.type == "cpu":  # ranks on one host share its RAM
                available //= memory.env_local_world()
            usable = int(available * memory.USABLE_FRACTION)
            hidden, layers = memory.model_shape(model)
            vocab = getattr(getattr(model, "config", None), "vocab_size", self.task.vocab_size)

            def estimate(micro_batch: int, tokens: int = seq_len) -> memory.StepMemory:
                return memory.estimate_step(
                    num_params=sum(p.numel() for p in model.parameters()),
                    micro_batch=micro_batch,
                    seq_len=max(1, tokens // self.layout.cp_size),
                    vocab_size=vocab,
                    hidden_size=hidden,
                    num_layers=layers,
                    param_shards=self.dist.world_size if self.sharded else 1,
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

    def note(self, text: str) -> None:
        """A line for the person running this (stderr, rank 0, ``verbose`` only)."""
        if self.verbose and self.dist.is_main:
            print(text, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the run folder
    def _plan_run(self, fork_from: str | Path | None) -> RunPlan:
        """Rank 0 inspects ``out_dir`` (and may archive, clean, write run_config.yaml); every
        rank gets the same plan."""
        plan = RunPlan()
        if self.config.out_dir is not None and self.dist.is_main:
            try:
                plan = self._plan_on_main(Path(self.config.out_dir), fork_from)
            except (OSError, ValueError) as err:  # e.g. 'latest' names a missing checkpoint
                plan = RunPlan(error=str(err))
        if self.dist.world_size > 1:
            box = [plan]
            dist.broadcast_object_list(box, src=0)
            plan = box[0]
        return plan

    def _plan_on_main(self, out: Path, fork_from: str | Path | None) -> RunPlan:
        cfg = self.config
        if out.exists() and not out.is_dir():
            return RunPlan(error=f"out_dir {out} is a file; give a folder (it is created)")
        assert self._lock is not None
        self._lock.acquire()  # RunLockedError (a ValueError) names the other run's PID
        # With the lock held, every temporary file in the folder is a killed run's leftover.
        notes = undo_interrupted_archive(out)  # an archive is never left split in two
        notes += recover_checkpoints(out, keep=cfg.keep_checkpoints if cfg.resume else None)
        notes += clean_stale_exports(out) + clean_run_temporaries(out)
        plan = RunPlan(notes=notes)
        if not cfg.resume and has_run(out):
            dest = archive_run(out)
            plan.notes.append(f"--no-resume: moved the previous run of {out} to {dest}")
        latest = latest_checkpoint(out) if cfg.resume else None
        if latest is not None:
            return self._check_resume(out, latest, plan)
        if fork_from is not None:
            source = latest_checkpoint(fork_from)
            if source is None:
                return RunPlan(error=f"--fork: {fork_from} has no checkpoint to start from")
            saved = read_config(source)
            diffs = [
                d
                for d in training_differences(saved, cfg.to_dict())
                if d[0] == "task" or d[0].startswith(("task_kwargs.", "model."))
            ]
            if diffs:
                return RunPlan(
                    error=f"cannot fork {source} into {out}: its weights are for another model or "
                    f"task ({describe(diffs)}); a fork keeps model and task"
                )
            plan.fork = str(source)
            plan.notes.append(f"forking {source} into {out}: starting at its step")
        write_run_config(out, cfg.to_dict())
        return plan

    def _check_resume(self, out: Path, latest: Path, plan: RunPlan) -> RunPlan:
        cfg = self.config
        saved = read_run_config(out, latest) or {}
        state = read_state_json(latest)
        diffs = training_differences(saved, cfg.to_dict())
        old_steps = int(saved.get("steps", cfg.steps))
        trained_out = int(state["step"]) >= old_steps  # every step of the old schedule is done
        only_steps = [d for d in diffs if d[0] != "steps"] == []
        if diffs and only_steps and trained_out and cfg.steps > old_steps:
            plan.extend_from = old_steps
            plan.notes.append(
                f"extending the finished run {out} from {old_steps} to {cfg.steps} steps (the "
                f"learning-rate schedule now runs to {cfg.steps})"
            )  # run_config.yaml is rewritten once the checkpoint has loaded (train())
        elif diffs:
            steps_note = ""
            if any(d[0] == "steps" for d in diffs):
                steps_note = (
                    " (steps may only grow, and only once the run has finished: it sets the "
                    "learning-rate schedule)"
                )
            return RunPlan(
                notes=plan.notes,
                error=f"cannot resume {out}: it was trained with other settings: "
                f"{describe(diffs)}{steps_note}. Resume it with its own settings "
                f"(deltaflow train --config {out / RUN_CONFIG}), continue its latest checkpoint "
                "with the new ones in a new folder with --fork NEWDIR, or start over with "
                "--no-resume (archives it)",
            )
        plan.resume = str(latest)
        plan.notes.append(f"resuming {out} from step {state['step']}")
        return plan

    # ------------------------------------------------------------------ resume / save
    def _resume(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint (this run's, or a fork's source); returns its log bookkeeping."""
        if self.fsdp != is_sharded_checkpoint(path):
            written = "ddp" if self.fsdp else "fsdp"
            raise ValueError(
                f"cannot resume {path} with parallel={self.config.parallel!r}: it was written "
                f"by a parallel={written!r} run (resume with that, or use a new out_dir)"
            )
        if self.fsdp:
            state = load_sharded_checkpoint(
                path, model=self.raw_model, optimizer=self.optimizer, trusted=self._trust_checkpoint
            )
        else:
            state = load_checkpoint(
                path,
                model=self.raw_model,
                optimizer=self.optimizer,
                trusted=self._trust_checkpoint,
            )
        # The optimizer's state_dict carries its hyperparameters; this run's config decides.
        for i, group in enumerate(self.optimizer.param_groups):  # [decay, no_decay]
            group.update(
                betas=(self.config.beta1, self.config.beta2),
                eps=self.config.adam_eps,
                weight_decay=self.config.weight_decay if i == 0 else 0.0,
            )
        self.step = int(state["step"])
        saved_info = read_state_json(path)
        self.seconds_before = float(saved_info.get("seconds", 0.0))
        self.last_eval = dict(saved_info.get("eval") or {})
        if "window_loss" in state:
            self.window_loss = state["window_loss"].to(self.device)
            self.window_steps = int(state["window_steps"])
            self.window_tokens = int(state["window_tokens"])
        # the final checkpoint of this very run (not of a fork's source, nor of the shorter run
        # being extended): the final evaluation is in it and in the log
        self.final_eval_done = (
            self.plan.fork is None
            and bool(saved_info.get("finished"))
            and self.step >= self.config.steps
        )
        return {k: state[k] for k in ("log_records",) if k in state}

    def seconds(self) -> float:
        """Wall seconds this run has taken so far, over every trainer that resumed it (up to
        the checkpoint each resumed from: time after a run's last checkpoint is not counted)."""
        return self.seconds_before + time.perf_counter() - self._clock_start

    def save(self, info: dict[str, Any] | None = None) -> Path | None:
        """Checkpoint the current step; every rank must call it (it gathers from all ranks).
        Returns the checkpoint directory (None without out_dir, and on ranks > 0 under DDP)."""
        cfg = self.config
        if cfg.out_dir is None:
            return None
        info = {"eval": self.last_eval, **(info or {}), "seconds": round(self.seconds(), 3)}
        extra = {
            "window_loss": self.window_loss.detach().cpu().clone(),
            "window_steps": self.window_steps,
            "window_tokens": self.window_tokens,
            "log_records": len(self.logger.records),
        }
        common = dict(
            step=self.step, config=cfg.to_dict(), info=info, keep=cfg.keep_checkpoints, extra=extra
        )
        # a language model's checkpoints carry its tokenizer (generate, from_pretrained users)
        common["tokenizer"] = getattr(self.task, "tokenizer", None)
        if self.fsdp:
            return save_sharded_checkpoint(
                cfg.out_dir, model=self.raw_model, optimizer=self.optimizer, **common
            )
        rng = gather_rng_states()  # each rank resumes with its own RNG streams
        path, error = None, None
        if self.dist.is_main:
            try:
                path = save_checkpoint(
                    cfg.out_dir,
                    model=self.raw_model,
                    optimizer=self.optimizer,
                    rng_per_rank=rng,
                    **common,
                )
            except CheckpointSaveError as err:
                error = err
        if self.dist.world_size > 1:
            # no rank runs ahead (or exits) before the checkpoint is in place; a failed save
            # stops every rank
            box = [None if error is None else str(error)]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and error is None:
                error = CheckpointSaveError(errno.EIO, box[0])
        if error is not None:
            raise error
        return path

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
            with self._grad_sync(sync):
                with self._autocast():
                    logits = model_logits(self.model, x, starts)
                part = F.cross_entropy(
                    _upcast(logits).flatten(0, 1),
                    y.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
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

    # ------------------------------------------------------------------ evaluation
    def eval_lengths(self) -> tuple[list[int | None], bool]:
        """Lengths to evaluate at, and whether the headline metric is their mean."""
        if self.config.eval_lengths is not None:
            return list(self.config.eval_lengths), hasattr(self.task, "eval_lengths")
        if getattr(self.task, "eval_lengths", None):
            return list(self.task.eval_lengths), True
        return [None], False

    @torch.no_grad()
    def evaluate(self, split: str | None = None, progress: bool = False) -> dict[str, float]:
        """Metrics on the task's fixed evaluation set, per length (``name@L``) and headline.

        The headline (unsuffixed) metrics are the mean over lengths for tasks defining
        ``eval_lengths`` (state tracking: the test distribution is all of them), else the
        first length (language modelling: the training length). ``progress``: a bar per
        length (``deltaflow eval``; the trainer's own evaluations run under its step bar).
        """
        split = split or self.config.eval_split
        model = self.raw_model  # no DDP hooks in eval (rank 0 only; all ranks under FSDP)
        model.eval()
        lengths, mean_headline = self.eval_lengths()
        per_length: list[dict[str, float]] = []
        out: dict[str, float] = {}
        for length in lengths:
            kwargs = dict(self.config.eval_kwargs)
            if length is not None:
                kwargs["length"] = length
            desc = f"eval {self.config.task} {split}" + (f" @{length}" if length else "")
            metrics = self._evaluate_one(model, split, kwargs, desc if progress else None)
            per_length.append(metrics)
            if length is not None and len(lengths) > 1:
                out.update({f"{k}@{length}": v for k, v in metrics.items()})
        if mean_headline and len(per_length) > 1:
            keys = set.intersection(*(set(m) for m in per_length))
            out.update({k: sum(m[k] for m in per_length) / len(per_length) for k in sorted(keys)})
        else:
            out.update(per_length[0])
        return out

    def _evaluate_one(
        self, model: nn.Module, split: str, kwargs: dict[str, Any], bar: str | None = None
    ) -> dict[str, float]:
        """Pool the whole evaluation set exactly when the task offers ``metric_sums``/``finalize``
        (additive statistics); otherwise average per-batch ``metrics`` weighted by scored tokens."""
        pooled = hasattr(self.task, "metric_sums") and hasattr(self.task, "finalize")
        sums: dict[str, float] = {}
        total = 0
        batches = self.task.eval_batches(split, **kwargs)
        count = _eval_batch_count(self.task, kwargs) if bar is not None else None
        for batch in tqdm(
            batches, desc=bar, total=count, unit="batch", disable=bar is None, leave=False
        ):
            check_batch(batch)
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with self._autocast():
                logits = model_logits(model, batch["input_ids"], batch.get("doc_starts"))
                logits = logits.float()
            if pooled:
                stats, weight = self.task.metric_sums(logits, batch), 1
            else:
                weight = int((batch["labels"] != IGNORE_INDEX).sum())
                stats = self.task.metrics(logits, batch)
            total += weight
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        if total == 0:
            raise ValueError(f"evaluation set of task {self.config.task!r} ({split}) is empty")
        if pooled:
            return {k: float(v) for k, v in self.task.finalize(sums).items()}
        out = {k: v / total for k, v in sums.items()}
        if "loss" in out and "ppl" in out:
            out["ppl"] = math.exp(out["loss"])  # exp of the mean loss, not the mean of exps
        return out

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
            disable=not (cfg.progress and main) or self.step >= cfg.steps,
            dynamic_ncols=True,
        )
        was_finished = self.final_eval_done  # resumed from this run's final checkpoint
        window_start = time.perf_counter()
        last_save = time.perf_counter()  # for checkpoint_seconds
        try:
            with self._signal_handlers():
                while self.step < cfg.steps:
                    loss, grad_norm, tokens = self.train_step(self.step)
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
                    reason = None
                    if self.step < cfg.steps:  # the end saves anyway (below)
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
                finished = self.step >= cfg.steps
                if finished and not self.final_eval_done:
                    self.last_eval = self._eval_and_log()
                    self.save({"finished": True})
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
            raise DivergenceError(
                f"training loss is {mean_loss} at step {self.step} (lr={cfg.lr}); "
                "lower the learning rate or enable grad_clip"
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
            self.note(
                f"{out} already finished at step {self.step}: give a larger --steps to extend "
                "it, --no-resume to start over"
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

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """With ``handle_signals``: SIGINT/SIGTERM set a flag that the loop reads after the
        step in flight (it then saves and stops); a second signal quits at once."""
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self._signal is not None:
                raise KeyboardInterrupt
            self._signal = signal.Signals(signum).name
            self.note(
                f"\n{self._signal}: saving a checkpoint after the current step, then stopping "
                "(send it again to quit without saving)"
            )

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_or_due(self, last_save: float) -> tuple[str | None, bool]:
        """(why the run stops now: 'deadline', 'SIGINT', 'SIGTERM' or None; whether a timed
        checkpoint is due). Deadline and timed checkpoints act at log steps only, so a deadline
        stop never splits a log window (every trainer of a cut run ends on a log record)."""
        deadline = due = False
        if self.step % self.config.log_every == 0:
            deadline, due = self._clock_says(last_save)
        signal_name = self._signal_received()
        return ("deadline" if deadline else signal_name), due

    def _signal_received(self) -> str | None:
        """The signal that asks this run to stop, agreed by every rank (any rank's counts)."""
        if not self.handle_signals:
            return None
        if self.dist.world_size > 1:
            names = ("SIGINT", "SIGTERM")
            flag = torch.tensor(
                [float(names.index(self._signal) + 1) if self._signal in names else 0.0],
                device=self.device,
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return names[int(flag.item()) - 1] if flag.item() > 0 else None
        return self._signal

    def _clock_says(self, last_save: float) -> tuple[bool, bool]:
        """(deadline passed, timed checkpoint due); rank 0's clock decides for every rank, so
        that all ranks stop (and join the checkpoint's collectives) at the same step."""
        stop = self.deadline is not None and time.time() >= self.deadline
        due = (
            self.checkpoint_seconds is not None
            and time.perf_counter() - last_save >= self.checkpoint_seconds
        )
        timed = self.deadline is not None or self.checkpoint_seconds is not None
        if self.dist.world_size > 1 and timed:
            flags = torch.tensor([float(stop), float(due)], device=self.device)
            dist.broadcast(flags, src=0)
            stop, due = bool(flags[0]), bool(flags[1])
        return stop, due

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

    def _eval_and_log(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        with self.layout.whole_sequences():  # context parallel: each process evaluates alone
            if self.sharded:  # every rank runs the forward passes (they all-gather the weights)
                metrics = self.evaluate()
            elif self.dist.is_main:
                metrics = self.evaluate()
        if self.dist.is_main:
            self.logger.log("eval", self.step, split=self.config.eval_split, **metrics)
            self.logger.flush()
        if self.dist.world_size > 1:
            dist.barrier()
        return metrics

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


def _check_tokenizer_fits(model: nn.Module, task: Any) -> None:
    """A language task's tokenizer must not produce ids past the model's embedding."""
    tokenizer = getattr(task, "tokenizer", None)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if tokenizer is None or not isinstance(embedding, nn.Embedding):
        return
    from deltaflow.tasks.tokenizers import check_vocab_fits

    desc = str(getattr(tokenizer, "path", tokenizer.name))
    check_vocab_fits(task.vocab_size, embedding.num_embeddings, desc)


def _eval_batch_count(task: Any, kwargs: dict[str, Any]) -> int | None:
    """Batches of an evaluation set when its size and batch size are known (the bar's total;
    None: the bar counts without an ETA)."""
    try:
        defaults = inspect.signature(task.eval_batches).parameters
    except (TypeError, ValueError):
        return None
    sizes = []
    for name in ("num_examples", "batch_size"):
        default = defaults[name].default if name in defaults else None
        value = kwargs.get(name, default)
        sizes.append(value if isinstance(value, int) and value > 0 else None)
    if None in sizes:
        return None
    return math.ceil(sizes[0] / sizes[1])


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: bf16/fp16 in float32; float32 and float64 as they are (an fp64
    run keeps fp64: accumulation tests compare its gradients to ~1e-12)."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


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


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    """FSDP2's counterpart of DDP's ``no_sync``: accumulate unsharded gradients locally."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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
