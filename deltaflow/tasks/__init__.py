"""deltaflow.tasks: the lab's synthetic tasks and text data.

    from deltaflow.tasks import get_task, TASKS
    task = get_task("mqar", seq_len=256, num_kv_pairs=16, vocab_size=8192, seed=0)
    batch = task.get_batch(64, split="train", step=0)   # input_ids, labels: [B, T]
    task.metrics(logits, batch)                          # accuracy, scaled_accuracy, loss, ...

Tasks: mqar (Zoology); the six MAD tasks in_context_recall, fuzzy_recall, noisy_recall,
selective_copy, compress, memorize; state tracking parity, mod_arith, mod_arith_brackets, s5
(arXiv 2411.12537); lm (language modelling on local documents: .txt, .jsonl, .parquet or a saved
`datasets` folder; byte, GPT-2 or Hugging Face tokenizers). See docs/tasks.md.
"""

import inspect
import typing
from typing import Any

from deltaflow.tasks.base import IGNORE_INDEX, Task
from deltaflow.tasks.language import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    LanguageModeling,
    get_tokenizer,
)
from deltaflow.tasks.mad import (
    Compress,
    FuzzyRecall,
    InContextRecall,
    Memorize,
    NoisyRecall,
    SelectiveCopy,
)
from deltaflow.tasks.mqar import MQAR
from deltaflow.tasks.state_tracking import (
    S5,
    ModularArithmetic,
    ModularArithmeticBrackets,
    Parity,
)
from deltaflow.validation import check_known_keys, did_you_mean

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        MQAR,
        InContextRecall,
        FuzzyRecall,
        NoisyRecall,
        SelectiveCopy,
        Compress,
        Memorize,
        Parity,
        ModularArithmetic,
        ModularArithmeticBrackets,
        S5,
        LanguageModeling,
    )
}


def task_class(name: str) -> type[Task]:
    """The task class of a name (hyphens or underscores); a one-line error for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"task must be a task name (a string), got {name!r}")
    key = name.strip().lower().replace("-", "_")
    if key not in TASKS:
        raise ValueError(
            f"unknown task {name!r}{did_you_mean(key, TASKS)}; choose one of {sorted(TASKS)}"
        )
    return TASKS[key]


def task_arguments(cls: type) -> tuple[set[str], set[str]] | None:
    """(every argument, required arguments) of a task constructor, following ``**kw`` that is
    passed on to the parent class; None when a constructor takes arbitrary keywords."""
    names: set[str] = set()
    required: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters
        for n, p in params.items():
            if n == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            names.add(n)
            if p.default is p.empty:
                required.add(n)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return names, required
    return None  # **kw all the way up: cannot tell


def task_argument_types(cls: type) -> dict[str, Any]:
    """Annotated types of a task's constructor arguments (along the ``**kw`` chain), for
    checking a config's task_kwargs before the task is built."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            found = typing.get_type_hints(init)
        except (NameError, TypeError):  # an annotation that cannot be evaluated: skip it
            continue
        hints.update({k: v for k, v in found.items() if k != "return"})
    return hints


def check_task_kwargs(name: str, kwargs: dict, *, require: bool = True) -> None:
    """Raise a one-line ``ValueError`` for an unknown task, an unknown argument of it (with a
    did-you-mean) or (``require``) a missing required argument, before anything is built."""
    cls = task_class(name)
    args = task_arguments(cls)
    if args is None:
        return
    known, required = args
    check_known_keys(f"task {cls.name!r} (task_kwargs)", kwargs, known)
    missing = sorted(required - set(kwargs))
    if missing and require:
        arg = missing[0]
        raise ValueError(
            f"task {cls.name!r} needs task_kwargs.{arg} (deltaflow train: --task-arg {arg}=VALUE"
            + (", or --data-dir PATH: a folder or file of documents)" if arg == "data_dir" else ")")
        )


def eval_options(cls: type) -> set[str]:
    """Keys ``eval_batches`` of a task accepts (``eval_kwargs`` of a train config)."""
    options = set()
    for method in (cls.eval_batches, cls._sample):
        for n, p in inspect.signature(method).parameters.items():
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                options.add(n)
    return options - {"self", "split", "n", "g"}


def get_task(name: str, **kwargs) -> Task:
    """Build a task by name (hyphens or underscores); kwargs go to its constructor."""
    cls = task_class(name)
    check_task_kwargs(name, kwargs)
    return cls(**kwargs)


__all__ = [
    "TASKS",
    "get_task",
    "check_task_kwargs",
    "eval_options",
    "task_argument_types",
    "Task",
    "IGNORE_INDEX",
    "MQAR",
    "InContextRecall",
    "FuzzyRecall",
    "NoisyRecall",
    "SelectiveCopy",
    "Compress",
    "Memorize",
    "Parity",
    "ModularArithmetic",
    "ModularArithmeticBrackets",
    "S5",
    "LanguageModeling",
    "ByteTokenizer",
    "BPETokenizer",
    "HFTokenizer",
    "get_tokenizer",
]
