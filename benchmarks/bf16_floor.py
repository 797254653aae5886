"""A float64 emulation of what the Triton backward computes, with an optional bf16 rounding at
each place the kernels round: which intermediate costs the gradients their precision.

The Triton backward (docs/design.md §7; ``deltaflow/ops/triton_backend._backward``) recomputes
prepare (W, Ũ, T) and the state pass (h = S_0 of every chunk, U), runs the reverse pass (dh = G,
dU) and the per-chunk gradients. Between and inside those kernels values are stored or cast
for a ``tl.dot`` in the dot dtype (bf16). :func:`emulate` runs the same algorithm, chunk by chunk
and with the kernels' order of operations, in float64; each name in ``KNOBS`` switches one of
those roundings on. With every knob off it is the exact float64 gradient (``tests/
test_bf16_floor.py`` pins it to the float64 torch backend at 1e-10), so the error one knob alone
causes is what that rounding costs. ``FLOOR`` is the rounding any bf16 implementation does
(fla stores these in bf16 too): the "bf16 floor" of ``check_triton.py``.

    python benchmarks/bf16_floor.py [--workers 8] [--out FILE]   # GPU: issue 30's cases
    python benchmarks/bf16_floor.py --smoke      # CPU, Triton interpreter, one tiny case (CI)

On the GPU it runs the bf16 cases of ``check_triton.py`` that were over 5e-3 (``CASES``), each on
check_triton's own inputs: the Triton kernels as they are and with each of ``FLAGS`` (module
flags of ``triton_backend``), then the emulation with the kernels' roundings (``TRITON``), the
floor, each knob alone and candidate fixes, and prints dβ and d log α's ‖Δ‖/‖ref‖ in one table.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import git_commit, smoke_env, smoke_requested

if smoke_requested():
    smoke_env()

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

C = 64  # the Triton chunk (deltaflow.ops.chunk.TRITON_CHUNK_SIZE)

# One knob per rounding point of the Triton backward (what is rounded, where):
KNOBS = {
    "prep": "prepare's W and Ũ by block substitution on bf16 operands (D_b, A_bj, right sides)",
    "T_tf32": "T as prepare computes it (tf32 dots) and stores it (fp32)",
    "W": "W stored in bf16 by prepare",
    "Ut": "Ũ stored in bf16 by prepare",
    "h": "S_0 of every chunk stored in bf16 by the state pass (h)",
    "U": "U = Ũ − W S_0 stored in bf16 (v_new)",
    "fwd_S": "state pass: S_0 cast to bf16 for U = Ũ − W S_0",
    "fwd_K": "state pass: K̃ = diag(e^{γ_C − γ}) K cast to bf16 for the state update K̃ᵀ U",
    "fwd_U": "state pass: U cast to bf16 for the state update K̃ᵀ U",
    "dh": "G (the state's gradient) stored in bf16 by the reverse pass (dh)",
    "dU": "dU stored in bf16 by the reverse pass (du)",
    "rev_P": "reverse pass: P cast to bf16 for dU = scale·Pᵀ dO",
    "rev_K": "reverse pass: K̃ = diag(e^{γ_C − γ}) K cast to bf16 for dU += K̃ G",
    "rev_G": "reverse pass: G cast to bf16 for dU += K̃ G",
    "rev_update": "reverse pass: Γq and dU cast to bf16 for the G update",
    "T_dot": "T cast to bf16 for dY = Tᵀ dU",
    "dY_dot": "dY cast to bf16 for dY Uᵀ and dX = −dY S_0ᵀ",
    "S0_dot": "S_0 cast to bf16 for dO S_0ᵀ and dX (matters when h is stored in fp32)",
    "G_dot": "G cast to bf16 for U Gᵀ (matters when dh is stored in fp32)",
    "M": "M_P, M_A (the C×C scratch between the two gradient kernels) in bf16",
}
# What the Triton kernels round now: every knob but the two decayed keys, which the state pass
# and the reverse pass no longer form (the decay scales U's rows, and dU's rows after K G).
TRITON = tuple(k for k in KNOBS if k not in ("fwd_K", "rev_K"))
# What any bf16 implementation rounds, the "bf16 floor": the values a kernel stores between
# launches (fla stores W, Ũ, its A = T, h, v_new, dh and dv2 in bf16 too) and the state passes'
# dot operands (fla's too: the state in v_new = u − w h, v_new and dh for the k products, its
# attention block for dv). The inputs and the output gradient are rounded on both sides.
FLOOR = ("W", "Ut", "h", "U", "fwd_S", "fwd_U", "dh", "dU", "rev_P", "rev_G", "rev_update", "T_dot")


SUB = 16  # the prepare kernel's sub-block (deltaflow/ops/triton/common.SUB)


def bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def split(x: Tensor) -> Tensor:
    """x as a dot sees it split into two bf16 parts, hi + lo (~16 significant bits)."""
    hi = bf16(x)
    return hi + bf16(x - hi)


def tf32(x: Tensor) -> Tensor:
    """Round to tf32's 10-bit mantissa (round half away from zero on the bit pattern)."""
    i = x.float().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def _substitute(A: Tensor, R: Tensor, r) -> Tensor:
    """T R with T = (I + A)⁻¹ as the prepare kernel forms it: block forward substitution over
    SUB-token blocks, X_b = D_b (R_b − Σ_{j<b} A_bj X_j), D_b = (I + A_bb)⁻¹, each product's
    operands passed through ``r`` (the rounding of its dot)."""
    eye = torch.eye(SUB, dtype=A.dtype, device=A.device)
    out = []
    for i in range(0, A.shape[-1], SUB):
        rhs = R[..., i : i + SUB, :]
        for j, x in zip(range(0, i, SUB), out):
            rhs = rhs - r(A[..., i : i + SUB, j : j + SUB]) @ r(x)
        out.append(r(torch.linalg.inv(eye + A[..., i : i + SUB, i : i + SUB])) @ r(rhs))
    return torch.cat(out, -2)


def _rule_terms(rule: str, ne: bool, beta: Tensor | None, lam: Tensor, eps: float):
    """a, b and their four partial derivatives, elementwise (autograd of deltaflow.rules)."""
    from deltaflow.rules import step_coefficients

    beta = torch.ones_like(lam) if beta is None else beta
    beta = beta.detach().requires_grad_(True)
    lam = lam.detach().requires_grad_(True)
    a, b = step_coefficients(rule, beta, lam, negative_eigenvalues=ne, eps=eps)
    da = torch.autograd.grad(a.sum(), (beta, lam), allow_unused=True, retain_graph=True)
    db = torch.autograd.grad(b.sum(), (beta, lam), allow_unused=True)
    z = torch.zeros_like(lam)
    da_db, da_dl, db_db, db_dl = (z if g is None else g for g in (*da, *db))
    return a.detach(), b.detach(), da_db, da_dl, db_db, db_dl


def _sequence(x: dict, do: Tensor, ds: Tensor, rule, ne, knobs, scale, eps) -> dict:
    """Gradients of one sequence, all heads at once: x holds [H, L, ...] float64 tensors."""

    def r(knob: str, t: Tensor) -> Tensor:
        return knobs[knob](t) if knob in knobs else t

    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["log_decay"]
    H, L, Dk = k.shape
    n = max(-(-L // C), 1)
    pad = n * C - L
    lam = (k * k).sum(-1)
    a, b, da_db, da_dl, db_db, db_dl = _rule_terms(rule, ne, beta, lam, eps)

    def chunks(t: Tensor) -> Tensor:  # [H, L, ...] -> [n, H, C, ...], identity steps padded
        t = torch.cat([t, t.new_zeros(H, pad, *t.shape[2:])], 1)
        return t.reshape(H, n, C, *t.shape[2:]).transpose(0, 1)

    q, k, v, a, b, g, do = (chunks(t) for t in (q, k, v, a, b, g, do))
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = causal.tril(-1)
    gamma = g.cumsum(-1)
    Dm = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf))
    Gamma = gamma.exp()
    to_end = torch.exp(gamma[..., -1:] - gamma)
    KK, QK = k @ k.mT, q @ k.mT

    # prepare (3)-(4)
    A = (a[..., :, None] * Dm * KK).masked_fill(~strict, 0)
    T = r("T_tf32", torch.linalg.inv(torch.eye(C, dtype=k.dtype, device=k.device) + A))
    X, Y = (a * Gamma)[..., None] * k, b[..., None] * v
    if "prep" in knobs:
        W, Ut = (_substitute(A, R, lambda t: r("prep", t)) for R in (X, Y))
    else:
        W, Ut = T @ X, T @ Y
    W, Ut = r("W", W), r("Ut", Ut)

    # the state pass (4), (6): h and U
    S = x["initial_state"]
    h, U = [], []
    for c in range(n):
        h.append(r("h", S))
        Uc = Ut[c] - W[c] @ r("fwd_S", S)
        U.append(r("U", Uc))
        k_te = r("fwd_K", k[c] * to_end[c][..., None])
        S = Gamma[c, :, -1, None, None] * S + k_te.mT @ r("fwd_U", Uc)

    # the reverse pass (7)-(8): dh and dU
    G = ds
    dh, dU = [None] * n, [None] * n
    for c in reversed(range(n)):
        dh[c] = r("dh", G)
        P = r("rev_P", QK[c] * Dm[c])
        k_te = r("rev_K", k[c] * to_end[c][..., None])
        dUc = scale * P.mT @ do[c] + k_te @ r("rev_G", G)
        dU[c] = r("dU", dUc)
        q_g = r("rev_update", q[c] * (scale * Gamma[c])[..., None])
        G = Gamma[c, :, -1, None, None] * G + q_g.mT @ do[c] - W[c].mT @ r("rev_update", dUc)
    d_s0 = G
    h, U, dh, dU = (torch.stack(t) for t in (h, U, dh, dU))

    # the value-side gradient kernel (9), (11)
    T_t = r("T_dot", T).mT
    dY = T_t @ dU
    dYb = r("dY_dot", dY)
    dP = scale * (do @ U.mT)
    dA = (-(dYb @ U.mT)).masked_fill(~strict, 0)
    db = (dY * v).sum(-1)
    dv = b[..., None] * dY
    da = (dA * Dm * KK).sum(-1)
    dE = (dP * QK + dA * a[..., :, None] * KK) * Dm
    d_gamma = dE.sum(-1) - dE.sum(-2)
    M_P, M_A = r("M", dP * Dm), r("M", dA * a[..., :, None] * Dm)

    # the key-side gradient kernel (9)-(12)
    S0 = r("S0_dot", h)
    dQS = do @ S0.mT
    dKte = U @ r("G_dot", dh).mT
    dX = -(dYb @ S0.mT)
    dq = scale * Gamma[..., None] * dQS + M_P @ k
    dk = M_P.mT @ q + to_end[..., None] * dKte + M_A @ k + M_A.mT @ k
    t = (dKte * k * to_end[..., None]).sum(-1)
    xk = (dX * k).sum(-1)
    da = da + Gamma * xk
    dk = dk + (a * Gamma)[..., None] * dX
    d_gamma = d_gamma - t + (scale * (q * dQS).sum(-1) + a * xk) * Gamma
    d_gamma[..., -1] += t.sum(-1) + Gamma[..., -1] * (dh * h).sum((-1, -2))
    d_log_alpha = d_gamma.flip(-1).cumsum(-1).flip(-1)

    def tokens(t: Tensor) -> Tensor:  # [n, H, C, ...] -> [H, L, ...]
        return t.transpose(0, 1).reshape(H, n * C, *t.shape[3:])[:, :L]

    da, db = tokens(da), tokens(db)
    dk = tokens(dk) + (2 * (da * da_dl + db * db_dl))[..., None] * x["k"]
    return {
        "q": tokens(dq),
        "k": dk,
        "v": tokens(dv),
        "beta": da * da_db + db * db_db,
        "log_decay": tokens(d_log_alpha),
        "initial_state": d_s0,
    }


def emulate(
    x: dict,
    rule: str,
    negative_eigenvalues: bool,
    grad_o: Tensor,
    grad_state: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    knobs: tuple[str, ...] = (),
    scale: float | None = None,
    eps: float = 1e-6,
) -> dict[str, Tensor]:
    """The gradients of ``q, k, v, beta, log_decay, initial_state`` (``x``: check_triton.make's
    dict, [B, T, H, ...]) for the output gradient ``grad_o`` and the final state's ``grad_state``,
    computed as the Triton backward does, in float64, with the bf16 roundings named in
    ``knobs`` (see ``KNOBS``; ``"name=tf32"`` / ``"name=split"`` round to tf32 or to a bf16
    hi + lo pair instead: candidate fixes). ``cu_seqlens``: packed sequences (B = 1), each
    with its own initial state."""
    rounding = {}
    for knob in knobs:
        name, _, fmt = knob.partition("=")
        if name not in KNOBS or fmt not in ("", "bf16", "tf32", "split"):
            raise ValueError(
                f"knobs: each must be a name of KNOBS {sorted(KNOBS)}, optionally '=tf32' or "
                f"'=split' (rounded to tf32, or to a bf16 hi + lo pair, instead), got {knob!r}"
            )
        fmt = "tf32" if name == "T_tf32" else fmt or "bf16"
        rounding[name] = {"bf16": bf16, "tf32": tf32, "split": split}[fmt]
    x64 = {name: t.detach().double() for name, t in x.items()}
    B, T, H, Dk = x64["q"].shape
    scale = Dk**-0.5 if scale is None else scale
    if cu_seqlens is None:  # B sequences of T tokens
        spans = [(i, 0, T) for i in range(B)]
    else:
        bounds = [int(c) for c in cu_seqlens]
        spans = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    grads: dict[str, Tensor] = {n: torch.zeros_like(t) for n, t in x64.items()}
    for i, (row, start, end) in enumerate(spans):
        seq = {
            n: x64[n][row, start:end].transpose(0, 1)  # [H, L, ...]
            for n in ("q", "k", "v", "beta", "log_decay")
        }
        seq["initial_state"] = x64["initial_state"][i]
        do = grad_o.double()[row, start:end].transpose(0, 1)
        out = _sequence(
            seq, do, grad_state.double()[i], rule, negative_eigenvalues, rounding, scale, eps
        )
        for n in ("q", "k", "v", "beta", "log_decay"):
            grads[n][row, start:end] = out[n].transpose(0, 1)
        grads["initial_state"][i] = out["initial_state"]
    return grads


# ------------------------------------------------------------------------------- the GPU script
# check_triton's bf16 cases over 5e-3 on the H100 (benchmarks/NOTES.md, issue 30), by label and
# rule; check_triton.plan gives their shapes, negative eigenvalues and seeds.
CASES = [
    ("T=200 Dk=Dv=256", "longhorn"),
    ("T=64", "efla"),
    ("T=65", "longhorn"),
    ("varlen", "longhorn"),
    ("T=65", "relaxed_kaczmarz"),
    ("T=1", "relaxed_kaczmarz"),
    ("T=1", "efla"),
    ("T=1", "kaczmarz"),
]
# Triton variants: triton_backend flags set for one run (name -> {flag: value})
FLAGS = {"triton": {}, "triton, states fp32": {"BACKWARD_STATES_FP32": True}}


def _emulations() -> dict[str, tuple[str, ...]]:
    """Emulation variants: the kernels, the floor, each knob alone, candidate fixes."""
    keep_fp32 = tuple(k for k in TRITON if k not in ("h", "dh"))
    split = tuple(f"{k}=split" if k in ("rev_G", "dU", "dY_dot") else k for k in TRITON)
    return {
        "emu: triton": TRITON,
        "emu: bf16 floor": FLOOR,
        **{f"emu: {k} alone": (k,) for k in KNOBS},
        "emu: triton, states fp32": keep_fp32,
        "emu: triton, G dU dY split": split,
    }


def measure(label: str, rule: str, smoke: bool) -> tuple[str, dict[str, dict[str, float]]]:
    """One case: {variant: {gradient: ‖Δ‖/‖ref‖}} for the Triton variants and the emulations."""
    import check_triton as ct

    from deltaflow.ops import triton_backend

    device = "cpu" if smoke else "cuda"
    dt = "fp32" if smoke else "bf16"  # the interpreter's bf16 dots are wrong: plumbing only
    cases = [c[1] for c in ct.plan([dt], smoke, device) if c[0] == "op"]
    _, B, T, Dk, Dv, lengths, rule, ne, _, seed, _ = next(
        c for c in cases if c[0] == label and c[6] == rule
    )
    cu = None
    if lengths is not None:
        T = sum(lengths)
        cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    x = ct.make(B, T, Dk, Dv, rule, ct.DTYPES[dt], device, lengths and len(lengths), seed)
    kw = {"rule": rule, "negative_eigenvalues": ne, "cu_seqlens": cu}
    o, s, g_ref = ct.run(x, "torch", dtype=torch.float64, grad_dtype=ct.DTYPES[dt], **kw)
    names = ["beta", "log_decay"] + [n for n in ct.NAMES if n not in ("beta", "log_decay")]
    rows = {}
    # smoke: the interpreter takes ~30 s per backward; one Triton run checks the plumbing
    for variant, flags in list(FLAGS.items())[: 1 if smoke else None]:
        saved = {f: getattr(triton_backend, f) for f in flags}
        try:
            for f, value in flags.items():
                setattr(triton_backend, f, value)
            grads = ct.run(x, "triton", grad_dtype=ct.DTYPES[dt], **kw)[2]
            rows[variant] = {n: ct.rel(grads[n], g_ref[n]) for n in names}
        except Exception as e:  # noqa: BLE001 - a variant that cannot run (shared memory) is a row
            rows[variant] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
        finally:
            for f, value in saved.items():
                setattr(triton_backend, f, value)
    do, ds = ct.output_grads(o, s, ct.DTYPES[dt])
    for variant, knobs in _emulations().items():
        grads = emulate(x, rule, ne, do, ds, cu_seqlens=cu, knobs=knobs)
        rows[variant] = {n: ct.rel(grads[n], g_ref[n]) for n in names}
    return f"{label} {rule}{' +neg' if ne else ''}", rows


def table(results: list[tuple[str, dict]]) -> str:
    """One row per variant, one column per case: 'dβ / d log α' (and the worst other gradient
    for the Triton rows)."""
    header = "| variant | " + " | ".join(case for case, _ in results) + " |"
    lines = [header, "|" + " --- |" * (len(results) + 1)]
    for variant in results[0][1]:
        cells = []
        for _, rows in results:
            e = rows[variant]
            if "error" in e:
                cells.append(e["error"])
                continue
            cell = f"{e['beta']:.1e} / {e['log_decay']:.1e}"
            if not variant.startswith("emu"):
                others = max(v for n, v in e.items() if n not in ("beta", "log_decay"))
                cell += f" (others ≤ {others:.1e})"
            cells.append(cell)
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--workers", type=int, default=len(CASES))
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("error: bf16_floor needs a CUDA GPU (its Triton rows); run it with --smoke on a CPU")
        return 2
    cases = [("T=65", "delta")] if args.smoke else CASES
    start = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    # one process per case: cases compile their kernels in parallel (Triton's disk cache shared)
    with ProcessPoolExecutor(args.workers, ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(measure, label, rule, args.smoke) for label, rule in cases]
        results = [f.result() for f in futures]
    device = "cpu (Triton interpreter, fp32)" if args.smoke else torch.cuda.get_device_name()
    text = (
        f"# bf16 gradient precision by rounding point: {device}, commit {git_commit()}\n\n"
        f"wall time: {time.perf_counter() - start:.0f} s\n\n"
        "‖Δ‖/‖ref‖ vs float64 of dβ / d log α, check_triton's inputs; Triton rows: the kernels "
        "(with triton_backend flags); emu rows: benchmarks/bf16_floor.py's float64 emulation "
        "with the named bf16 roundings (KNOBS).\n\n" + table(results)
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print("bf16_floor: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
