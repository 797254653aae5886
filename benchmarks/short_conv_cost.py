"""Compile cost and resources of the Triton short conv's kernels (issue 31 item 4) for a target
GPU architecture (default sm_90, the H100), on a CPU: compile seconds, registers, spill stack and
shared memory per specialization the training step launches (bf16 x read in place from the fused
projection, its row stride a multiple of 16; float32 or bfloat16 weight; plain or packed).

    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/short_conv_cost.py [--arch 90]

Put the Triton of the GPU machine first on the path (its ptxas is what compiles). Launch
settings are short_conv_triton's module constants. Wall seconds on a shared CPU: compare them
with each other, not with another machine's.
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="short_conv_cost_"))
os.environ.pop("TRITON_INTERPRET", None)  # compiling, not interpreting

import triton  # noqa: E402
from _launches import resource_usage  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltaflow.layers import short_conv_triton as sct  # noqa: E402

# What a launch on the training step's tensors specializes: a stride of 1 is a constant, and
# pointers and ints divisible by 16 carry that hint (C = 3072, row stride 4112, T = 2048).
ONE = ("sx_c", "sdy_c")
INTS = ("T", "C", "n_tiles", "n_programs_t", "sx_b", "sx_t", "ss_b", "ss_c", "ss_w")
INTS += ("sdy_b", "sdy_t")


def compile_one(kernel, arch: int, x: str, w: str, varlen: bool, backward: bool) -> dict:
    names = list(inspect.signature(kernel.fn).parameters)
    types = {n: "*" + x for n in names if n.endswith("_ptr")}
    types.update(w_ptr="*" + w, pos_ptr="*i32", dw_ptr="*fp32")
    const = dict(W=4, SILU=True, HAS_STATE=False, VARLEN=varlen, **{n: 1 for n in ONE})
    if backward:
        const.update(WP=4, BT=sct.BWD_BT, BC=sct.BWD_BC, TILES=sct.BWD_TILES)
    else:
        const.update(BT=sct.FWD_BT, BC=sct.FWD_BC)
    signature = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    hinted = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in INTS]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in const.items() if n in names},
        attrs={(i,): [["tt.divisibility", 16]] for i in hinted if names[i] not in ("ss_w",)},
    )
    warps = sct.BWD_WARPS if backward else sct.FWD_WARPS
    start = time.perf_counter()
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
    )
    return {"seconds": round(time.perf_counter() - start, 1), **resource_usage(compiled)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    for backward, kernel in ((False, sct.short_conv_fwd_kernel), (True, sct.short_conv_bwd_kernel)):
        for w in ("fp32", "bf16"):
            for varlen in (False, True):
                usage = compile_one(kernel, args.arch, "bf16", w, varlen, backward)
                label = f"{kernel.fn.__name__} x=bf16 w={w} varlen={varlen}"
                print(label, " ".join(f"{k}={v}" for k, v in usage.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
