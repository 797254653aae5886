"""Time each launch of the Triton forward separately (the prepare kernel and the fused state
pass) under several launch settings of each, for the rules and shapes given (GPU machine).

    python benchmarks/profile_forward.py [--rules delta,efla] [--old-prepare FILE[,FILE...]]
    python benchmarks/profile_forward.py --smoke   # CPU, Triton interpreter, tiny shapes

``--old-prepare FILE,...``: also time the prepare kernel of other versions of
``deltaflow/ops/triton/prepare.py`` (copied files with the same ``launch_prepare``, each at its
own launch settings), in the same run: the before/after of a prepare change on one machine.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools

from _common import bench_ms, device, low_precision, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()  # before torch/triton are imported

import torch  # noqa: E402

from deltaflow.ops.triton import prepare, states  # noqa: E402
from deltaflow.ops.triton.common import chunk_tables  # noqa: E402
from deltaflow.rules import RULES  # noqa: E402

# The fused pass timed here forms Q Kᵀ itself (its own settings, FUSED_SETTINGS, beside the
# prepare's): not the split forward's P from the prepare (states.SPLIT_FORWARD_P)
states.SPLIT_FORWARD_P = False

SHAPES = [(8, 4096, 16, 128), (16, 2048, 32, 64)]
SMOKE_SHAPES = [(1, 70, 1, 16)]
# (warps, tile, maxnreg, diagonal-inverse precision) of the prepare kernel: the first is the
# default, timed for every rule with and without T; the others for the first rule without T.
PREPARE_SETTINGS = [
    (4, 64, 168, "tf32x3"),
    (4, 64, 168, "ieee"),
    (4, 64, 168, "tf32"),
    (4, 64, 128, "tf32x3"),
]
SMOKE_PREPARE_SETTINGS = [(4, 64, None, "ieee"), (4, 32, None, "tf32x3")]
# (BV, warps, stages) of the fused state pass with outputs
FUSED_SETTINGS = [(64, 4, 2), (64, 4, 1), (64, 4, 3), (128, 4, 2)]


def inputs(shape, dev, dtype):
    B, T, H, D = shape
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    ld = (-0.05 * torch.rand(B, T, H, device=dev, generator=g)).to(dtype)
    return q, k.to(dtype), v, beta, ld


def prepare_call(k, v, beta, ld, tables, rule, w, u, t, first_bad, module) -> None:
    """One launch of ``module``'s prepare kernel (delta family inputs, no negative eigenvalues)."""
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
        t=t,
        first_bad=first_bad,
    )


def fused_call(q, k, w, u, ld, first_bad, tables, o, final_state) -> None:
    """One launch of the fused state pass with outputs."""
    states.launch_forward(
        q,
        k,
        w=w,
        u=u,
        log_decay=ld,
        initial_state=None,
        first_bad=first_bad,
        tables=tables,
        scale=q.shape[-1] ** -0.5,
        o=o,
        final_state=final_state,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--rules", default="delta,efla", help="comma-separated Triton rules")
    p.add_argument("--old-prepare", default=None, help="other prepare.py files to time beside")
    p.add_argument("--skip-fused", action="store_true", help="time the prepare kernel only")
    args = p.parse_args()
    dev = device(args.smoke)
    dtype = low_precision(args.smoke)
    olds = {}
    for i, path in enumerate(args.old_prepare.split(",") if args.old_prepare else []):
        spec = importlib.util.spec_from_file_location(f"prepare_old{i}", path)
        olds[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(olds[path])
    settings = SMOKE_PREPARE_SETTINGS if args.smoke else PREPARE_SETTINGS
    names = ("PREPARE_WARPS", "PREPARE_TILE", "PREPARE_MAXNREG", "PREPARE_DIAG_PRECISION")
    defaults = tuple(getattr(prepare, n) for n in names)
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        B, T, H, D = shape
        q, k, v, beta, ld = inputs(shape, dev, dtype)
        tables = chunk_tables(None, B, T, q.device)
        w, u, o = torch.empty_like(k), torch.empty_like(v), torch.empty_like(v)
        t = torch.empty(tables.n_chunks, H, 64, 64, device=dev)
        first_bad = torch.empty(tables.n_chunks, H, device=dev, dtype=torch.int32)
        final_state = torch.empty(B, H, D, D, device=dev)
        for rule, store_t in itertools.product(args.rules.split(","), (False, True)):
            run_prepare = functools.partial(
                prepare_call, k, v, beta, ld, tables, rule, w, u, t if store_t else None, first_bad
            )

            for path, old in olds.items():
                ms = bench_ms(functools.partial(run_prepare, old), dev)
                print(f"{shape} {rule} store_t={store_t} prepare {path}: {ms:.3f} ms", flush=True)
                w_old, u_old = w.clone(), u.clone()
            for i, setting in enumerate(settings):
                if i > 0 and (store_t or rule != args.rules.split(",")[0]):
                    continue
                for name, value in zip(names, setting):
                    setattr(prepare, name, value)
                ms = bench_ms(functools.partial(run_prepare, prepare), dev)
                diff = ""
                if olds:  # the versions agree to bf16 rounding (the last one listed)
                    diff = f" (max |w - old| {(w - w_old).abs().max().item():.1e}, "
                    diff += f"|u - old| {(u - u_old).abs().max().item():.1e})"
                print(
                    f"{shape} {rule} store_t={store_t} prepare (warps, tile, maxnreg, diag) "
                    f"{setting}: {ms:.3f} ms{diff}",
                    flush=True,
                )
        for name, value in zip(names, defaults):
            setattr(prepare, name, value)
        if args.skip_fused:
            continue
        run_prepare(prepare)
        for BV, warps, stages in FUSED_SETTINGS[:1] if args.smoke else FUSED_SETTINGS:
            states.FUSED_BV, states.FUSED_WARPS, states.FUSED_STAGES = BV, warps, stages
            fused = functools.partial(fused_call, q, k, w, u, ld, first_bad, tables, o, final_state)
            ms = bench_ms(fused, dev)
            print(f"{shape} fused state pass BV={BV} warps={warps} stages={stages}: {ms:.3f} ms")
        if not torch.isfinite(o).all():
            raise SystemExit("profile_forward: FAILED, non-finite output")
    print("profile_forward: done")


if __name__ == "__main__":
    main()
