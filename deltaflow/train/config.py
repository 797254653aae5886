"""Training configuration: one flat dataclass, loadable from YAML, overridable from the CLI.

A config names a task (``deltaflow.tasks.get_task(task, **task_kwargs)``) and a model
(``DeltaFlowConfig(vocab_size=task.vocab_size, **model)``); everything else is optimization,
evaluation and I/O. ``batch_size`` is the GLOBAL batch (summed over data-parallel ranks and
gradient-accumulation micro-steps), so a run gives the same result on 1 or 8 GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deltaflow.train.early_stop import EarlyStop, check_early_stop
from deltaflow.train.schedule import SCHEDULES, effective_warmup
from deltaflow.validation import (
    check_bool,
    check_float,
    check_int,
    check_known_keys,
    check_str,
    describe,
)

SPLITS = ("train", "valid", "test")


def _field(default: Any = dataclasses.MISSING, help: str = "", **meta: Any) -> Any:
    """A dataclass field with its help text (``deltaflow train --help`` is built from these).

    ``meta``: ``group`` (help section), ``flag`` (CLI spelling; default ``--field-name``),
    ``cli=False`` (no flag of its own: reached with ``--set``), ``factory`` (mutable default),
    ``runtime=True`` (the field says how a run is executed or watched, not what it trains: it
    may change when a run is resumed, :func:`runtime_fields`), ``in_run_id=False`` (a runtime
    field that came after lab grids were committed: left out of their run ids,
    :func:`fields_left_out_of_run_ids`).
    """
    factory = meta.pop("factory", None)
    if meta.get("in_run_id", True) is False and not meta.get("runtime"):
        # a field that changes what is trained must change the run's id
        raise ValueError("in_run_id=False is for runtime=True fields only")
    metadata = {"help": help, **meta}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    # --- what to train
    task: str = _field(
        "mqar",
        "task name: mqar, parity, mod_arith, mod_arith_brackets, s5, lm, in_context_recall, "
        "fuzzy_recall, noisy_recall, selective_copy, compress, memorize",
        group="task",
    )
    task_kwargs: dict[str, Any] = _field(
        help="task constructor arguments", factory=dict, cli=False, group="task"
    )
    model: dict[str, Any] = _field(
        help="DeltaFlowConfig arguments except vocab_size (taken from the task)",
        factory=dict,
        cli=False,
        group="model",
    )
    # --- optimization
    steps: int = _field(1000, "optimizer steps", group="optimization")
    batch_size: int = _field(
        64, "GLOBAL batch: all GPUs x all accumulation micro-steps", group="optimization"
    )
    grad_accum: int = _field(
        1,
        "gradient-accumulation micro-steps per step (raised, with a note, when a step of "
        "batch_size does not fit in the device's memory)",
        group="optimization",
        runtime=True,
    )
    lr: float = _field(1e-3, "peak learning rate (AdamW)", group="optimization")
    schedule: str = _field(
        "cosine",
        "learning rate after warmup: cosine (to min_lr_ratio x lr), wsd (warmup-stable-decay: "
        "lr until the last decay_fraction of the steps, then linear to min_lr_ratio x lr) or "
        "constant",
        group="optimization",
        choices=list(SCHEDULES),
    )
    decay_fraction: float = _field(
        0.2, "wsd: fraction of the steps spent decaying", group="optimization"
    )
    min_lr_ratio: float = _field(
        0.1, "floor of the cosine and wsd decay, as a fraction of lr", group="optimization"
    )
    warmup_steps: int | None = _field(
        None,
        "linear warmup steps (default: steps / 20; more than steps: the whole run, with a note)",
        group="optimization",
    )
    weight_decay: float = _field(
        0.1,
        "decoupled AdamW weight decay; never on norms, biases, embeddings",
        group="optimization",
    )
    beta1: float = _field(0.9, "AdamW beta1", group="optimization")
    beta2: float = _field(0.95, "AdamW beta2", group="optimization")
    adam_eps: float = _field(1e-8, "AdamW epsilon", group="optimization")
    grad_clip: float = _field(
        1.0, "max global gradient norm (0: no clipping)", group="optimization"
    )
    # --- evaluation
    eval_every: int = _field(
        0, "evaluate every N steps (0: only at the end)", group="evaluation", runtime=True
    )
    eval_split: str = _field(
        "valid",
        "split evaluated during training",
        group="evaluation",
        runtime=True,
        choices=list(SPLITS),
    )
    eval_lengths: list[int] | None = _field(
        None,
        "comma-separated lengths, e.g. 512,1024 (default: the task's own, else its seq_len)",
        group="evaluation",
        runtime=True,
    )
    eval_kwargs: dict[str, Any] = _field(
        help="evaluation-set options, e.g. {num_examples: 512, batch_size: 128}",
        factory=dict,
        cli=False,
        group="evaluation",
        runtime=True,
    )
    early_stop: str | None = _field(
        None,
        "stop once the headline evaluation metric reaches a threshold, checked at every "
        "evaluation (eval_every): METRIC>=X or METRIC<=X (quote it in a shell), e.g. "
        "'accuracy>=0.99' (Zoology's MQAR protocol) or 'loss<=1.2'; the run then ends "
        "finished at that step, final checkpoint and export written (default: off)",
        group="evaluation",
        metavar="METRIC>=X",
    )
    # --- I/O and runtime
    out_dir: str | None = _field(
        None,
        "run directory: config, logs, checkpoints; resumed if it has checkpoints "
        "(default: none, nothing written)",
        flag="--out",
        metavar="DIR",
        group="runtime",
        runtime=True,
    )
    log_every: int = _field(
        10, "log the mean training loss every N steps", group="runtime", runtime=True
    )
    ckpt_every: int = _field(
        0,
        "checkpoint every N steps (0: no step-based checkpoints; --ckpt-minutes still applies)",
        group="runtime",
        runtime=True,
    )
    ckpt_minutes: float = _field(
        10.0,
        "wall-clock minutes between checkpoints (at log steps), so a killed run loses minutes, "
        "not the run; 0 disables (the end, Ctrl-C and SIGTERM always save)",
        group="runtime",
        runtime=True,
        in_run_id=False,
    )
    keep_checkpoints: int = _field(
        2, "newest checkpoints kept in --out", group="runtime", runtime=True
    )
    resume: bool = _field(
        True,
        "continue from --out's latest checkpoint when there is one (--no-resume: a run already "
        "in --out is moved to --out/archive/<time>/)",
        group="runtime",
        runtime=True,
    )
    seed: int = _field(0, "seed of the initialisation (and of the task's data)", group="runtime")
    device: str = _field(
        "auto",
        "auto (cuda:LOCAL_RANK if a GPU is there, else cpu), cpu, cuda, cuda:N",
        group="runtime",
        runtime=True,
    )
    precision: str = _field(
        "auto",
        "auto (bf16 autocast on cuda, fp32 on cpu), bf16 or fp32",
        group="runtime",
        choices=["auto", "bf16", "fp32"],
    )
    progress: bool = _field(
        True, "progress bar with rate and ETA (rank 0)", group="runtime", runtime=True
    )
    tensorboard: bool = _field(
        False,
        "also log to TensorBoard (<out>/tensorboard; needs the tensorboard package)",
        group="runtime",
        runtime=True,
        in_run_id=False,
    )
    wandb: bool = _field(
        False,
        "also log to Weights & Biases (<out>/wandb), offline unless WANDB_MODE is set",
        group="runtime",
        runtime=True,
        in_run_id=False,
    )
    parallel: str = _field(
        "ddp",
        "under torchrun: ddp (replicated model) or fsdp (FSDP2: sharded model and sharded "
        "checkpoints that resume on any number of GPUs)",
        group="runtime",
        runtime=True,
        choices=["ddp", "fsdp"],
    )
    context_parallel: int = _field(
        1,
        "under torchrun: groups of N ranks split every sequence along T (long sequences; "
        "delta-rule models only); world = data-parallel ranks x N",
        group="runtime",
        runtime=True,
        in_run_id=False,
        metavar="N",
    )
    compile: str = _field(
        "auto",
        "torch.compile every model block (fused glue, selective activation checkpointing); "
        "auto: blocks on CUDA, eager on CPU; a run that cannot compile goes on eager with one "
        "line why",
        group="runtime",
        runtime=True,
        in_run_id=False,
        choices=["auto", "blocks", "off"],
    )

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Types of every field, then ranges, then the task and model sections and the
        cross-field rules. Raises a one-line ``ValueError`` / ``TypeError`` naming the field."""
        hints = field_types()
        self.early_stop = check_early_stop(self.early_stop)  # before the str check
        for f in dataclasses.fields(self):
            setattr(self, f.name, _check_type(f.name, getattr(self, f.name), hints[f.name]))

        def positive(name: str) -> None:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "log_every",
            "keep_checkpoints",
            "context_parallel",
        ):
            positive(name)
        for name in ("eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of grad_accum "
                f"({self.grad_accum}): every micro-step takes batch_size / grad_accum rows"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.ckpt_minutes >= 0:
            raise ValueError(f"ckpt_minutes must be >= 0 (0: off), got {self.ckpt_minutes}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1, beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.compile not in ("auto", "blocks", "off"):
            raise ValueError(f"compile must be 'auto', 'blocks' or 'off', got {self.compile!r}")
        if self.eval_split not in SPLITS:
            raise ValueError(f"eval_split must be one of {SPLITS}, got {self.eval_split!r}")
        check_device_name(self.device)
        if self.eval_lengths is not None and not all(n > 0 for n in self.eval_lengths):
            raise ValueError(f"eval_lengths must be positive, got {self.eval_lengths}")
        if self.early_stop is not None and self.eval_every == 0:
            raise ValueError(
                f"early_stop {self.early_stop!r} is checked at each evaluation: set "
                "eval_every > 0 (with eval_every 0 the run evaluates only at its end)"
            )
        self._validate_sections()

    @property
    def early_stop_rule(self) -> EarlyStop | None:
        """``early_stop`` parsed (None: off)."""
        return None if self.early_stop is None else EarlyStop.parse(self.early_stop)

    def _validate_sections(self) -> None:
        """task_kwargs / eval_kwargs against the task's signatures (for registered tasks: a
        Trainer may be given a task object of its own), model against DeltaFlowConfig."""
        from deltaflow.tasks import TASKS, check_task_kwargs, eval_options, task_argument_types

        key = self.task.strip().lower().replace("-", "_")
        if key in TASKS:
            # required arguments (lm's data_dir) are checked when the task is built: a
            # Trainer may be handed the task object itself
            check_task_kwargs(self.task, self.task_kwargs, require=False)
            hints = task_argument_types(TASKS[key])
            for name, value in self.task_kwargs.items():  # checked, kept as given
                if name in hints:
                    _check_type(f"task_kwargs.{name}", value, hints[name])
            check_known_keys("eval_kwargs", self.eval_kwargs, eval_options(TASKS[key]))
            if self.early_stop is not None:
                EarlyStop.parse(self.early_stop).check_task(self.task, TASKS[key])
        if "vocab_size" in self.model:
            raise ValueError("model.vocab_size is taken from the task; remove it from the config")
        if self.model:
            check_model_section(self.model)

    @property
    def resolved_warmup_steps(self) -> int:
        """Warmup steps used: ``warmup_steps`` (default steps / 20), at most ``steps``."""
        warmup = self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)
        return effective_warmup(warmup, self.steps)

    def warmup_note(self) -> str | None:
        """The one line said when a warmup longer than the run is shortened to it."""
        if self.warmup_steps is None or self.warmup_steps <= self.steps:
            return None
        return (
            f"warmup_steps {self.warmup_steps} > steps {self.steps}: warming up over the whole "
            f"run ({self.steps} steps, no decay); set warmup_steps below {self.steps} to keep one"
        )

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise TypeError(f"a train config must be a mapping, got {describe(data)}")
        errors = unknown_key_errors(data)
        if errors:  # every typo of a config at once, not one per attempt
            raise ValueError("; ".join(errors))
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a config file must be a YAML mapping of config fields")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{path}: {err}") from None

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (nested dicts are copied, not shared)."""
        data = self.to_dict()
        data.update(changes)
        return TrainConfig.from_dict(data)


def unknown_key_errors(data: dict[str, Any]) -> list[str]:
    """One message per place of a config dict with unknown keys (the top level, a registered
    task's arguments and eval_kwargs, the model section), each with its did-you-mean."""
    from deltaflow.tasks import TASKS, check_task_kwargs, eval_options

    def model_keys(model: dict[str, Any]) -> None:
        from deltaflow.models.config import own_keys

        check_known_keys("model", model, own_keys() - {"vocab_size"})

    def task_keys(task: Any, kwargs: Any) -> None:
        key = task.strip().lower().replace("-", "_")
        if key not in TASKS:  # a Trainer may be handed a task object of its own
            return
        check_task_kwargs(task, kwargs if isinstance(kwargs, dict) else {}, require=False)
        if isinstance(data.get("eval_kwargs"), dict):
            check_known_keys("eval_kwargs", data["eval_kwargs"], eval_options(TASKS[key]))

    checks = [lambda: check_known_keys("config", data, TrainConfig.__dataclass_fields__)]
    if isinstance(data.get("model"), dict):
        checks.append(lambda: model_keys(data["model"]))
    task = data.get("task", TrainConfig.__dataclass_fields__["task"].default)
    if isinstance(task, str):
        checks.append(lambda: task_keys(task, data.get("task_kwargs", {})))
    errors = []
    for check in checks:
        try:
            check()
        except ValueError as err:
            errors.append(str(err))
    return errors


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; a missing file or a syntax error is a one-line error naming the
    file (and the line and column of the error)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {path} {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not a UTF-8 text file ({err.reason} at byte {err.start})"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML: {_yaml_error_text(err)}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the
    last silently: ``lr: 1e-3`` further down a file would override an earlier one unseen)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_error_text(err: yaml.YAMLError) -> str:
    """``line 3, column 7: mapping values are not allowed here`` from a PyYAML error."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def parse_value(key: str, raw: str) -> Any:
    """A ``--set`` / ``--task-arg`` value, parsed as YAML (``3``, ``1e-3``, ``true``, ``[1, 2]``);
    a syntax error names the key."""
    if raw == "":
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ValueError(f"{key}={raw}: invalid value ({_yaml_error_text(err)})") from None


def check_device_name(name: str) -> str:
    """``auto`` or a torch device string (``cpu``, ``cuda``, ``cuda:1``); availability is
    checked when the device is used (a config may be written for another machine)."""
    import torch

    if name == "auto":
        return name
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"device {name!r} is not a device: use auto, cpu, cuda or cuda:N"
        ) from None
    return name


def check_model_section(model: dict[str, Any]) -> None:
    """A train config's ``model`` section: DeltaFlowConfig's own arguments only (no
    transformers bookkeeping keys), each of the right type, and a buildable whole."""
    from deltaflow.models.config import DeltaFlowConfig, own_keys

    check_known_keys("model", model, own_keys() - {"vocab_size"})
    try:
        DeltaFlowConfig(vocab_size=2, **model)
    except (ValueError, TypeError) as err:
        raise type(err)(f"model: {err}") from None


@functools.cache
def runtime_fields() -> frozenset[str]:
    """The TrainConfig fields marked ``runtime=True``: how a run is executed, watched or split
    (evaluation, logging, checkpointing, placement), not what it trains. A resumed run may
    change them (:func:`deltaflow.train.rundir.training_differences` skips them)."""
    return frozenset(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("runtime"))


def fields_left_out_of_run_ids() -> tuple[str, ...]:
    """The runtime fields marked ``in_run_id=False``: they came after lab grids were committed,
    so :class:`deltaflow.lab.grid.RunSpec` leaves them out of its ids and committed grids keep
    theirs. The older runtime fields stay in the ids (dropping them would rename every
    committed run)."""
    return tuple(
        f.name
        for f in dataclasses.fields(TrainConfig)
        if f.metadata.get("runtime") and f.metadata.get("in_run_id", True) is False
    )


def field_types() -> dict[str, Any]:
    """TrainConfig's field annotations, evaluated (``int | None``, ``list[int] | None``, ...)."""
    return typing.get_type_hints(TrainConfig)


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the field's annotation (and a numeric string converted for
    float fields: YAML 1.1 reads ``3e-4`` as a string)."""
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(hint) if a is not type(None)] if is_union else [hint]
    allow_none = is_union and type(None) in typing.get_args(hint)
    if value is None and allow_none:
        return None
    if len(options) != 1:
        return value  # e.g. str | os.PathLike: left to the code that uses it
    base = options[0]
    if base is bool:
        return check_bool(name, value)
    if base is int:
        return check_int(name, value)
    if base is float:
        return check_float(name, value)
    if base is str:
        return check_str(name, value)
    origin = typing.get_origin(base)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a mapping (key: value), got {describe(value)}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{name}: keys must be strings, got {bad[0]!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(base)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise TypeError(f"{name} must be a list, got {describe(value)}")
        if item is int:
            for i, v in enumerate(value):
                check_int(f"{name}[{i}]", v)
        return value
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``model.key=value`` overrides; values are parsed as YAML scalars.

    ``--set model.rule=efla --set eval_lengths=[64,128]`` reaches any field, nested or not.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value or section.key=value")
        key, raw = item.split("=", 1)
        value = parse_value(key.strip(), raw)
        parts = key.strip().split(".")
        if len(parts) == 1:
            out[parts[0]] = value
        elif len(parts) == 2:
            section = out.setdefault(parts[0], {})
            if not isinstance(section, dict):
                raise ValueError(f"override {item!r}: {parts[0]!r} is not a section")
            section[parts[1]] = value
        else:
            raise ValueError(f"override {item!r}: at most one level of nesting (section.key)")
    return out
