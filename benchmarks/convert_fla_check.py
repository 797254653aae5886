"""Logits of an fla model and of its `deltaflow convert-fla` conversion, side by side.

    python benchmarks/convert_fla_check.py                    # CUDA: float32 and bfloat16
    python benchmarks/convert_fla_check.py --model dn         # DeltaNet instead of Gated DeltaNet
    python benchmarks/convert_fla_check.py --smoke            # CPU, tiny, seconds (fla's kernels
                                                              # under the Triton interpreter)

Builds a randomly initialised fla ``GatedDeltaNetForCausalLM`` (or ``DeltaNetForCausalLM``),
saves it with ``save_pretrained``, converts the folder, loads the deltaflow model and prints the
max absolute and relative (to the largest fla logit) difference of the logits per dtype. Exits 1
when a difference is above the dtype's tolerance, 0 otherwise, and 0 with a note when fla is not
installed (``pip install flash-linear-attention``; it is not a deltaflow dependency).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest logit


def _fla_model(kind: str, args: argparse.Namespace):
    from fla.models import (
        DeltaNetConfig,
        DeltaNetForCausalLM,
        GatedDeltaNetConfig,
        GatedDeltaNetForCausalLM,
    )

    common = dict(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        use_gate=True,
    )
    if kind == "gdn":
        heads = max(args.hidden_size // 64, 2)
        config = GatedDeltaNetConfig(
            head_dim=args.hidden_size // heads,
            num_heads=heads,
            num_v_heads=2 * heads,
            expand_v=1.0,
            allow_neg_eigval=True,
            **common,
        )
        model = GatedDeltaNetForCausalLM(config)
    else:
        config = DeltaNetConfig(num_heads=2, expand_v=2.0, tie_word_embeddings=True, **common)
        model = DeltaNetForCausalLM(config)
    with torch.no_grad():  # norms and gates away from their init, so every weight matters
        for name, p in model.named_parameters():
            if p.dim() == 1 and "A_log" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gdn", "dn"), default="gdn")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, float32 only")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--work", help="folder for the two checkpoints (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.smoke:
        # T <= 64 in eval: fla runs its fused_recurrent kernels (its chunk kernels fail under
        # Triton 3.9's interpreter: "'int' object has no attribute 'to'")
        args.hidden_size, args.layers, args.vocab, args.seq_len = 32, 2, 64, 48
        args.batch_size = 2
    if importlib.util.find_spec("fla") is None:
        print("fla (flash-linear-attention) is not installed: nothing to compare")
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fla imports Triton kernels
        import triton.runtime.autotuner as autotuner

        # the interpreter has no device to time configurations on: take them as equal
        autotuner.Autotuner._bench = lambda self, *a, config, **kw: [0.0, 0.0, 0.0]
        device, dtypes = "cpu", [torch.float32]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
            return 2
        device, dtypes = "cuda", [torch.float32, torch.bfloat16]

    from deltaflow.models import DeltaFlowForCausalLM
    from deltaflow.models.convert_fla import convert_fla

    torch.manual_seed(0)
    work = Path(args.work or tempfile.mkdtemp(prefix="convert_fla_"))
    fla_model = _fla_model(args.model, args)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device=device)
    worst = 0
    for dtype in dtypes:
        src, out = work / f"fla-{dtype}", work / f"deltaflow-{dtype}"
        model = fla_model.to(device=device, dtype=dtype)
        model.save_pretrained(str(src))
        convert_fla(src, out)
        ours = DeltaFlowForCausalLM.from_pretrained(str(out), dtype=dtype).to(device).eval()
        with torch.no_grad():
            want = model(ids).logits.float()
            got = ours(ids).logits.float()
        diff = (got - want).abs().max().item()
        rel = diff / want.abs().max().item()
        ok = rel <= TOLERANCE[dtype]
        worst |= not ok
        print(
            f"{args.model} {str(dtype).removeprefix('torch.')} on {device}: max abs diff "
            f"{diff:.3g}, max rel diff {rel:.3g} (tolerance {TOLERANCE[dtype]:g}) "
            f"{'ok' if ok else 'TOO LARGE'}"
        )
    return int(worst)


if __name__ == "__main__":
    sys.exit(main())
