"""The ``deltaflow`` command line: train, eval, generate, export, compare, stability.

    deltaflow train --task mqar --rule efla --decay --steps 2000 --out runs/efla
    deltaflow train --config configs/mqar_efla.yaml --lr 3e-4 --set model.qk_norm=l2
    deltaflow eval runs/efla                       # latest checkpoint of a run directory
    deltaflow export runs/efla --out exported/efla # a transformers save_pretrained folder
    deltaflow generate runs/lm --prompt "It is a truth" --max-new-tokens 100
    deltaflow eval runs/lm --lm-eval lambada_openai   # lm-evaluation-harness tasks
    deltaflow compare                              # the main job: quick CPU preset (<= 2 min)
    deltaflow compare --preset mqar_512 --device cuda --out results/mqar_512

``train``'s flags are derived from the fields of :class:`deltaflow.train.TrainConfig` (name, type
and help are declared once, there), plus shortcuts for common task and model keys; precedence
is defaults < ``--config`` file < flags < ``--set key=value``. Errors in what the user gave
(bad flags, configs, files, devices) are one line ``deltaflow CMD: error: ...`` with exit code 2;
``--traceback`` (or ``DELTAFLOW_DEBUG=1``) shows the full trace instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shlex
import sys
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import yaml

from deltaflow.validation import did_you_mean


# The rule and backend names come from the op (deltaflow.rules, deltaflow.ops.checks), which
# import torch: looked up when the train parser is built, so `deltaflow --help` stays light.
def _rule_help() -> str:
    from deltaflow.rules import RULES

    return "step rule: " + ", ".join(RULES)


def _backend_choices() -> list[str]:
    from deltaflow.ops.checks import BACKENDS

    return list(BACKENDS)


# Shortcut flags for the most used keys of the task and model sections. The keys themselves are
# declared by the task classes and DeltaFlowConfig (and checked there); every other key is
# reached with --task-arg / --set. flag -> (section, key, argparse keywords)
_SECTION_FLAGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "--seq-len": ("task_kwargs", "seq_len", dict(type=int, help="training sequence length")),
    "--num-kv-pairs": ("task_kwargs", "num_kv_pairs", dict(type=int, help="MQAR key-value pairs")),
    "--vocab-size": (
        "task_kwargs",
        "vocab_size",
        dict(type=int, help="synthetic task vocabulary (the model's is the task's)"),
    ),
    "--data-dir": (
        "task_kwargs",
        "data_dir",
        dict(
            help="lm: folder (or file) of .txt, .jsonl or .parquet documents, or a "
            "datasets.save_to_disk folder"
        ),
    ),
    "--tokenizer": (
        "task_kwargs",
        "tokenizer",
        dict(help="lm: byte | bpe | hf, or a Hugging Face tokenizer folder or a .tiktoken file"),
    ),
    "--tokenizer-path": (
        "task_kwargs",
        "tokenizer_path",
        dict(help="lm: the .tiktoken file (--tokenizer bpe) or folder (hf)"),
    ),
    "--rule": (
        "model",
        "rule",
        dict(help=_rule_help),
    ),
    "--decay": (
        "model",
        "use_decay",
        dict(
            action=argparse.BooleanOptionalAction,
            help="gated variant: data-dependent decay (Gated DeltaNet style)",
        ),
    ),
    "--negative-eigenvalues": (
        "model",
        "negative_eigenvalues",
        dict(
            action=argparse.BooleanOptionalAction,
            help="transition eigenvalues in (-1, 1] instead of [0, 1] (alias --neg-eig)",
        ),
    ),
    "--beta-activation": (
        "model",
        "beta_activation",
        dict(choices=["sigmoid", "softplus"], help="step size β activation"),
    ),
    "--hidden-size": ("model", "hidden_size", dict(type=int, help="model width (default 512)")),
    "--num-layers": ("model", "num_layers", dict(type=int, help="blocks (default 8)")),
    "--num-heads": ("model", "num_heads", dict(type=int, help="heads per layer (default 4)")),
    "--head-dim": (
        "model",
        "head_dim",
        dict(type=int, help="key dim per head (default hidden_size / num_heads)"),
    ),
    "--attn-every": (
        "model",
        "attn_every",
        dict(type=int, help="every k-th layer softmax attention (1: a Transformer)"),
    ),
    "--backend": (
        "model",
        "backend",
        dict(choices=_backend_choices, help="delta_rule backend"),
    ),
}
_FLAG_ALIASES = {"--negative-eigenvalues": ["--neg-eig"]}
_GROUP_TITLES = {
    "task": "task",
    "model": "model (any other DeltaFlowConfig key: --set model.KEY=VALUE)",
    "optimization": "optimization",
    "evaluation": "evaluation",
    "runtime": "logging, checkpoints, runtime",
}


def _kv(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def _int_list(text: str) -> list[int]:
    """``512,1024`` -> [512, 1024] (argparse names the flag in its error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 512,1024, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _int_at_least(minimum: int, expected: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else "expected <expected>, got ..."."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _device(text: str) -> str:
    from deltaflow.train.config import check_device_name

    try:
        return check_device_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _threads_flag(p: argparse.ArgumentParser) -> None:
    from deltaflow.train.cpu import DEFAULT_THREADS_HELP

    p.add_argument("--threads", type=_positive_int, metavar="N", help=DEFAULT_THREADS_HELP)


def _trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a checkpoint that has no manifest.json (or one that does not verify) "
        "unchecked: only a folder whose writer you trust",
    )


def _config_flags() -> list[tuple[str, dataclasses.Field, dict[str, Any]]]:
    """(flag, field, argparse keywords) for every TrainConfig field that has a flag: the
    flags are derived from the dataclass, so a field and its help are declared once."""
    from deltaflow.train.config import TrainConfig, field_types

    hints = field_types()
    out = []
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        if meta.get("cli", True) is False:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        kwargs: dict[str, Any] = {"dest": f"cfg_{f.name}", "default": None}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" not in meta:
            kwargs["metavar"] = meta.get("metavar", f.name.upper())
        if typing.get_origin(base) is list:
            kwargs["type"] = _int_list
        elif base in (int, float):
            kwargs["type"] = base
        if f.name == "device":
            kwargs["type"] = _device
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        help_text = meta.get("help", "")
        default = "" if f.default in (None, dataclasses.MISSING) else f" (default: {f.default})"
        kwargs["help"] = help_text + ("" if "default" in help_text else default)
        out.append((flag, f, kwargs))
    return out


# ---------------------------------------------------------------------------- train
def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help=COMMANDS["train"][0],
        description="Train a model on a task. Precedence: defaults < --config < flags < --set. "
        "On CPU keep models small (e.g. --hidden-size 128 --num-layers 2): the default "
        "model (512 wide, 8 layers) is sized for a GPU.",
    )
    p.add_argument("--config", type=Path, help="YAML file of TrainConfig fields")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. lr=3e-4 or model.qk_norm=l2 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    _threads_flag(p)
    groups = {name: p.add_argument_group(title) for name, title in _GROUP_TITLES.items()}
    for flag, f, kwargs in _config_flags():
        groups.get(f.metadata.get("group"), groups["runtime"]).add_argument(flag, **kwargs)
    groups["task"].add_argument(
        "--task-arg",
        dest="task_args",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="task constructor argument (repeatable)",
    )
    for flag, (section, key, kwargs) in _SECTION_FLAGS.items():
        group = groups["task" if section == "task_kwargs" else "model"]
        # help and choices may be functions of the op's tables (see _rule_help)
        kwargs = {
            n: v() if n in ("help", "choices") and callable(v) else v for n, v in kwargs.items()
        }
        if kwargs.get("action") is None and "choices" not in kwargs:
            kwargs = {"metavar": key.upper(), **kwargs}
        group.add_argument(flag, *_FLAG_ALIASES.get(flag, []), dest=f"{section}.{key}", **kwargs)
    groups["model"].add_argument(
        "--qk-norm",
        metavar="NORM",
        help="'l2' | 'none' | 'Q,K' e.g. 'l2,none' (default: per rule)",
    )
    groups["runtime"].add_argument(
        "--fork",
        metavar="NEWDIR",
        help="train in NEWDIR, starting from --out's latest checkpoint (weights, optimizer, "
        "step) with this command's settings, e.g. another --lr; the same command resumes it",
    )
    groups["runtime"].add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="resume a checkpoint that has no manifest.json or whose (for FSDP: signed) "
        "manifest does not verify, unchecked: only for folders whose writer you trust",
    )
    p.set_defaults(func=cmd_train)


def resolve_train_config(args: argparse.Namespace) -> Any:
    from deltaflow.train import TrainConfig, apply_overrides
    from deltaflow.train.config import parse_value

    if args.config is None:
        data = TrainConfig().to_dict()
    else:
        data = TrainConfig.from_yaml(args.config).to_dict()
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for _, f, _ in _config_flags():
        value = getattr(args, f"cfg_{f.name}", None)
        if value is not None:
            data[f.name] = value
    for section, key, _ in _SECTION_FLAGS.values():
        value = getattr(args, f"{section}.{key}", None)
        if value is not None:
            data[section][key] = value
    if args.qk_norm is not None:
        parts = args.qk_norm.split(",")
        data["model"]["qk_norm"] = parts[0] if len(parts) == 1 else parts
    for item in args.task_args:
        key, raw = item.split("=", 1)
        data["task_kwargs"][key] = parse_value(f"--task-arg {key}", raw)
    data = apply_overrides(data, args.overrides)
    config = TrainConfig.from_dict(data)
    from deltaflow.tasks import TASKS  # a Trainer may be handed its own task; the CLI may not

    if config.task.strip().lower().replace("-", "_") not in TASKS:
        raise ValueError(
            f"--task: unknown task {config.task!r}{did_you_mean(config.task, TASKS)}; "
            f"known: {', '.join(TASKS)}"
        )
    return config


def cmd_train(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer
    from deltaflow.train.cpu import CpuTimeCheck, count_parameters, set_threads, warn_if_gpu_sized
    from deltaflow.train.trainer import DistInfo, resolve_device, train_and_close

    config = resolve_train_config(args)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if config.out_dir is not None:
        check_out_dir(config.out_dir, "--out")
    device = resolve_device(config.device, DistInfo.from_env())  # one-line error if absent
    set_threads(args.threads, device)
    callbacks = []
    main_rank = int(os.environ.get("RANK", 0)) == 0
    if device.type == "cpu" and main_rank:
        vocab = _vocab_size(config)
        num_params = count_parameters(config, vocab)
        gpu_sized = warn_if_gpu_sized(config, vocab, num_params)
        callbacks.append(CpuTimeCheck(config, vocab, num_params, gpu_sized))
    fork_from = None
    if args.fork is not None:
        if config.out_dir is None or not config.resume:
            raise ValueError("--fork NEWDIR needs --out (the run to fork) and no --no-resume")
        fork_from, config = config.out_dir, config.replace(out_dir=args.fork)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        trainer = Trainer(
            config,
            fork_from=fork_from,
            handle_signals=True,
            verbose=True,
            trust_checkpoint=args.trust_checkpoint,
            callbacks=callbacks,
        )
    except KeyboardInterrupt:
        print("interrupted before training started: nothing to save", file=sys.stderr)
        return 130
    try:
        summary = train_and_close(trainer)
    except KeyboardInterrupt:  # a second Ctrl-C: quit without saving
        print(
            f"interrupted at step {trainer.step}; the last checkpoint is kept, resume with: "
            f"{_resume_command(args.argv)}",
            file=sys.stderr,
        )
        return 130
    if summary.get("stopped") and rank0:
        if config.out_dir is None:
            print(f"stopped at step {summary['step']} (no --out: nothing saved)", file=sys.stderr)
        else:
            resume = _resume_command(args.argv)
            print(f"saved step {summary['step']}, resume with: {resume}", file=sys.stderr)
        return 0
    if rank0:
        print(json.dumps(summary, indent=2))
    return 0


def check_out_dir(path: str | os.PathLike, flag: str) -> None:
    """An output folder must be a folder (or not exist yet): not a file, nor under one."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"is under {p}, which is a file"
                raise ValueError(f"{flag} {path} {what}; give a folder")
            if not os.access(p, os.W_OK):
                raise ValueError(f"{flag} {path}: cannot write to {p} (permission denied)")
            return


def _resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same one, without --no-resume (which would
    archive the run just saved). A fork's command resumes the fork (NEWDIR has a checkpoint)."""
    kept = [a for a in argv if a != "--no-resume"]
    return "deltaflow " + " ".join(shlex.quote(a) for a in kept)


# ---------------------------------------------------------------------------- eval / generate
def _load_trained(path: str, device: str, trusted: bool = False) -> tuple[Any, Any, Path]:
    """(config, model with checkpoint weights, checkpoint dir) for a run or checkpoint dir;
    the checkpoint's files are checked against its manifest before any is read."""
    from deltaflow.train import TrainConfig, build_model, load_checkpoint, resolve_checkpoint
    from deltaflow.train.checkpoint import read_config, verify_checkpoint
    from deltaflow.train.trainer import DistInfo, resolve_device

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder or a checkpoint")
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt, trusted=trusted)
    config = TrainConfig.from_dict(read_config(ckpt)).replace(device=device, out_dir=None)
    vocab = _vocab_size(config, ckpt)
    model = build_model(config, vocab).to(resolve_device(device, DistInfo()))
    try:
        load_checkpoint(ckpt, model=model, restore_rng=False, trusted=True)  # verified above
    except Exception as err:  # safetensors' and torch's error types differ between versions
        name = _unreadable_file(err)
        if name is None:
            raise
        reason = _one_line(err).split(". ")[0]
        raise ValueError(
            f"{ckpt / name} cannot be read ({reason}): the file is truncated or corrupt; use "
            "another checkpoint (RUN/checkpoints/step_N) or train again"
        ) from None
    model.eval()
    return config, model, ckpt


def _unreadable_file(err: Exception) -> str | None:
    """The checkpoint file a load error says is corrupt or truncated, or None for any other
    error (a genuine bug keeps its traceback)."""
    text = f"{type(err).__module__}.{type(err).__name__}: {err}".lower()
    if "safetensor" in text or "deserializing header" in text:
        return "model.safetensors"
    if "pytorchstreamreader" in text or "zip archive" in text or "unpickling" in text:
        return "trainer_state.pt"
    return None


def _resolved_device(name: str) -> Any:
    """The torch device ``--device`` names here (a one-line error when it is not available)."""
    from deltaflow.train.trainer import DistInfo, resolve_device

    return resolve_device(name, DistInfo())


def _vocab_size(config: Any, ckpt: Path | None = None) -> int:
    """The vocabulary of the model a config builds: from a checkpoint's saved tokenizer, the
    config's tokenizer (language modelling, before training) or the task."""
    if config.task == "lm":
        from deltaflow.tasks.tokenizers import get_tokenizer, run_tokenizer

        kw = config.task_kwargs
        if ckpt is not None:
            return run_tokenizer(ckpt, kw).vocab_size
        return get_tokenizer(kw.get("tokenizer", "byte"), kw.get("tokenizer_path")).vocab_size
    from deltaflow.train import build_task

    return build_task(config).vocab_size


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help=COMMANDS["eval"][0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint dir or run dir (uses its latest checkpoint)")
    p.add_argument(
        "--split", default="valid", choices=["train", "valid", "test"], help="split to evaluate"
    )
    p.add_argument(
        "--task-arg",
        dest="task_args",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="change a task argument, e.g. seq_len=1024",
    )
    p.add_argument(
        "--eval-lengths", type=_int_list, help="comma-separated lengths, e.g. 512,1024,2048"
    )
    p.add_argument(
        "--num-examples", type=_positive_int, help="evaluation examples (default: the run's)"
    )
    p.add_argument("--batch-size", type=_positive_int, help="evaluation batch (default: the run's)")
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    _threads_flag(p)
    p.add_argument("--json", action="store_true", help="print metrics as JSON")
    _trust_flag(p)
    p.add_argument(
        "--output",
        metavar="FILE",
        help="also write the metrics (with --lm-eval: lm-eval's results per task) to FILE as JSON",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (lm-eval draws its own)"
    )
    g = p.add_argument_group("lm-evaluation-harness (pip install 'deltaflow[eval]')")
    g.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="comma-separated lm-eval tasks (e.g. lambada_openai,hellaswag) instead of the "
        "run's own task; --batch-size is requests per forward",
    )
    g.add_argument(
        "--lm-eval-include",
        action="append",
        metavar="DIR",
        help="folder of task YAMLs (e.g. from deltaflow lm-eval-task); repeatable",
    )
    g.add_argument("--limit", type=float, help="lm-eval: examples per task (< 1: a fraction)")
    g.add_argument("--num-fewshot", type=int, help="lm-eval: few-shot examples")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from deltaflow.train import Trainer, build_task
    from deltaflow.train.config import parse_value
    from deltaflow.train.cpu import set_threads

    set_threads(args.threads, _resolved_device(args.device))
    if args.lm_eval:
        return _cmd_lm_eval(args)

    config, model, ckpt = _load_trained(args.checkpoint, args.device, args.trust_checkpoint)
    changes: dict[str, Any] = {"resume": False, "progress": False}
    task_kwargs = dict(config.task_kwargs)
    for item in args.task_args:
        key, raw = item.split("=", 1)
        task_kwargs[key] = parse_value(f"--task-arg {key}", raw)
    changes["task_kwargs"] = task_kwargs
    eval_kwargs = dict(config.eval_kwargs)
    if args.num_examples is not None:
        eval_kwargs["num_examples"] = args.num_examples
    if args.batch_size is not None:
        eval_kwargs["batch_size"] = args.batch_size
    changes["eval_kwargs"] = eval_kwargs
    if args.eval_lengths is not None:
        changes["eval_lengths"] = args.eval_lengths
    config = config.replace(**changes)
    trainer = Trainer(config, model=model, task=build_task(config))
    metrics = trainer.evaluate(args.split, progress=not args.no_progress)
    _write_output(args.output, metrics)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        print(f"{ckpt}  ({config.task}, {args.split})")
        width = max(len(k) for k in metrics)
        for key, value in metrics.items():
            print(f"  {key:<{width}}  {value:.6g}")
    return 0


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    from deltaflow.evals.harness import evaluate

    results = evaluate(
        args.checkpoint,
        [t.strip() for t in args.lm_eval.split(",") if t.strip()],
        include_path=args.lm_eval_include,
        limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size or 8,
        device=args.device,
    )
    _write_output(args.output, results["results"])
    if args.json:
        print(json.dumps(results["results"], indent=2, default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


def _write_output(path: str | None, results: dict[str, Any]) -> None:
    """``--output FILE``: the results as JSON (the folder is created)."""
    if path is None:
        return
    check_out_dir(Path(path).parent, "--output")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help=COMMANDS["generate"][0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint dir or run dir of an `lm` task run")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument(
        "--max-new-tokens", type=_nonnegative_int, default=200, help="tokens to generate"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter; 1: off")
    p.add_argument(
        "--decode-mode",
        choices=["compile", "graph", "eager", "transformers"],
        help="default: compile (CUDA graph of the compiled step) on CUDA, transformers on CPU",
    )
    p.add_argument("--num-samples", type=_positive_int, default=1, help="samples of the prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    _threads_flag(p)
    _trust_flag(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from deltaflow.lab.generate import sample
    from deltaflow.tasks.tokenizers import run_tokenizer
    from deltaflow.train.cpu import set_threads

    set_threads(args.threads, _resolved_device(args.device))
    config, model, ckpt = _load_trained(args.checkpoint, args.device, args.trust_checkpoint)
    if config.task != "lm":
        raise ValueError(
            f"generate needs a language-model checkpoint (task 'lm'); {args.checkpoint} was "
            f"trained on {config.task!r}: use `deltaflow eval` for it"
        )
    tokenizer = run_tokenizer(ckpt, config.task_kwargs)  # the copy saved with the checkpoint
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("--prompt encodes to no tokens; give some text")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt] * args.num_samples, device=device)
    torch.manual_seed(args.seed)  # deltaflow models sample from the global RNG
    out = sample(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        decode_mode=args.decode_mode,
    )
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tokenizer.decode(row))
    return 0


# ---------------------------------------------------------------------------- export
def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help=COMMANDS["export"][0],
        description="Write a run's latest checkpoint (or a given checkpoint folder) as a "
        "save_pretrained folder: config.json (with auto_map and the tokenizer's eos_token_id), "
        "generation_config.json, model.safetensors, the model code (modeling_deltaflow.py), "
        "train_config.yaml and, for language-model runs, the tokenizer (tokenizer.json). Open "
        "it with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True), deltaflow "
        "installed or not. Finished runs already have one: RUN/final/.",
    )
    p.add_argument("checkpoint", help="run dir (its latest checkpoint) or checkpoint dir")
    p.add_argument(
        "--out",
        required=True,
        help="a new or empty folder, or an earlier export (replaced atomically); never a run, "
        "a checkpoint, a folder inside one, a file or a folder of other files",
    )
    _trust_flag(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from deltaflow.train.checkpoint import resolve_checkpoint
    from deltaflow.train.export import export_checkpoint

    if not Path(args.checkpoint).exists():
        raise FileNotFoundError(f"{args.checkpoint} does not exist: give a run or a checkpoint")
    ckpt = resolve_checkpoint(args.checkpoint)
    dest = export_checkpoint(ckpt, args.out, trusted=args.trust_checkpoint)
    print(f"exported {ckpt} to {dest}")
    return 0


# ---------------------------------------------------------------------------- convert-fla
def add_convert_fla_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-fla",
        help=COMMANDS["convert-fla"][0],
        description="Read a folder written by fla's save_pretrained (config.json + "
        "model.safetensors) of a GatedDeltaNetForCausalLM or DeltaNetForCausalLM and write the "
        "deltaflow model with the same outputs as a save_pretrained folder (tokenizer files "
        "are copied along). A setting deltaflow cannot represent (hybrid attention layers, "
        "other activations) is refused. Check on a GPU: python benchmarks/convert_fla_check.py",
    )
    p.add_argument("src", help="the fla checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (must not exist)")
    p.set_defaults(func=cmd_convert_fla)


def cmd_convert_fla(args: argparse.Namespace) -> int:
    from deltaflow.models.convert_fla import convert_fla

    dest = convert_fla(args.src, args.out)
    print(f"converted {args.src} to {dest}")
    return 0


# ---------------------------------------------------------------------------- compare
def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    from deltaflow.lab.presets import PRESETS

    p = sub.add_parser(
        "compare",
        help=COMMANDS["compare"][0],
        description="Run a preset grid, keep the best learning rate per cell, write "
        "results.md, summary.json, runs.jsonl and PNG plots. Every invocation trains from "
        "scratch (an old runs.jsonl is kept as runs.prev.jsonl, old run directories as "
        "runs.prev/) unless --resume is given. Runs checkpoint as they train, so --resume "
        "also continues runs cut off by a kill or by --time-limit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset", default="quick", choices=sorted(PRESETS), help="grid to run (see --list)"
    )
    p.add_argument(
        "--out",
        help="output directory (default: runs/compare/<preset>; runs/ is git-ignored, the "
        "committed example results in results/ are never written or resumed by default)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs already in <out>/runs.jsonl and train only the rest, "
        "continuing unfinished runs from their checkpoints in <out>/runs/ (continue an "
        "interrupted grid); without it every run is trained again from scratch",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="wall-time budget of this command: when it is nearly used (10%% kept in reserve, "
        "10-60 s) training stops with a checkpoint, the table holds the finished runs and the "
        "command exits 0; re-run it with --resume to continue (e.g. 9 for a 10-minute limit)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=float,
        default=2.0,
        metavar="MINUTES",
        help="wall time between a run's checkpoints, so a killed command loses at most that "
        "much of each run in flight (0: checkpoint only when a run stops or ends)",
    )
    p.add_argument(
        "--keep-run-dirs",
        action="store_true",
        help="keep finished runs' directories in <out>/runs/ (final checkpoint, logs); by "
        "default they are deleted once the run's record is in runs.jsonl",
    )
    p.add_argument(
        "--device", type=_device, default="auto", help="auto, cpu, cuda (every GPU) or cuda:N"
    )
    p.add_argument("--steps", type=int, help="training steps per run (overrides the preset)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the preset's steps")
    p.add_argument("--variants", help="comma-separated subset of the preset's variants")
    p.add_argument("--cells", help="comma-separated subset of the preset's task cells")
    p.add_argument("--widths", help="comma-separated model widths (replaces the preset's)")
    p.add_argument("--lrs", help="comma-separated learning rates (replaces the preset's)")
    p.add_argument(
        "--wds",
        help="comma-separated AdamW weight decays to sweep (replaces the preset's); the best "
        "(lr, weight decay) pair per cell is kept",
    )
    p.add_argument(
        "--seeds",
        type=int,
        help="number of seeds (0..N-1) for every variant (replaces per-variant seed counts)",
    )
    p.add_argument("--batch-size", type=int, help="override the preset's batch size")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="override a base config field of every run, e.g. "
        "model.num_layers=4 or 'eval_kwargs={num_examples: 64}' (repeatable)",
    )
    p.add_argument(
        "--shared",
        help="folder with corpus/ and tokenizers/ (lm_corpus preset); "
        "default: $DELTAFLOW_SHARED, ./shared or ../shared",
    )
    p.add_argument(
        "--jobs", type=_positive_int, help="parallel runs (default: CPU cores on CPU, 1 on GPU)"
    )
    p.add_argument(
        "--threads", type=_positive_int, help="torch threads per run (default 1 when --jobs > 1)"
    )
    p.add_argument("--note", help="a line put at the top of results.md (e.g. 'CPU-scale run')")
    p.add_argument("--list", action="store_true", help="list presets and variants, exit")
    p.add_argument("--dry-run", action="store_true", help="print the runs, train nothing")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write results.md, summary.json and plots from the runs already "
        "finished in --out (a cell whose sweep is unfinished: its best so far, marked *)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compare)


def _shared_dir(arg: str | None) -> str | None:
    candidates = [arg, os.environ.get("DELTAFLOW_SHARED"), "shared", "../shared"]
    for c in candidates:
        if c and (Path(c) / "corpus").is_dir():
            return str(Path(c).resolve())
    return arg


def _csv(text: str, cast: type = str, *, flag: str = "", low: float | None = None) -> list:
    """Comma-separated values; bad ones are an error naming the flag (``--lrs``, ...)."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = cast(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a valid {cast.__name__}") from None
        if low is not None and value < low:
            raise ValueError(f"{flag}: every value must be >= {low}, got {item}")
        values.append(value)
    if not values:
        raise ValueError(f"{flag}: expected a comma-separated list, got {text!r}")
    return values


def cmd_compare(args: argparse.Namespace) -> int:
    from deltaflow.lab import compare, expand_grid, get_preset
    from deltaflow.lab.presets import PRESETS, VARIANTS, check_variants

    if args.list:
        for name, p in PRESETS.items():
            print(
                f"{name}: {p.description}\n  variants: {', '.join(p.variants)}\n"
                f"  cells: {', '.join(p.cells)}; widths: {p.widths}; lrs: {p.lrs}; "
                f"weight decays: {p.weight_decays or p.base.get('weight_decay', 'default')}; "
                f"seeds: {len(p.seeds)}"
                + (
                    f" ({ {v: len(s) for v, s in p.seeds_per_variant.items()} })"
                    if p.seeds_per_variant
                    else ""
                )
                + f"; steps: {p.base.get('steps')}"
            )
        print("known variants: " + ", ".join(f"{k} {v}" for k, v in VARIANTS.items()))
        return 0
    preset = get_preset(args.preset)
    if args.variants:
        wanted = _csv(args.variants, flag="--variants")
        check_variants(wanted, "--variants")
        preset.variants = wanted
    if args.cells:
        wanted = _csv(args.cells, flag="--cells")
        bad = [c for c in wanted if c not in preset.cells]
        if bad:
            raise ValueError(
                f"--cells: unknown cell {bad[0]!r}{did_you_mean(bad[0], preset.cells)} for "
                f"preset {preset.name}; it has {', '.join(preset.cells)}"
            )
        preset.cells = {c: preset.cells[c] for c in wanted}
    if args.widths:
        preset.widths = _csv(args.widths, int, flag="--widths", low=1)
    if args.lrs:
        preset.lrs = _csv(args.lrs, float, flag="--lrs")
        if any(lr <= 0 for lr in preset.lrs):
            raise ValueError(f"--lrs: learning rates must be > 0, got {args.lrs}")
    if args.wds:
        preset.weight_decays = _csv(args.wds, float, flag="--wds", low=0.0)
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0 minutes, got {args.time_limit:g}")
    if not args.checkpoint_every >= 0:
        raise ValueError(f"--checkpoint-every must be >= 0 minutes, got {args.checkpoint_every:g}")
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        preset.seeds = list(range(args.seeds))
        preset.seeds_per_variant = {}
    from deltaflow.train import apply_overrides

    overrides = apply_overrides({}, args.overrides)
    if args.batch_size:
        overrides["batch_size"] = args.batch_size
    shared = _shared_dir(args.shared)
    out = Path(args.out or f"runs/compare/{preset.name}")
    check_out_dir(out, "--out")
    if args.report_only:  # a fresh clone has no runs/compare/<preset> yet: the report says so
        out.mkdir(parents=True, exist_ok=True)
    specs = expand_grid(
        preset,
        device=args.device,
        steps=args.steps,
        scale=args.scale,
        shared=shared,
        overrides=overrides,
    )
    if args.dry_run:
        for s in specs:
            print(s.run_id)
        mode = "resuming" if args.resume else "from scratch"
        print(f"{len(specs)} runs of {specs[0].config.steps} steps -> {out} ({mode})")
        return 0
    if not args.report_only:  # a missing GPU is one line here, not a grid of failed runs
        from deltaflow.train.trainer import DistInfo, resolve_device

        resolve_device(args.device, DistInfo())
    command = "deltaflow " + " ".join(shlex.quote(a) for a in args.argv)
    _, table = compare(
        preset,
        out,
        device=args.device,
        steps=args.steps,
        scale=args.scale,
        shared=shared,
        overrides=overrides,
        command=command.strip(),
        progress=not args.no_progress,
        jobs=args.jobs,
        threads=args.threads,
        note=args.note,
        resume=args.resume,
        time_limit_minutes=args.time_limit,
        checkpoint_minutes=args.checkpoint_every or None,  # 0: no periodic checkpoints
        keep_run_dirs=args.keep_run_dirs,
        train=not args.report_only,
    )
    seeds = max(len(preset.variant_seeds(v)) for v in preset.variants)
    agg = "" if seeds == 1 else f", {preset.seed_aggregate} over up to {seeds} seeds"
    wd = " x weight decay" if preset.weight_decays else ""
    print(f"\n{preset.name}: {preset.metric} at the best lr{wd} per cell{agg} ({out}/results.md)\n")
    print(table)
    if preset.expect:
        print(f"\nExpected: {preset.expect}")
    return 0


# ---------------------------------------------------------------------------- main
# What a user's mistake raises (bad flags, configs, paths, files, devices): one line, exit 2.
# Anything else is a bug or a failure of the machine and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)
TRACEBACK_HELP = "show the full Python traceback of an error (or set DELTAFLOW_DEBUG=1)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (``deltaflow CMD: error: ...``): the usage of
    ``train`` alone is 34 lines, which buried the error (and its did-you-mean) above it."""

    def error(self, message: str) -> typing.NoReturn:
        close = ""
        if self.prog == "deltaflow" and "invalid choice: '" in message:  # a mistyped command
            close = did_you_mean(message.split("invalid choice: '", 1)[1].split("'")[0], COMMANDS)
        hint = close or f" (see {self.prog} -h)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


# command -> (one-line help, "module:function" that adds its full parser). `deltaflow --help`
# and every command build only the parser they use, so none waits for another's imports
# (torch, transformers, the trainer, lm-eval).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train one model on one task", "deltaflow.cli:add_train_parser"),
    "eval": (
        "evaluate a checkpoint on its task (or a variant of it)",
        "deltaflow.cli:add_eval_parser",
    ),
    "generate": (
        "sample text from a language-model checkpoint",
        "deltaflow.cli:add_generate_parser",
    ),
    "export": (
        "write a checkpoint as a transformers save_pretrained folder",
        "deltaflow.cli:add_export_parser",
    ),
    "convert-fla": (
        "convert an fla GatedDeltaNet/DeltaNet checkpoint into a deltaflow model folder",
        "deltaflow.cli:add_convert_fla_parser",
    ),
    "compare": (
        "run a grid of rules x tasks x widths x lrs x seeds; tables and plots",
        "deltaflow.cli:add_compare_parser",
    ),
    "lm-eval-task": (
        "build local lm-eval tasks (last word, perplexity) from held-out documents",
        "deltaflow.evals.local_tasks:add_lm_eval_task_parser",
    ),
    "stability": (
        "numerical stability study of the step rules",
        "deltaflow.analysis.cli:add_stability_parser",
    ),
}


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line: the commands in ``full`` (default: all) with their whole parser,
    the others as a name and a help line."""
    import importlib

    parser = _Parser(
        prog="deltaflow",
        description="Delta-rule linear attention lab: train, evaluate, compare step rules.",
    )
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, where) in COMMANDS.items():
        if full is not None and name not in full:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module, function = where.split(":")
        try:
            add = getattr(importlib.import_module(module), function)
        except ImportError:  # stability: written by another module; the CLI works without it
            continue
        add(sub)
    for command in sub.choices.values():
        if "--traceback" not in command._option_string_actions:
            command.add_argument(
                "--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP
            )
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand an argv names (the first word that is not an option), if known."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _unknown_flags_error(
    parser: argparse.ArgumentParser, command: str | None, extras: list[str]
) -> None:
    """Unknown arguments: the subcommand's usage and one error line with a did-you-mean."""
    target = _subparser(parser, command)
    flag = next((e for e in extras if e.startswith("-")), extras[0])
    known = [o for o in target._option_string_actions if o.startswith("--")]
    names = {o[2:]: o for o in known}  # compare without the '--' every flag shares
    close = difflib.get_close_matches(flag.split("=")[0].lstrip("-"), names, n=1, cutoff=0.6)
    hint = f" (did you mean {names[close[0]]}?)" if close else f" (see deltaflow {command} -h)"
    s = "s" if len(extras) > 1 else ""
    target.exit(2, f"{target.prog}: error: unrecognized argument{s}: {' '.join(extras)}{hint}\n")


def _one_line(err: BaseException) -> str:
    """An exception as one line: OSErrors without the errno prefix, newlines folded."""
    if isinstance(err, OSError) and err.strerror and not err.args[1:2] == ():
        text = err.strerror + (f": {err.filename}" if err.filename else "")
    else:
        text = str(err) or type(err).__name__
    if isinstance(err, KeyError):
        text = f"missing key {text}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _close_progress_bars() -> None:
    if "tqdm" not in sys.modules:  # no bar can be open
        return
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _diverged(err: BaseException) -> bool:
    """A DivergenceError (one line, exit 1); without the trainer imported it cannot be one."""
    trainer = sys.modules.get("deltaflow.train.trainer")
    return trainer is not None and isinstance(err, trainer.DivergenceError)


def main(argv: list[str] | None = None) -> int:
    # Everything inside the try, the parser too: building it imports torch and transformers
    # (seconds), and a Ctrl-C then is one line and exit 130 like at any later moment.
    command, debug = None, False
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--traceback" in argv or os.environ.get("DELTAFLOW_DEBUG", "") not in ("", "0")
        command = next((a for a in argv if not a.startswith("-")), None)  # until argparse says
        # only the named command's parser is built whole: the others' imports cost seconds
        parser = build_parser(full=[c for c in [_command_of(argv)] if c])
        args, extras = parser.parse_known_args(argv)
        command = args.command
        if extras:
            _unknown_flags_error(parser, args.command, extras)
        args.argv = argv  # recorded with results (results/*/command.txt)
        if not hasattr(args, "func"):
            parser.print_help()
            return 0
        debug = debug or getattr(args, "traceback", False)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        _close_progress_bars()
        print(f"deltaflow{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return 130  # the shell's code for a SIGINT
    except Exception as err:
        if debug or not (isinstance(err, USER_ERRORS) or _diverged(err)):
            raise
        _close_progress_bars()  # else the error line starts after a half-drawn bar
        print(f"deltaflow {command}: error: {_one_line(err)}", file=sys.stderr)
        return 1 if _diverged(err) else 2


if __name__ == "__main__":
    sys.exit(main())
