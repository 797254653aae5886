"""What a Trainer does with its run folder: the plan (resume, fork, extend, archive, refuse),
loading a checkpoint into it, saving one (a mixin of :class:`deltaflow.train.trainer.Trainer`)."""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from deltaflow.train.checkpoint import (
    CheckpointSaveError,
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
from deltaflow.train.export import clean_stale_exports
from deltaflow.train.rng import gather_rng_states
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


@dataclass
class RunPlan:
    """What a trainer does with its ``out_dir`` (decided on rank 0, shared with every rank)."""

    resume: str | None = None  # checkpoint to continue
    fork: str | None = None  # checkpoint of another run to start from (a fork)
    extend_from: int | None = None  # a finished run of this many steps is being extended
    error: str | None = None
    notes: list[str] = field(default_factory=list)


class RunFolderMixin:
    """A Trainer's run folder: what to do with it (``_plan_run``), loading and saving."""

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
        early = state.get("stopped_early_at") if state.get("finished") else None
        if diffs and only_steps and early is not None:
            return RunPlan(
                notes=plan.notes,
                error=f"cannot resume {out} with other steps: it stopped early at step {early} "
                f"(early_stop {saved.get('early_stop')}), finished; continue its final "
                "checkpoint in a new folder with --fork NEWDIR (e.g. with another early_stop), "
                "or start over with --no-resume (archives it)",
            )
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
        early = saved_info.get("stopped_early_at")  # finished there by early_stop
        self.final_eval_done = (
            self.plan.fork is None
            and bool(saved_info.get("finished"))
            and (self.step >= self.config.steps or early is not None)
        )
        if self.final_eval_done and early is not None:
            self.stopped_early_at = int(early)  # a finished run: resuming trains no further
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
