"""Time each launch of the Triton forward separately (the prepare kernel and the fused state
pass) under several launch settings of each, for the rules and shapes given (GPU machine).

    python benchmarks/profile_forward.py [--rules delta,efla] [--old-prepare FILE]
    python benchmarks/profile_forward.py --smoke   # CPU, Triton interpreter, tiny shapes

``--old-prepare FILE``: also time the prepare kernel of another version of
``deltaflow/ops/triton/prepare.py`` (a copied file with the same ``launch_prepare``), in the
same run: the before/after of a prepare change on one machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools

from _common import bench_ms, device, low_precision, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402

from deltaflow.ops.triton import prepare, states  # noqa: E402
from deltaflow.ops.triton.common import chunk_tables  # noqa: E402
from deltaflow.rules import RULES  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (16, 2048, 32, 64)]
SMOKE_SHAPES = [(1, 70, 1, 16)]
# (warps, tile, maxnreg) of the prepare kernel; the first is the default
PREPARE_SETTINGS = [(4, 64, None), (4, 64, 128), (4, 64, 168), (4, 32, 128), (8, 64, None)]
SMOKE_PREPARE_SETTINGS = [(4, 64, None), (4, 32, None)]
# (BV, warps, stages) of the fused state pass with outputs
FUSED_SETTINGS = [(64, 4, 1), (64, 4, 2), (128, 4, 1), (64, 8, 1)]


def inputs(shape, dev, dtype):
    B, T, H, D = shape
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    ld = (-0.05 * torch.rand(B, T, H, device=dev, generator=g)).to(dtype)
    return q, k.to(dtype), v, beta, ld


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--rules", default="delta,efla", help="comma-separated Triton rules")
    p.add_argument("--old-prepare", default=None, help="another prepare.py to time beside")
    p.add_argument("--skip-fused", action="store_true", help="time the prepare kernel only")
    args = p.parse_args()
    dev = device(args.smoke)
    dtype = low_precision(args.smoke)
    old = None
    if args.old_prepare:
        spec = importlib.util.spec_from_file_location("prepare_old", args.old_prepare)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    settings = SMOKE_PREPARE_SETTINGS if args.smoke else PREPARE_SETTINGS
    defaults = (prepare.PREPARE_WARPS, prepare.PREPARE_TILE, prepare.PREPARE_MAXNREG)
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        B, T, H, D = shape
        q, k, v, beta, ld = inputs(shape, dev, dtype)
        tables = chunk_tables(None, B, T, q.device)
        w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v)
        t = torch.empty(tables.n_chunks, H, 64, 64, device=dev)
        first_bad = torch.empty(tables.n_chunks, H, device=dev, dtype=torch.int32)
        final_state = torch.empty(B, H, D, D, device=dev)
        for rule, store_t in itertools.product(args.rules.split(","), (False, True)):

            def run_prepare(module=prepare):
                module.launch_prepare(
                    k,
                    v,
                    beta=beta,
                    log_decay=ld,
                    tables=tables,
                    kernel_id=RULES[rule].kernel_id,
                    negative_eigenvalues=False,
                    eps=1e-6,
                    w=w,
                    u=u,
                    t=t if store_t else None,
                    first_bad=first_bad,
                )

            if old is not None:
                ms = bench_ms(lambda: run_prepare(old), dev)
                print(f"{shape} {rule} store_t={store_t} prepare OLD: {ms:.3f} ms", flush=True)
                w_old, u_old = w.clone(), u.clone()
            for warps, tile, maxnreg in settings:
                prepare.PREPARE_WARPS, prepare.PREPARE_TILE = warps, tile
                prepare.PREPARE_MAXNREG = maxnreg
                ms = bench_ms(run_prepare, dev)
                diff = ""
                if old is not None:  # the two versions agree to bf16 rounding
                    diff = f" (max |w - old| {(w - w_old).abs().max().item():.1e}, "
                    diff += f"|u - old| {(u - u_old).abs().max().item():.1e})"
                print(
                    f"{shape} {rule} store_t={store_t} prepare warps={warps} tile={tile} "
                    f"maxnreg={maxnreg}: {ms:.3f} ms{diff}",
                    flush=True,
                )
        prepare.PREPARE_WARPS, prepare.PREPARE_TILE, prepare.PREPARE_MAXNREG = defaults
        if args.skip_fused:
            continue
        run_prepare()
        for BV, warps, stages in FUSED_SETTINGS[:1] if args.smoke else FUSED_SETTINGS:
            states.FUSED_BV, states.FUSED_WARPS, states.FUSED_STAGES = BV, warps, stages
            ms = bench_ms(
                lambda: states.launch_forward(
                    q,
                    k,
                    w=w,
                    u=u,
                    log_decay=ld,
                    initial_state=None,
                    first_bad=first_bad,
                    tables=tables,
                    scale=D**-0.5,
                    o=o,
                    final_state=final_state,
                ),
                dev,
            )
            print(f"{shape} fused state pass BV={BV} warps={warps} stages={stages}: {ms:.3f} ms")
        if not torch.isfinite(o).all():
            raise SystemExit("profile_forward: FAILED, non-finite output")
    print("profile_forward: done")


if __name__ == "__main__":
    main()
