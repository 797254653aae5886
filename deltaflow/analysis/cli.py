"""`deltaflow stability`: the stability study from the command line.

Standalone: `python -m deltaflow.analysis.cli [options]`. The main `deltaflow` CLI registers the
same subcommand through `add_stability_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from deltaflow.analysis.growth import BETA_REGIMES, KEY_REGIMES, check_regimes, parse_precision
from deltaflow.analysis.report import StudyConfig, run_study
from deltaflow.ops.checks import BACKENDS

PARTS = ("spectrum", "growth", "discretization", "layer")
OP_BACKENDS = (*BACKENDS, "none")  # the op's backends, or none: experiment C skipped


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _neg(s: str) -> list[bool]:
    choices = {"both": [False, True], "on": [True], "off": [False]}
    if s not in choices:
        raise argparse.ArgumentTypeError("expected both, on or off")
    return choices[s]


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = StudyConfig()
    p.description = (
        "Numerical stability of every step rule: eigenvalue spectrum, long-run growth of the "
        "state in fp64/fp32/bf16/fp16, and discretization error against the exact flow. "
        "Writes summary.md, study.json and PNG plots to --out."
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "key regimes:\n"
        + "\n".join(f"  {k:10s} {v}" for k, v in KEY_REGIMES.items())
        + "\nbeta regimes:\n"
        + "\n".join(f"  {k:10s} {v}" for k, v in BETA_REGIMES.items())
        + "\nprecisions: fp64 | fp32 | bf16 | fp16, or IN/STATE such as bf16/fp32"
    )
    p.add_argument("--out", default="stability_results", help="output directory")
    p.add_argument("--rules", type=_csv, default=d.rules, help="comma-separated step rules")
    p.add_argument(
        "--dtypes", type=_csv, default=d.precisions, help="precisions (fp64 reference is added)"
    )
    p.add_argument("--steps", type=int, default=d.steps, help="sequence length T")
    p.add_argument("--dk", type=int, default=d.dk, help="key dimension")
    p.add_argument("--dv", type=int, default=d.dv, help="value dimension")
    p.add_argument("--seeds", type=int, default=d.seeds, help="seeds per cell (experiment A)")
    p.add_argument("--keys", type=_csv, default=d.keys, help="key regimes (experiment A)")
    p.add_argument("--betas", type=_csv, default=d.betas, help="beta regimes (experiment A)")
    p.add_argument(
        "--negative-eigenvalues",
        type=_neg,
        default="both",
        help="experiment A: both | on | off",
    )
    p.add_argument("--pinned-rules", type=_csv, default=d.pinned_rules, help="experiment B rules")
    p.add_argument("--pinned-keys", type=_csv, default=d.pinned_keys, help="experiment B keys")
    p.add_argument("--pinned-betas", type=_csv, default=d.pinned_betas, help="experiment B betas")
    p.add_argument("--pinned-seeds", type=int, default=d.pinned_seeds, help="experiment B seeds")
    p.add_argument("--pinned-steps", type=int, default=d.pinned_steps, help="experiment B length T")
    p.add_argument(
        "--op-backend",
        default=d.op_backend,
        help="backend for running experiment B through deltaflow.delta_rule "
        "(torch, triton, reference, auto) or 'none' to skip",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="base random seed")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (the batch is small per op: 1 is usually fastest)",
    )
    p.add_argument("--parts", type=_csv, default=d.parts, help=f"subset of {','.join(PARTS)}")
    p.add_argument("--checkpoint", default=None, help="model dir for per-head mu (part 'layer')")
    p.add_argument("--text", default=None, help="text file fed to --checkpoint")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a path to a .tiktoken file")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens of --text used")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_stability)
    return p


def add_stability_parser(subparsers) -> argparse.ArgumentParser:
    """Register `stability` on an argparse subparsers object (from the main deltaflow CLI)."""
    from deltaflow.cli import COMMANDS

    p = subparsers.add_parser("stability", help=COMMANDS["stability"][0])
    return _configure(p)


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """Validate the parsed options (ValueError naming the option) and build the StudyConfig."""
    from deltaflow.rules import get_rule

    for opt in ("rules", "pinned_rules"):
        for r in getattr(args, opt):
            get_rule(r)
    for spec in args.dtypes:
        parse_precision(spec)
    check_regimes(args.keys + args.pinned_keys, args.betas + args.pinned_betas)
    for opt in (
        "steps",
        "pinned_steps",
        "dk",
        "dv",
        "seeds",
        "pinned_seeds",
        "max_tokens",
        "threads",
    ):
        if getattr(args, opt) < 1:
            raise ValueError(f"--{opt.replace('_', '-')} must be >= 1, got {getattr(args, opt)}")
    if args.op_backend not in OP_BACKENDS:
        raise ValueError(f"--op-backend {args.op_backend!r}: expected one of {list(OP_BACKENDS)}")
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        raise ValueError(f"--parts: unknown {bad}; expected a subset of {list(PARTS)}")
    parts = list(args.parts)
    if args.checkpoint and "layer" not in parts:
        parts.append("layer")
    neg = args.negative_eigenvalues
    if isinstance(neg, str):  # argparse does not run `type` on a string default
        neg = _neg(neg)
    return StudyConfig(
        rules=args.rules,
        precisions=args.dtypes,
        steps=args.steps,
        dk=args.dk,
        dv=args.dv,
        seeds=args.seeds,
        keys=args.keys,
        betas=args.betas,
        negative_eigenvalues=neg,
        pinned_rules=args.pinned_rules,
        pinned_keys=args.pinned_keys,
        pinned_betas=args.pinned_betas,
        pinned_seeds=args.pinned_seeds,
        pinned_steps=args.pinned_steps,
        op_backend=args.op_backend,
        seed=args.seed,
        device=args.device,
        parts=parts,
        checkpoint=args.checkpoint,
        text=args.text,
        tokenizer=args.tokenizer,
        max_tokens=args.max_tokens,
    )


def run_stability(args: argparse.Namespace) -> int:
    """Entry point of `deltaflow stability`; returns the process exit code."""
    import torch

    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as e:
        print(f"deltaflow stability: error: {e}", file=sys.stderr)
        return 2
    if cfg.device.startswith("cpu"):
        torch.set_num_threads(args.threads)
    command = getattr(args, "command_line", None)
    if command is None and getattr(args, "argv", None) is not None:  # the main deltaflow CLI
        command = shlex.join(["deltaflow", *args.argv])
    if command is None:  # reconstruct from the process's own command line
        i = sys.argv.index("stability") + 1 if "stability" in sys.argv else 1
        command = shlex.join(["deltaflow", "stability", *sys.argv[i:]])
    data = run_study(cfg, args.out, progress=not args.no_progress, command=command)
    print(f"wrote {args.out}/summary.md ({data['elapsed_s']:.0f} s)")
    for f in data["findings"]:
        print(" -", f)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _configure(argparse.ArgumentParser(prog="python -m deltaflow.analysis.cli"))
    args = p.parse_args(argv)
    if argv is not None:
        args.command_line = shlex.join(["deltaflow", "stability", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
