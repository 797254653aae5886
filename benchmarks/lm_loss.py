"""The LM loss alone (issue 31 item 4): our chunked ``linear_cross_entropy`` against liger-kernel's
fused linear cross-entropy (``deltaflow.models.loss.FUSED_CE_BACKEND = "liger"``), at the 400M
benchmark model's step: N = 16384 tokens, D = 1024, V = 32000.

    python benchmarks/lm_loss.py [--shape 16384x1024x32000] [--chunk 4096] [--smoke]

For bf16 hidden states and weight, and for float32 ones under bf16 autocast (the trainer's fp32
master weights): forward + backward median ms, peak memory above the inputs, and the max error
of loss, grad_h and grad_w against the plain float32 ``F.cross_entropy`` of float32 copies (max
abs error, and that over the reference's max abs). Cases: ``torch`` (ours), ``liger`` (same
chunk rows, via the switch) and ``liger-c1`` (liger's default chunks, 512 rows here; float32
weight-gradient accumulation, as the other two).

The GPU machine has no internet: carry liger's wheel in the git-ignored ``.whl/`` (``pip download
liger-kernel --no-deps -d .whl``: ``.whl/liger_kernel-0.8.5-py3-none-any.whl``, matched by
``liger_kernel-*.whl``) and put it on the path first, as gpu_check.sh does with fla's wheels:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/lm_loss.py

``--smoke``: tiny, float16 (the interpreter's bf16 is not trusted), liger on the CPU interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

from _common import (
    bench_ms,
    device,
    device_name,
    git_commit,
    low_precision,
    smoke_env,
    smoke_requested,
)

if smoke_requested():
    smoke_env()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from deltaflow.models import loss as L  # noqa: E402

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def liger_info() -> str | None:
    """liger's version and place, or None (printed why) when it cannot be imported."""
    try:
        import importlib.metadata

        import liger_kernel
    except Exception as e:  # noqa: BLE001 - report and time ours alone
        print(f"liger not available: {e!r}")
        return None
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:  # on the path without its dist-info
        version = "unknown version"
    return f"liger-kernel {version} at {liger_kernel.__path__[0]}"


def cases(chunk: int, liger: bool) -> dict[str, LossFn]:
    """The timed losses by name; the switch is set for one call and put back."""

    def ours(backend: str) -> LossFn:
        def fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            L.FUSED_CE_BACKEND = backend
            try:
                return L.linear_cross_entropy(h, w, y, chunk_size=chunk)
            finally:
                L.FUSED_CE_BACKEND = "torch"

        return fn

    found = {"torch": ours("torch")}
    if liger:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lf

        found["liger"] = ours("liger")
        found["liger-c1"] = lambda h, w, y: lf(h, w, y, accum_dtype=torch.float32)
    return found


def run(shape: tuple[int, int, int], chunk: int, smoke: bool) -> None:
    N, D, V = shape
    dev = device(smoke)
    lowp = low_precision(smoke)
    info = liger_info()
    if smoke:  # liger's kernels run on the CPU interpreter: let the switch send CPU inputs there
        L._LIGER_DEVICES = ("cuda", "cpu")
    print(f"lm_loss: N={N} D={D} V={V} chunk {chunk}, {device_name(dev)}, commit {git_commit()}")
    print(info or "liger: -")
    g = torch.Generator(device=dev).manual_seed(0)
    h32 = torch.randn(N, D, device=dev, generator=g)
    w32 = 0.02 * torch.randn(V, D, device=dev, generator=g)  # the models' init std
    y = torch.randint(0, V, (N,), device=dev, generator=g)
    y[::64] = L.IGNORE_INDEX  # a few unscored rows (document ends)
    ref_h, ref_w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_h @ ref_w.t(), y, ignore_index=L.IGNORE_INDEX)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (ref_h, ref_w)))
    del ref_h, ref_w, ref_loss
    for mode in (f"{str(lowp)[6:]}", f"fp32 weights, {str(lowp)[6:]} autocast"):
        amp = "autocast" in mode
        dtype = torch.float32 if amp else lowp
        h = h32.to(dtype).requires_grad_()
        w = w32.to(dtype).requires_grad_()
        ctx = torch.autocast(dev, dtype=lowp) if amp else contextlib.nullcontext()
        for name, loss_fn in cases(chunk, info is not None).items():
            if name == "liger":  # a silent fallback would time ours twice
                L.FUSED_CE_BACKEND = "liger"
                applies = L._liger_applies(h, w, True, True)
                L.FUSED_CE_BACKEND = "torch"
                if not applies:
                    raise SystemExit("error: FUSED_CE_BACKEND='liger' does not send these there")

            def step(loss_fn=loss_fn, h=h, w=w, ctx=ctx):
                with ctx:
                    loss = loss_fn(h, w, y)
                return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

            got = step()  # warm (compiles liger's kernels)
            errs = []
            for a, b in zip(got, ref):
                err = (a.float() - b).abs().max().item()
                errs.append(f"{err:.1e} ({err / b.abs().max().item():.1e})")
            del got
            peak = "-"
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB"
            ms = bench_ms(step, dev)
            print(f"{mode:>30} {name:>8}: {ms:8.3f} ms  peak {peak:>9}  err loss {errs[0]}"
                  f"  grad_h {errs[1]}  grad_w {errs[2]}")  # fmt: skip
    print("lm_loss: done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help="NxDxV (default 16384x1024x32000)")
    parser.add_argument("--chunk", type=int, default=L.DEFAULT_CHUNK_SIZE, help="rows per chunk")
    parser.add_argument("--smoke", action="store_true", help="tiny, CPU interpreter")
    args = parser.parse_args(argv)
    text = args.shape or ("100x32x300" if args.smoke else "16384x1024x32000")
    shape = tuple(int(v) for v in text.lower().split("x"))
    if len(shape) != 3 or min(shape) < 1:
        raise SystemExit(f"error: --shape takes NxDxV with positive sizes, got {text!r}")
    chunk = 48 if args.smoke and args.shape is None else args.chunk  # several chunks, ragged
    run(shape, chunk, args.smoke)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
