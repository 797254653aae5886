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

    python benchmarks/bf16_floor.py [--workers 5] [--out FILE]   # GPU: issue 30's cases
    python benchmarks/bf16_floor.py --smoke      # CPU, Triton interpreter, one tiny case (CI)

On the GPU it runs the bf16 cases of ``check_triton.py`` over tolerance and over their floor
(``CASES``), each on check_triton's own inputs: the Triton kernels as they are and with each of
``FLAGS`` (launch settings), then the emulation with the kernels' roundings (``TRITON``), the
floor, each knob alone and candidate fixes, and prints dβ and d log α's ‖Δ‖/‖ref‖ in one table.
To find the stage that loses the precision it also captures the kernels' buffers (T, W, Ũ, h,
U, dh, dU, the gradient kernels' scratch: :func:`capture`), prints each one's error beside the
emulation's, and reruns the emulation from the kernels' buffers one stage at a time
(``STAGES``). The smoke mode runs the same in fp16 through the interpreter (whose fp16 dots are
right; ``emulate(low=torch.float16)`` rounds where the kernels do, to fp16).
Issue 30, session 13: ``--out benchmarks/results/issue30/s13probe/bf16_floor.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
    "T_tf32": "prepare: T = D − M(D − M(D − M D)), M = D A_below, tf32 operands (truncated;"
    " =split: the backward's hi + lo pairs, prepare.BACKWARD_T_PRECISION)",
    "T_W": "prepare: T rounded to bf16 as the operand of W = T X and Ũ = T Y",
    "X": "prepare: X = diag(aΓ) K rounded to bf16 as the operand of W = T X",
    "Y": "prepare: Y = diag(b) V rounded to bf16 as the operand of Ũ = T Y",
    "T_X": "prepare, strengths folded: T diag(aΓ) rounded to bf16 for W = (T diag(aΓ)) K",
    "T_Y": "prepare, strengths folded: T diag(b) rounded to bf16 for Ũ = (T diag(b)) V",
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
    "dv_local": "scale·Pᵀ dO stored in bf16 before K̃ G is added (fla's dv_local, not the kernels')",
    "rev_K": "reverse pass: K̃ = diag(e^{γ_C − γ}) K cast to bf16 for dU += K̃ G",
    "rev_G": "reverse pass: G cast to bf16 for dU += K̃ G",
    "rev_update": "reverse pass: dU cast to bf16 for the G update's Wᵀ dU",
    "rev_q": "reverse pass: Γq cast to bf16 for the G update's (Γq)ᵀ dO",
    "T_dot": "T cast to bf16 for dY = Tᵀ dU",
    "dY_dot": "dY cast to bf16 for dY Uᵀ and dX = −dY S_0ᵀ (=split: the kernels' Tᵀ (dU Uᵀ) "
    "and Tᵀ (dU S_0ᵀ), the fp32 product a hi + lo pair: common.dot_split)",
    "S0_dot": "S_0 cast to bf16 for dO S_0ᵀ and dX (matters when h is stored in fp32)",
    "G_dot": "G cast to bf16 for U Gᵀ (matters when dh is stored in fp32)",
    "M": "M_P, M_A (the C×C scratch between the two gradient kernels) in bf16",
}
# Knobs of tf32 dots (by default rounded as sm_90 reads fp32 for them, tf32z; the others: to
# the dot dtype)
TF32_KNOBS = ("T_tf32",)
# What a bf16 chunked implementation rounds, the "bf16 floor": each knob is a rounding that fla
# (flash-linear-attention, the reference bf16 implementation: ops/gated_delta_rule/chunk.py,
# wy_fast.py, ops/common/chunk_delta_h.py, chunk_o.py) does at the same point of the same
# algorithm, so that a gradient within the floor is within what bf16 storage itself costs on
# those inputs. The inputs and the output gradient are rounded on both sides. Per knob:
FLOOR_REASONS = {
    "T_W": "T stored in bf16 (solve_tril(output_dtype=k.dtype)) and the operand of W, Ũ",
    "X": "recompute_w_u_fwd: (k·β·e^g).to(k.dtype) before the dot with A = T",
    "Y": "recompute_w_u_fwd: (v·β).to(v.dtype) before the dot with A = T",
    "W": "w = torch.empty_like(k): W stored in bf16",
    "Ut": "u = torch.empty_like(v): Ũ stored in bf16",
    "h": "chunk_gated_delta_rule_fwd_h: h = k.new_empty(...), the states in bf16",
    "U": "v_new = torch.empty_like(u): U stored in bf16",
    "fwd_S": "fwd_h: tl.dot(b_w, b_h.to(b_w.dtype)), the state cast for W S_0",
    "fwd_U": "fwd_h: b_v (decayed U) .to(k.dtype) for the state update Kᵀ U",
    "dh": "bwd_dhu: dh = q.new_empty(...), the state gradients in bf16",
    "dU": "bwd_dhu: dv2 = torch.empty_like(dv), dU stored in bf16",
    "rev_P": "chunk_bwd_dv_local: the masked Q Kᵀ block cast to bf16 for its dot with dO",
    "rev_G": "bwd_dhu: tl.dot(b_k, b_dh.to(b_k.dtype)), G cast for K G",
    "rev_update": "bwd_dhu: tl.dot(b_w, b_dv.to(b_w.dtype)), dU cast for Wᵀ dU",
    "T_dot": "prepare_wy_repr_bwd: tl.dot(b_A, b_du) with A = T in bf16",
}
FLOOR = tuple(FLOOR_REASONS)
# What the Triton backward rounds (bf16/fp16 inputs; issue 30 item 4, session 14): the floor's
# roundings (the backward's prepare does not fold the strengths and forms T's products from
# hi + lo bf16 pairs, ~16 bits: prepare.BACKWARD_T_PRECISION, BACKWARD_FOLD_STRENGTHS), M
# (which reaches dq and dk only), and dY and Γq as hi + lo pairs for their products
# (common.dot_split: fla keeps both in fp32).
# S0_dot and G_dot round nothing while h and dh are stored in bf16.
TRITON = (*FLOOR, "M", "dY_dot=split", "rev_q=split", "T_tf32=split")
# What it rounded until session 13 (the forward's prepare settings: T's products on truncated
# tf32, the strengths folded into T; dY and Γq cast to bf16): 0.73-1.7x the floor over CPU
# draws, two of check_triton's cases over 1.1x on the H100 (results/issue30/s13call5).
TRITON_S13 = (
    *(k for k in FLOOR if k not in ("T_W", "X", "Y")),
    *("T_tf32", "T_X", "T_Y", "M", "dY_dot", "rev_q", "S0_dot", "G_dot"),
)


# The backward's buffers of the state passes, as ``steps`` names them
STATES = ("h", "v_new", "dh", "du")
SUB = 16  # the prepare kernel's diagonal blocks (deltaflow/ops/triton/common.SUB)


def bf16(x: Tensor, low: torch.dtype = torch.bfloat16) -> Tensor:
    """x rounded to the dot dtype ``low`` (bf16; fp16 to compare with the Triton interpreter)."""
    return x.to(low).to(x.dtype)


def split(x: Tensor, low: torch.dtype = torch.bfloat16) -> Tensor:
    """x as a dot sees it split into two ``low`` parts, hi + lo (~16 significant bits in bf16)."""
    hi = bf16(x, low)
    return hi + bf16(x - hi, low)


def fp32(x: Tensor, low: torch.dtype = torch.bfloat16) -> Tensor:
    """x rounded to fp32 (what the Triton interpreter's dots compute, whatever their precision)."""
    return x.float().to(x.dtype)


def tf32(x: Tensor, low: torch.dtype = torch.bfloat16) -> Tensor:
    """Round to tf32's 10-bit mantissa (round half away from zero on the bit pattern): what
    Triton's tf32x3 split and cvt.rna do."""
    i = x.float().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def tf32z(x: Tensor, low: torch.dtype = torch.bfloat16) -> Tensor:
    """fp32 read as tf32 by dropping its 13 low mantissa bits (toward zero): a tf32 dot's fp32
    operands on sm_90, where Triton 3.6 passes them to wgmma unconverted (its PTX has no
    cvt.rna.tf32 for input_precision="tf32", only for tf32x3's split)."""
    i = x.float().view(torch.int32)
    return (i & ~0x1FFF).view(torch.float32).to(x.dtype)


# What a knob can round to ("name=FORMAT"): bf16 is the dot dtype (``low``)
FORMATS = {"bf16": bf16, "tf32": tf32, "tf32z": tf32z, "split": split, "fp32": fp32}


def _unit_lower_inverse(A: Tensor, r) -> Tensor:
    """T = (I + A)⁻¹ as the prepare kernel forms it (prepare._unit_lower_inverse): D, the
    inverses of the four SUB × SUB diagonal blocks (exact here; in the kernel bf16/fp16 hi + lo
    pair products, ~16 bits as T's others, prepare.PREPARE_DIAG_PRECISION), then
    T = D − M(D − M(D − M D)) with M = D A_below, each product's operands passed through ``r``
    (the rounding of its dot: tf32 in the kernel)."""
    n = A.shape[-1]
    blocks = torch.arange(n, device=A.device) // SUB
    same = blocks[:, None] == blocks[None, :]
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    D = torch.linalg.inv(eye + A.masked_fill(~same, 0)).masked_fill(~same, 0)
    M = r(D) @ r(A.masked_fill(same, 0))
    return D - r(M) @ r(D - r(M) @ r(D - r(M) @ r(D)))


def _rule_terms(rule: str, ne: bool, beta: Tensor | None, lam: Tensor, eps: float):
    """a, b and their four partial derivatives, elementwise (autograd of deltaflow.rules)."""
    from deltaflow.rules import step_coefficients

    beta = torch.ones_like(lam) if beta is None else beta
    beta = beta.detach().requires_grad_(True)
    lam = lam.detach().requires_grad_(True)
    a, b = step_coefficients(rule, beta, lam, negative_eigenvalues=ne, eps=eps)
    z = torch.zeros_like(lam)

    def grads(y: Tensor, retain: bool) -> tuple:  # a constant strength (linear's a) has none
        if not y.requires_grad:
            return (None, None)
        return torch.autograd.grad(y.sum(), (beta, lam), allow_unused=True, retain_graph=retain)

    da, db = grads(a, True), grads(b, False)
    da_db, da_dl, db_db, db_dl = (z if g is None else g for g in (*da, *db))
    return a.detach(), b.detach(), da_db, da_dl, db_db, db_dl


def _sequence(x: dict, do: Tensor, ds: Tensor, rule, ne, knobs, scale, eps, given) -> dict:
    """Gradients of one sequence, all heads at once: x holds [H, L, ...] float64 tensors.
    ``given``: buffers (names of ``steps``, this sequence's chunks) that replace the
    emulation's own where the kernels store them, so later stages start from them."""

    def take(name: str, t: Tensor) -> Tensor:
        return given[name] if name in given else t

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
    T = take("t", _unit_lower_inverse(A, lambda t: r("T_tf32", t)))
    if "T_X" in knobs:  # prepare.PREPARE_FOLD_STRENGTHS: T diag(aΓ) rounded, K as loaded
        W = r("T_X", T * (a * Gamma)[..., None, :]) @ k
    else:
        W = r("T_W", T) @ r("X", (a * Gamma)[..., None] * k)
    if "T_Y" in knobs:
        Ut = r("T_Y", T * b[..., None, :]) @ v
    else:
        Ut = r("T_W", T) @ r("Y", b[..., None] * v)
    W, Ut = take("w", r("W", W)), take("u", r("Ut", Ut))

    # the state pass (4), (6): h and U
    S = x["initial_state"]
    h, U = [], []
    for c in range(n):
        h.append(r("h", S))
        Uc = Ut[c] - W[c] @ r("fwd_S", S)
        U.append(r("U", Uc))
        if "fwd_K" in knobs:  # the old kernel: K̃ = diag(e^{γ_C − γ}) K rounded, then U
            S = Gamma[c, :, -1, None, None] * S + r("fwd_K", k[c] * to_end[c][..., None]).mT @ r(
                "fwd_U", Uc
            )
        else:  # the kernel: the decay scales U's rows before its one rounding
            S = Gamma[c, :, -1, None, None] * S + k[c].mT @ r("fwd_U", to_end[c][..., None] * Uc)

    # the reverse pass (7)-(8): dh and dU
    G = ds
    dh, dU = [None] * n, [None] * n
    for c in reversed(range(n)):
        dh[c] = r("dh", G)
        P = r("rev_P", scale * QK[c] * Dm[c])  # scaled, then rounded (the kernel, fla)
        k_te = r("rev_K", k[c] * to_end[c][..., None])
        dUc = r("dv_local", P.mT @ do[c]) + k_te @ r("rev_G", G)
        dU[c] = r("dU", dUc)
        q_g = r("rev_q", q[c] * (scale * Gamma[c])[..., None])
        G = Gamma[c, :, -1, None, None] * G + q_g.mT @ do[c] - W[c].mT @ r("rev_update", dUc)
    d_s0 = G
    h, U, dh, dU = (take(n, torch.stack(t)) for n, t in zip(STATES, (h, U, dh, dU)))

    # the value-side gradient kernel (9), (11)
    T_t = r("T_dot", T).mT
    dY = T_t @ dU
    dYb = r("dY_dot", dY)
    dP = scale * (do @ U.mT)
    dA = -(dYb @ U.mT)
    dA = dA.masked_fill(~strict, 0)
    db = (dY * v).sum(-1)
    dv = b[..., None] * dY
    da = (dA * Dm * KK).sum(-1)
    dE = (dP * QK + dA * a[..., :, None] * KK) * Dm
    d_gamma = dE.sum(-1) - dE.sum(-2)
    M_P, M_A = r("M", dP * Dm), r("M", dA * a[..., :, None] * Dm)
    da_value, d_gamma_value, db_value = da, d_gamma, db  # the scratch rows the key side reads
    if "m" in given:
        M_P, M_A = given["m"].unbind(2)
    if "r" in given:
        da, d_gamma, db = given["r"].unbind(2)

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
        # the kernels' intermediate buffers, chunk-major ([n, H, ...]) as the kernels lay out
        # the per-chunk ones (capture() reads the token-major ones the same way)
        "steps": {
            "t": T,
            "w": W,
            "u": Ut,
            "h": h,
            "v_new": U,
            "dh": dh,
            "du": dU,
            "m": torch.stack([M_P, M_A], 2),
            "r": torch.stack([da_value, d_gamma_value, db_value], 2),
        },
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
    low: torch.dtype = torch.bfloat16,
    steps: dict[str, Tensor] | None = None,
    given: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """The gradients of ``q, k, v, beta, log_decay, initial_state`` (``x``: check_triton.make's
    dict, [B, T, H, ...]) for the output gradient ``grad_o`` and the final state's ``grad_state``,
    computed as the Triton backward does, in float64, with the bf16 roundings named in
    ``knobs`` (see ``KNOBS``; ``"name=tf32"`` / ``"name=split"`` round to tf32 or to a bf16
    hi + lo pair instead: candidate fixes). ``cu_seqlens``: packed sequences (B = 1), each
    with its own initial state. ``low``: the dot dtype the knobs round to (bf16; fp16 to compare
    with the Triton interpreter, whose bf16 dots are wrong but whose fp16 ones are right).
    ``steps``: a dict to fill with the backward's intermediate buffers (T, W, Ũ, h, U, dh, dU,
    the M and r scratch), chunk-major, every chunk of every sequence in order (see
    :func:`chunk_major`), to compare with the kernels' (:func:`capture`); ``given``: such
    buffers (the kernels', captured) used in place of the emulation's own from where they are
    formed on, so that a later stage's error can be told from an earlier one's."""
    if low not in (torch.bfloat16, torch.float16):
        raise ValueError(f"low: the dot dtype must be torch.bfloat16 or torch.float16, got {low}")
    rounding = {}
    for knob in knobs:
        name, _, fmt = knob.partition("=")
        if name not in KNOBS or (fmt and fmt not in FORMATS):
            raise ValueError(
                f"knobs: each must be a name of KNOBS {sorted(KNOBS)}, optionally '=FORMAT' "
                f"with FORMAT one of {sorted(FORMATS)} (what it is rounded to instead), "
                f"got {knob!r}"
            )
        fmt = fmt or ("tf32z" if name in TF32_KNOBS else "bf16")
        fn = FORMATS[fmt]
        rounding[name] = functools.partial(fn, low=low)
    x64 = {name: t.detach().double() for name, t in x.items()}
    B, T, H, Dk = x64["q"].shape
    scale = Dk**-0.5 if scale is None else scale
    spans = spans_of(B, T, cu_seqlens)
    grads: dict[str, Tensor] = {n: torch.zeros_like(t) for n, t in x64.items()}
    given = given or {}
    chunk = 0  # the first chunk of the sequence in the kernels' chunk-major buffers
    for i, (row, start, end) in enumerate(spans):
        seq = {
            n: x64[n][row, start:end].transpose(0, 1)  # [H, L, ...]
            for n in ("q", "k", "v", "beta", "log_decay")
        }
        seq["initial_state"] = x64["initial_state"][i]
        do = grad_o.double()[row, start:end].transpose(0, 1)
        n_chunks = -(-(end - start) // C)
        # (an empty sequence: no chunk in the kernels, one of padding in the emulation)
        mine = {n: t[chunk : chunk + n_chunks] for n, t in given.items() if n_chunks}
        chunk += n_chunks
        ds = grad_state.double()[i]
        out = _sequence(seq, do, ds, rule, negative_eigenvalues, rounding, scale, eps, mine)
        for n in ("q", "k", "v", "beta", "log_decay"):
            grads[n][row, start:end] = out[n].transpose(0, 1)
        grads["initial_state"][i] = out["initial_state"]
        if steps is not None and end > start:  # an empty sequence has no chunk in the kernels
            for n, t in out["steps"].items():
                steps[n] = t if n not in steps else torch.cat([steps[n], t])
    return grads


def chunk_major(x: Tensor, spans: list[tuple[int, int, int]]) -> Tensor:
    """A token-major [B, T, H, D] buffer (W, Ũ, U, dU) as the emulation's ``steps`` lay it out:
    [chunks, H, C, D], the chunks of each (row, start, end) span in order, zero-padded."""
    out = []
    for row, start, end in spans:
        if end > start:
            t = x[row, start:end]
            n = -(-t.shape[0] // C)
            t = torch.cat([t, t.new_zeros(n * C - t.shape[0], *t.shape[1:])])
            out.append(t.reshape(n, C, *t.shape[1:]).transpose(1, 2))
    return torch.cat(out)


@contextlib.contextmanager
def capture(found: dict[str, Tensor], spans: list[tuple[int, int, int]]):
    """Record the Triton backward's intermediate buffers into ``found`` (as float64, laid out as
    :func:`emulate`'s ``steps``): the backward's prepare (W, Ũ) and what the gradient kernels
    read (T, h, U, dh, dU, the M and r scratch), by wrapping triton_backend's launchers."""
    from deltaflow.ops import triton_backend as tb

    prepare, gradients = tb.launch_prepare, tb.launch_gradients

    def on_prepare(*args, **kw):
        prepare(*args, **kw)
        if kw["t"] is not None:  # the backward's (the forward stores no T)
            found.update(w=chunk_major(kw["w"], spans), u=chunk_major(kw["u"], spans))

    def on_gradients(*args, **kw):
        gradients(*args, **kw)
        found.update(t=kw["t"], h=kw["h"], dh=kw["dh"], m=kw["scratch_m"], r=kw["scratch_r"])
        found.update(v_new=chunk_major(kw["v_new"], spans), du=chunk_major(kw["du"], spans))

    # the recomputing backward ("none"): its prepare is the one captured above; the default "t"
    # rebuilds the same W, Ũ from a kept T (bit for bit: tests/test_save_t.py)
    save = tb.SAVE_FOR_BACKWARD
    tb.launch_prepare, tb.launch_gradients, tb.SAVE_FOR_BACKWARD = on_prepare, on_gradients, "none"
    try:
        yield found
    finally:
        tb.launch_prepare, tb.launch_gradients, tb.SAVE_FOR_BACKWARD = prepare, gradients, save
    for name, t in found.items():
        found[name] = t.detach().double().cpu()


def spans_of(B: int, T: int, cu_seqlens: Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence: B rows of T tokens, or the packed ``cu_seqlens``."""
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    bounds = [int(c) for c in cu_seqlens]
    return [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]


# ------------------------------------------------------------------------------- the GPU script
# check_triton's bf16 cases over tolerance and over 1.1x their floor on the H100, by label and
# rule (check_triton.plan gives their shapes, negative eigenvalues and seeds): at 2e6ac73
# (session 13, call 5: strengths folded into T) the first two; at 760bd6b (session 12) the rest,
# which pass since the fold.
CASES = [
    ("T=64", "trapezoid"),
    ("T=65", "longhorn"),
    ("T=200 Dk=Dv=256", "longhorn"),
    ("varlen", "longhorn"),
    ("T=65", "trapezoid"),
    ("T=64", "efla"),
    ("T=65", "relaxed_kaczmarz"),
]
# Triton variants: launch-setting flags set for one run (name -> {"module.FLAG": value}, the
# module under deltaflow.ops). The backward's prepare as the forward's (T's products on
# truncated tf32, the strengths folded into T: what session 13 measured, with dY and Γq split
# as now). (Not here: the backward's states in fp32, triton_backend.BACKWARD_STATES_FP32, moved
# none of session 12's cases, session 12 call 5; W and Ũ from tf32 operands,
# prepare.PREPARE_LOW_PRECISION_DOTS = False, results/issue30/s13probe.)
FLAGS = {
    "triton": {},
    "triton, backward prepare as the forward's": {
        "triton.prepare.BACKWARD_FOLD_STRENGTHS": True,
        "triton.prepare.BACKWARD_T_PRECISION": None,
    },
}
# The buffers the kernels store, in the order the backward forms them: the "emu on the kernels'
# buffers" rows replace the emulation's own with the kernels' one stage more at a time, so the
# stage where dβ jumps from the emulation's error to the kernels' is the stage to look at.
STAGES = [("t",), ("w", "u"), ("h", "v_new"), ("dh", "du"), ("m", "r")]


def _emulations() -> dict[str, tuple[str, ...]]:
    """Emulation variants: the kernels, the floor, session 13's kernels, each knob alone, and
    candidates past the floor (dU and G's cast split as well: fewer roundings than fla)."""
    flag = tuple(k for k in TRITON if k not in ("T_W", "X", "Y")) + ("T_tf32", "T_X", "T_Y")
    return {
        "emu: triton": TRITON,
        "emu: bf16 floor": FLOOR,
        "emu: session 13's kernels": TRITON_S13,
        "emu: triton, backward prepare as the forward's": flag,
        **{f"emu: {k} alone": (k,) for k in KNOBS},
        "emu: triton, dU and G split": tuple(
            f"{k}=split" if k in ("rev_G", "dU") else k for k in TRITON
        ),
    }


@contextlib.contextmanager
def flags_set(flags: dict[str, object]):
    """The launch-setting ``flags`` ({"module.FLAG": value} under deltaflow.ops) set, restored
    after."""
    import importlib

    saved = []
    try:
        for name, value in flags.items():
            module, _, attr = name.rpartition(".")
            mod = importlib.import_module(f"deltaflow.ops.{module}")
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def measure(label: str, rule: str, smoke: bool) -> tuple[str, dict, dict]:
    """One case: ({variant: {gradient: ‖Δ‖/‖ref‖}}, {variant: {buffer: ‖Δ‖/‖ref‖}}) for the
    Triton variants, the emulations and the emulation on the kernels' buffers; buffers against
    the float64 emulation's."""
    import _check_cases as ct
    import check_triton

    device = "cpu" if smoke else "cuda"
    dt = "fp32" if smoke else "bf16"  # the interpreter's bf16 dots are wrong: plumbing only
    dtype = torch.float16 if smoke else ct.DTYPES[dt]
    cases = [c[1] for c in check_triton.plan([dt], smoke, device) if c[0] == "op"]
    _, B, T, Dk, Dv, lengths, rule, ne, _, seed, _ = next(
        c for c in cases if c[0] == label and c[6] == rule
    )
    cu = None
    if lengths is not None:
        T = sum(lengths)
        cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    x = ct.make(B, T, Dk, Dv, rule, dtype, device, lengths and len(lengths), seed)
    kw = {"rule": rule, "negative_eigenvalues": ne, "cu_seqlens": cu}
    o, s, g_ref = ct.run(x, "torch", dtype=torch.float64, grad_dtype=dtype, **kw)
    names = ["beta", "log_decay"] + [n for n in ct.NAMES if n not in ("beta", "log_decay")]
    spans = spans_of(B, T, cu)
    exact: dict[str, Tensor] = {}
    do, ds = ct.output_grads(o, s, dtype)
    emulate(x, rule, ne, do, ds, cu_seqlens=cu, steps=exact)
    exact = {n: t.cpu() for n, t in exact.items()}

    def buffer_errors(found: dict[str, Tensor]) -> dict[str, float]:
        return {n: ct.rel(found[n].cpu(), exact[n]) for n in exact}

    rows, buffers, kernel = {}, {}, {}
    # smoke: fp16 through the interpreter (its fp16 dots are right), the kernels as they are
    for variant, flags in list(FLAGS.items())[: 1 if smoke else None]:
        found: dict[str, Tensor] = {}
        try:
            with flags_set(flags), capture(found, spans):
                grads = ct.run(x, "triton", grad_dtype=dtype, **kw)[2]
            rows[variant] = {n: ct.rel(grads[n], g_ref[n]) for n in names}
            buffers[variant] = buffer_errors(found)
            kernel = kernel or found
        except Exception as e:  # noqa: BLE001 - a variant that cannot run (shared memory) is a row
            rows[variant] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    low = dtype if dtype != torch.float32 else torch.bfloat16
    for variant, knobs in _emulations().items():
        steps: dict[str, Tensor] = {}
        grads = emulate(x, rule, ne, do, ds, cu_seqlens=cu, knobs=knobs, low=low, steps=steps)
        rows[variant] = {n: ct.rel(grads[n], g_ref[n]) for n in names}
        if variant in ("emu: triton", "emu: bf16 floor"):
            buffers[variant] = buffer_errors(steps)
    given: dict[str, Tensor] = {}
    for stage in STAGES if kernel else []:
        given.update({n: kernel[n].to(device) for n in stage})
        variant = f"emu on the kernels' {', '.join(given)}"
        grads = emulate(x, rule, ne, do, ds, cu_seqlens=cu, knobs=TRITON, low=low, given=given)
        rows[variant] = {n: ct.rel(grads[n], g_ref[n]) for n in names}
    return f"{label} {rule}{' +neg' if ne else ''}", rows, buffers


def table(results: list[tuple[str, dict, dict]]) -> str:
    """One row per variant, one column per case: 'dβ / d log α' (and the worst other gradient
    for the Triton rows); then the buffers' errors, one row per variant and case."""
    header = "| variant | " + " | ".join(case for case, _, _ in results) + " |"
    lines = [header, "|" + " --- |" * (len(results) + 1)]
    variants = list(dict.fromkeys(v for _, rows, _ in results for v in rows))
    for variant in variants:
        cells = []
        for _, rows, _ in results:
            e = rows.get(variant, {"error": "-"})
            if "error" in e:
                cells.append(e["error"])
                continue
            cell = f"{e['beta']:.1e} / {e['log_decay']:.1e}"
            if not variant.startswith("emu"):
                others = max(v for n, v in e.items() if n not in ("beta", "log_decay"))
                cell += f" (others ≤ {others:.1e})"
            cells.append(cell)
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    names = [n for n in STAGES for n in n]
    lines += [
        "",
        "Buffers, ‖Δ‖/‖ref‖ against the float64 emulation's (t: T; w, u: W, Ũ; v_new: U; "
        "m: M_P, M_A; r: the value side's da, dγ, db):",
        "",
        "| case | variant | " + " | ".join(names) + " |",
        "|" + " --- |" * (len(names) + 2),
    ]
    for case, _, buffers in results:
        for variant, errs in buffers.items():
            cells = " | ".join(f"{errs[n]:.1e}" for n in names)
            lines.append(f"| {case} | {variant} | {cells} |")
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
    device = "cpu (Triton interpreter, fp16)" if args.smoke else torch.cuda.get_device_name()
    text = (
        f"# bf16 gradient precision by rounding point: {device}, commit {git_commit()}\n\n"
        f"wall time: {time.perf_counter() - start:.0f} s\n\n"
        "‖Δ‖/‖ref‖ vs float64 of dβ / d log α, check_triton's inputs; Triton rows: the kernels "
        "(with the FLAGS named); emu rows: benchmarks/bf16_floor.py's float64 emulation "
        "with the named bf16 roundings (KNOBS; 'triton': TRITON, every rounding the kernels "
        "do); 'emu on the kernels' ...' rows: the emulation with TRITON's roundings started "
        "from the kernels' own buffers up to the stage named (STAGES).\n\n" + table(results)
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print("bf16_floor: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
