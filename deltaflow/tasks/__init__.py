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


def get_task(name: str, **kwargs) -> Task:
    """Build a task by name (hyphens or underscores); kwargs go to its constructor."""
    key = name.strip().lower().replace("-", "_")
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[key](**kwargs)


__all__ = [
    "TASKS",
    "get_task",
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
