"""Bytes saved for backward per token per layer: one block of each model, eager and compiled.

Every tensor autograd keeps between forward and backward passes through
``torch.autograd.graph.saved_tensors_hooks`` (compiled regions too: AOTAutograd saves its
activations with ``save_for_backward``). Tensors are counted once per storage, so a view of a
saved tensor is free. Grouped by shape and dtype, to show what to recompute.

    python3 benchmarks/saved_activations.py --out benchmarks/results   # GPU
    python3 benchmarks/saved_activations.py --smoke   # CPU, tiny block, no fla, temp report
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from _common import git_commit, output_dir, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from _models import (  # noqa: E402
    DTYPES,
    add_architecture_args,
    build_deltaflow,
    build_fla,
    build_llama,
    shared_architecture,
)

# --smoke's defaults (flags still override): one tiny block on the CPU, fp32, in seconds
SMOKE = dict(
    device="cpu", batch=1, seq=64, hidden=64, heads=2, head_dim=32, vocab=256, dtype="fp32"
)


def saved_bytes(block: nn.Module, h: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
    """Run ``block(h)`` under a saved-tensor hook; return total bytes and a per-kind table."""
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    params = {p.data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.data_ptr() not in params and key not in seen:
            seen[key] = (f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}", key[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()  # the graph must be usable: the count is of a real step
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, nbytes in seen.values():
        kinds[name][0] += 1
        kinds[name][1] += nbytes
    total = sum(n for _, n in seen.values())
    return {"total_bytes": total, "kinds": {k: v for k, v in sorted(kinds.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    add_architecture_args(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--skip-fla", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON here (smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny block, no fla")
    if smoke_requested():
        p.set_defaults(**SMOKE, skip_fla=True)
    args = p.parse_args()
    # inductor on the GPU; the smoke traces the same compiled graphs with aot_eager (no codegen)
    backend = "aot_eager" if args.smoke else "inductor"
    args.layers = 1
    arch = shared_architecture(args)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokens = args.batch * args.seq
    builders = {
        "deltaflow": lambda: build_deltaflow(arch)[0].model.layers[0],
        "deltaflow (compiled)": lambda: build_deltaflow(arch, True, backend=backend)[
            0
        ].model.layers[0],
        "llama-sdpa": lambda: build_llama(arch)[0].model.layers[0],
    }
    if args.skip_fla:
        print("fla skipped (--skip-fla)")
    else:
        builders["fla"] = lambda: build_fla(arch, False)[0].model.layers[0]
    report: dict[str, Any] = {"commit": git_commit(), "batch": args.batch, "seq": args.seq}
    failed = []
    for name, build in builders.items():
        try:
            block = build().to(device=device, dtype=dtype).train()
            h = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype)
            h.requires_grad_(True)
            kwargs: dict[str, Any] = {}
            if name.startswith("llama"):
                rot = build_llama(arch)[0].model.rotary_emb.to(device)
                pos = torch.arange(args.seq, device=device)[None]
                kwargs["position_embeddings"] = rot(h, pos)
            if name.endswith("(compiled)"):
                saved_bytes(block, h, **kwargs)  # compile first: count the steady state
            r = saved_bytes(block, h, **kwargs)
        except Exception as e:  # noqa: BLE001 - report and go on (fla may be missing)
            print(f"{name}: failed: {e!r}")
            failed.append(name)
            continue
        r["bytes_per_token"] = r["total_bytes"] / tokens
        report[name] = r
        print(
            f"\n{name}: {r['bytes_per_token']:.0f} bytes saved per token per layer "
            f"({r['total_bytes'] / 1e6:.1f} MB at {tokens} tokens)"
        )
        for kind, (count, nbytes) in r["kinds"].items():
            print(f"  {count:3d} x {kind:40s} {nbytes / tokens:8.1f} B/token")
    if args.out or args.smoke:
        path = (
            output_dir(args.out, args.smoke) / f"saved_activations_B{args.batch}_T{args.seq}.json"
        )
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    if [name for name in failed if name != "fla"]:  # fla is optional; our own blocks must run
        raise SystemExit(f"saved_activations: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
