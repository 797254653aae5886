"""``deltaflow generate``: sample text from a language-model checkpoint."""

from __future__ import annotations

import argparse

from deltaflow.cli import COMMANDS
from deltaflow.cli.common import (
    _device,
    _load_trained,
    _nonnegative_int,
    _positive_int,
    _resolved_device,
    _threads_flag,
    _trust_flag,
)


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
