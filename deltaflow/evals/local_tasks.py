"""lm-eval tasks built from a corpus's held-out documents, pointing at local files (offline).

    deltaflow lm-eval-task --from-run runs/lm --out tasks/        # the run's validation docs
    deltaflow lm-eval-task data/ --out tasks/ --name mycorpus      # or any data folder
    deltaflow eval runs/lm --lm-eval mycorpus_last_word,mycorpus_ppl --lm-eval-include tasks/

Two tasks, each a YAML plus a JSONL beside it (the YAML names the JSONL by absolute path):

- ``<name>_last_word``: LAMBADA-style last-word prediction. Passages are the last
  ``max_words`` words of held-out paragraphs of at least ``min_words`` words whose final word is
  alphabetic (trailing punctuation dropped); the model scores ``" " + last word`` after the
  rest. Metrics: ``acc`` (the word is the greedy continuation) and ``perplexity``.
- ``<name>_ppl``: rolling log-likelihood of the same held-out paragraphs: ``word_perplexity``,
  ``byte_perplexity``, ``bits_per_byte``.

The documents come from the same split rules as training (`deltaflow.tasks.corpus`), so with
the run's data options (``--from-run`` copies them) none of them was trained on.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from deltaflow.tasks.corpus import Corpus

_CORPUS_OPTIONS = ("text_field", "valid_files", "valid_fraction", "skip_empty")


def held_out_paragraphs(corpus: Corpus, min_words: int) -> list[str]:
    """Paragraphs (blank-line separated, whitespace collapsed) of the validation documents."""
    out = []
    for split, text in corpus.documents():
        if split != "valid":
            continue
        for paragraph in re.split(r"\n\s*\n", text):
            words = paragraph.split()
            if len(words) >= min_words:
                out.append(" ".join(words))
    return out


def last_word_example(paragraph: str, max_words: int) -> dict[str, str] | None:
    """``{"context", "target"}`` from the paragraph's last ``max_words`` words, or None when its
    last word is not a word (a number, a symbol, one letter)."""
    words = paragraph.split()[-max_words:]
    last = words[-1].strip(".,;:!?\"'()[]{}-_\u2019\u2018\u201c\u201d")
    if len(last) < 2 or not last.isalpha():
        return None
    return {"context": " ".join(words[:-1]), "target": " " + last}


def build_tasks(
    data: str | Path,
    out: str | Path,
    *,
    name: str = "deltaflow_corpus",
    num_examples: int = 500,
    min_words: int = 20,
    max_words: int = 80,
    seed: int = 0,
    **corpus_options: Any,
) -> list[Path]:
    """Write ``<name>_last_word`` and ``<name>_ppl`` (YAML + JSONL) into ``out``; returns the
    YAML paths. ``corpus_options``: text_field, valid_files, valid_fraction, skip_empty."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
        raise ValueError(f"name must be letters, digits and _ (an lm-eval task name), got {name!r}")
    if num_examples < 1 or min_words < 2 or max_words < min_words:
        raise ValueError(
            "need num_examples >= 1, min_words >= 2 and max_words >= min_words, got "
            f"{num_examples}, {min_words}, {max_words}"
        )
    unknown = sorted(set(corpus_options) - set(_CORPUS_OPTIONS))
    if unknown:
        raise ValueError(f"unknown corpus options {unknown}; known: {list(_CORPUS_OPTIONS)}")
    import numpy as np

    from deltaflow.tasks.corpus import Corpus

    corpus = Corpus(data, **corpus_options)
    paragraphs = held_out_paragraphs(corpus, min_words)
    examples = [e for e in (last_word_example(p, max_words) for p in paragraphs) if e]
    if not examples:
        raise ValueError(
            f"data {data}: no held-out paragraph of at least {min_words} words ending in a word; "
            "lower --min-words or hold out more documents"
        )
    rng = np.random.default_rng(seed)
    keep = sorted(rng.permutation(len(examples))[:num_examples].tolist())
    examples = [examples[i] for i in keep]
    texts = [{"text": e["context"] + e["target"]} for e in examples]

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = f"held-out documents of {Path(data).resolve()}"
    last_word = _write_task(
        out,
        f"{name}_last_word",
        examples,
        {
            "output_type": "loglikelihood",
            "doc_to_text": "{{context}}",
            "doc_to_target": "{{target}}",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            ],
        },
        source,
    )
    ppl = _write_task(
        out,
        f"{name}_ppl",
        texts,
        {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": False}
                for m, agg in (
                    ("word_perplexity", "weighted_perplexity"),
                    ("byte_perplexity", "weighted_perplexity"),
                    ("bits_per_byte", "bits_per_byte"),
                )
            ],
        },
        source,
    )
    return [last_word, ppl]


def _write_task(
    out: Path, task: str, records: list[dict[str, str]], spec: dict[str, Any], source: str
) -> Path:
    data = out / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    config = {
        "task": task,
        "dataset_path": "json",  # datasets' JSON builder: no hub, no download
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        **spec,
        "metadata": {"version": 1.0, "description": f"{len(records)} examples from {source}"},
    }
    path = out / f"{task}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


# ---------------------------------------------------------------------------- command line
def add_lm_eval_task_parser(sub: argparse._SubParsersAction) -> None:
    from deltaflow.cli import COMMANDS

    p = sub.add_parser(
        "lm-eval-task",
        help=COMMANDS["lm-eval-task"][0],
        description="Write <name>_last_word and <name>_ppl lm-eval tasks (YAML + JSONL) from "
        "the held-out documents of a corpus; evaluate with deltaflow eval RUN --lm-eval TASKS "
        "--lm-eval-include OUT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("data", nargs="?", help="data folder or file (as --data-dir of train)")
    p.add_argument(
        "--from-run",
        help="take the data path and split options from this run (or checkpoint) folder, so "
        "the examples are that run's validation documents",
    )
    p.add_argument("--out", required=True, help="folder for the YAML and JSONL files")
    p.add_argument("--name", default="deltaflow_corpus", help="task name prefix")
    p.add_argument("--num-examples", type=int, default=500, help="examples per task")
    p.add_argument(
        "--min-words", type=int, default=20, help="held-out paragraphs of at least this many words"
    )
    p.add_argument(
        "--max-words", type=int, default=80, help="an example: a paragraph's last N words"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the example choice")
    p.add_argument(
        "--task-arg",
        dest="task_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="corpus option: text_field, valid_files, valid_fraction, skip_empty (repeatable)",
    )
    p.set_defaults(func=cmd_lm_eval_task)


def cmd_lm_eval_task(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {}
    data = args.data
    if args.from_run:
        from deltaflow.train import TrainConfig, resolve_checkpoint

        config = TrainConfig.from_yaml(resolve_checkpoint(args.from_run) / "config.yaml")
        if config.task != "lm":
            raise ValueError(f"--from-run {args.from_run} is a {config.task!r} run, not 'lm'")
        kw = config.task_kwargs
        options = {k: kw[k] for k in _CORPUS_OPTIONS if k in kw}
        data = data or kw.get("data_dir")
    if data is None:
        raise ValueError("give the data folder (DATA) or --from-run RUN")
    for item in args.task_args:
        if "=" not in item:
            raise ValueError(f"--task-arg {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        options[key] = yaml.safe_load(raw)
    paths = build_tasks(
        data,
        args.out,
        name=args.name,
        num_examples=args.num_examples,
        min_words=args.min_words,
        max_words=args.max_words,
        seed=args.seed,
        **options,
    )
    for path in paths:
        print(path)
    written = len(paths[0].with_suffix(".jsonl").read_text(encoding="utf-8").splitlines())
    found = ""
    if written < args.num_examples:
        found = (
            f" (asked for {args.num_examples}: the held-out documents have only {written} "
            f"paragraphs of >= {args.min_words} words; lower --min-words or hold out more "
            "documents for more)"
        )
    print(f"wrote {written} examples per task{found}", file=sys.stderr)
    tasks = ",".join(p.stem for p in paths)
    run = shlex.quote(str(args.from_run)) if args.from_run else "<your run folder>"
    out = shlex.quote(str(args.out))
    print(f"evaluate: deltaflow eval {run} --lm-eval {tasks} --lm-eval-include {out}")
    return 0
