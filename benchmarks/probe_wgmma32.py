"""The state passes' two products alone, at 32 and 64 value columns: where does Triton 3.6 on
Hopper get 32 columns wrong (issue 32, sessions 21 and 23: every half-precision state pass with
32 value columns and a key head of 128 or more gave wrong states on the H200, while the CPU
interpreter is right)?

One kernel, the state pass's recurrence with nothing else: per chunk U = W S (a [C, BK] @ [BK, BV]
product whose B operand is the fp32 state rounded to bf16 in registers, stored to shared memory
from the wgmma layout) then S += Kᵀ U; the final S and every U stored. Each (BK, BV, warps,
stages, form) runs against the same recurrence in float64 on the rounded inputs. ``form``:
"plain" as the kernels hold it; "via_trans" multiplies by the state as the A operand,
U = (Sᵀ Wᵀ)ᵀ (A operands may stay in registers: no store of S to shared memory).

    python benchmarks/probe_wgmma32.py --out DIR      # GPU, ~1 min
    python benchmarks/probe_wgmma32.py --smoke        # CPU interpreter, one small case (CI)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from _common import smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

import torch  # noqa: E402 - after the interpreter's environment
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROWS = 64  # rows a chunk
C = tl.constexpr(ROWS)  # the same, for the kernel (a global a kernel reads is a constexpr)


@triton.jit
def recurrence_kernel(w_ptr, k_ptr, u_ptr, s_ptr, n_chunks, BK: tl.constexpr, BV: tl.constexpr,
                      VIA_TRANS: tl.constexpr):  # fmt: skip
    """One (BV-column block, sequence): S_{c+1} = S_c + K_cᵀ (U0_c − W_c S_c)."""
    i_v, i_n = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    DV = tl.num_programs(0) * BV
    S = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(0, n_chunks):
        base = (i_n * n_chunks + c) * C
        w = tl.load(w_ptr + (base + rows[:, None]) * BK + offs_k[None, :])
        k = tl.load(k_ptr + (base + rows[:, None]) * BK + offs_k[None, :])
        u_offs = (base + rows[:, None]) * DV + offs_v[None, :]
        u = tl.load(u_ptr + u_offs).to(tl.float32)
        if VIA_TRANS:
            u -= tl.trans(tl.dot(tl.trans(S.to(w.dtype)), tl.trans(w)))
        else:
            u -= tl.dot(w, S.to(w.dtype))
        tl.store(u_ptr + u_offs, u.to(u_ptr.dtype.element_ty))
        S = tl.dot(tl.trans(k), u.to(k.dtype), acc=S)
    tl.store(s_ptr + (i_n * BK + offs_k[:, None]) * DV + offs_v[None, :], S)


def reference(w, k, u0, n_chunks):
    """The final states of the recurrence in float64 with the kernel's roundings (S and U to the
    inputs' dtype where it rounds them)."""
    N = w.shape[0] // (n_chunks * ROWS)
    S = torch.zeros(N, w.shape[1], u0.shape[1], dtype=torch.float64, device=w.device)
    for c in range(n_chunks):
        sl = [slice((n * n_chunks + c) * ROWS, (n * n_chunks + c + 1) * ROWS) for n in range(N)]
        W = torch.stack([w[s] for s in sl]).double()
        K = torch.stack([k[s] for s in sl]).double()
        U = torch.stack([u0[s] for s in sl]).double()
        U = U - W @ S.to(w.dtype).double()
        S = S + K.transpose(1, 2) @ U.to(w.dtype).double()
    return S


def run(BK: int, BV: int, warps: int, stages: int, via_trans: bool, device: str) -> float:
    """The kernel's relative error in the final states. bf16 on the GPU; fp16 on the CPU
    interpreter, whose bf16 products are wrong (the tests use fp16 there too)."""
    g = torch.Generator(device="cpu").manual_seed(BK + BV + warps)
    N, n_chunks, DV = 4, 3, 2 * BV
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    w = (torch.randn(N * n_chunks * ROWS, BK, generator=g) / BK**0.5).to(dt).to(device)
    k = (torch.randn(N * n_chunks * ROWS, BK, generator=g) / BK**0.5).to(dt).to(device)
    u0 = torch.randn(N * n_chunks * ROWS, DV, generator=g).to(dt).to(device)
    u = u0.clone()
    s = torch.empty(N, BK, DV, device=device)
    recurrence_kernel[(DV // BV, N)](w, k, u, s, n_chunks, BK=BK, BV=BV, VIA_TRANS=via_trans,
                                     num_warps=warps, num_stages=stages)  # fmt: skip
    ref = reference(w, k, u0, n_chunks)
    return ((s.double() - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="folder for probe_wgmma32.txt")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, one small case")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        grid = [(64, 32, 4, 1, False), (64, 32, 4, 1, True)]
    else:
        grid = list(itertools.product((64, 128, 256), (32, 64), (2, 4, 8), (2,), (False, True)))
        grid += [(128, 32, 4, 1, False), (128, 32, 4, 3, False)]
    lines = []
    for BK, BV, warps, stages, via in grid:
        name = f"BK={BK} BV={BV} warps={warps} stages={stages} {'via_trans' if via else 'plain'}"
        try:
            err = run(BK, BV, warps, stages, via, device)
            line = f"{name}: {'ok' if err < 1e-2 else 'WRONG'} ({err:.1e})"
        except Exception as e:  # noqa: BLE001 - an out-of-resources compile is a verdict too
            line = f"{name}: ERROR {str(e).splitlines()[0][:120]}"
        print(line, flush=True)
        lines.append(line)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_wgmma32.txt").write_text("\n".join(lines) + "\n")
    bad = [ln for ln in lines if ": ok " not in ln]
    print(f"probe_wgmma32: {len(lines)} cases, {len(bad)} not ok")
    return 0  # a map, not a check: wrong cases are its finding


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
