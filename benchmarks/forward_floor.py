"""The bf16 floor of the forward: the output ``o`` and the final state recomputed in float64 with
the roundings any bf16 chunked implementation does (fla's: bf16 storage of T, W, Ũ, the states
and U, the casts of its dots, the output itself), on the same inputs. ``bf16_floor.py`` does the
same for the gradients (its ``emulate``, FLOOR); ``check_triton.py`` judges an output or state
over tolerance against this floor as it judges a gradient against that one.

    python benchmarks/forward_floor.py     # check_triton's bf16 cases at 16-column heads (CPU)

prints, per case, the floor's error of o and of the final state against float64 (compare the
GPU's, ``results/issue31/s17call4/check_triton_narrow.md``).
"""

from __future__ import annotations

import functools
import sys

import torch
from bf16_floor import FLOOR, FORMATS, C, _unit_lower_inverse, spans_of
from torch import Tensor

# Roundings of the forward that the backward's emulation has no use for, with fla's reason
FORWARD_KNOBS = {
    "out_P": "chunk_fwd_o: the masked, decayed Q Kᵀ block cast to bf16 (b_A.to(b_v.dtype)) for "
    "its dot with U (the kernels: P.to(DT))",
    "o": "o = torch.empty_like(v): the output stored in bf16",
}
# FLOOR's forward knobs (the rest round gradients) and the output's own
FORWARD_FLOOR = (
    *(k for k in FLOOR if k in ("T_W", "X", "Y", "W", "Ut", "h", "U", "fwd_S", "fwd_U")),
    *FORWARD_KNOBS,
)

# What the two-pass forward (prepare, state pass, outputs) rounds in bf16: T's products from
# truncated tf32 operands, the strengths folded into T before its one rounding
# (prepare.PREPARE_FOLD_STRENGTHS), then the floor's storage and casts
KERNELS_TWO_PASS = (
    "T_tf32=tf32z",
    "T_X",
    "T_Y",
    *(k for k in FORWARD_FLOOR if k not in ("T_W", "X", "Y")),
)


def emulate_forward(
    x: dict,
    rule: str,
    negative_eigenvalues: bool,
    *,
    cu_seqlens: Tensor | None = None,
    knobs: tuple[str, ...] = FORWARD_FLOOR,
    scale: float | None = None,
    eps: float = 1e-6,
    low: torch.dtype = torch.bfloat16,
) -> dict[str, Tensor]:
    """``{"o": [B, T, H, Dv], "state": [N, H, Dk, Dv]}`` in float64 for check_triton.make's
    inputs ``x``, each of ``knobs`` (names of bf16_floor.KNOBS or FORWARD_KNOBS) rounding its
    value to ``low`` (bf16, or fp16). No knobs: the exact float64 forward (tests pin it to the
    reference at 1e-10). The final state is fla's fp32 register state: not rounded."""
    from deltaflow.rules import step_coefficients

    fns = {}
    for knob in knobs:  # "name" (to low) or "name=FORMAT" (bf16_floor.FORMATS)
        name, _, fmt = knob.partition("=")
        fns[name] = functools.partial(FORMATS[fmt or "bf16"], low=low)

    def r(knob: str, t: Tensor) -> Tensor:
        return fns[knob](t) if knob in fns else t

    x64 = {n: t.detach().double().cpu() for n, t in x.items()}
    B, T, H, Dk = x64["q"].shape
    scale = Dk**-0.5 if scale is None else scale
    spans = spans_of(B, T, cu_seqlens)
    o = torch.zeros_like(x64["v"])
    states = torch.zeros(len(spans), H, Dk, x64["v"].shape[-1], dtype=torch.float64)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    strict = causal.tril(-1)
    for i, (row, start, end) in enumerate(spans):
        q, k, v, beta, g = (
            x64[n][row, start:end].transpose(0, 1) for n in ("q", "k", "v", "beta", "log_decay")
        )
        L = end - start
        n = max(-(-L // C), 1)
        lam = (k * k).sum(-1)
        a, b = step_coefficients(
            rule, beta, lam, negative_eigenvalues=negative_eigenvalues, eps=eps
        )

        def chunks(t: Tensor, n=n, L=L) -> Tensor:  # [H, L, ...] -> [n, H, C, ...]
            t = torch.cat([t, t.new_zeros(H, n * C - L, *t.shape[2:])], 1)
            return t.reshape(H, n, C, *t.shape[2:]).transpose(0, 1)

        q, k, v, a, b, g = (chunks(t) for t in (q, k, v, a, b, g))
        gamma = g.cumsum(-1)
        Dm = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf))
        Gamma, to_end = gamma.exp(), torch.exp(gamma[..., -1:] - gamma)
        A = (a[..., :, None] * Dm * (k @ k.mT)).masked_fill(~strict, 0)
        Tm = _unit_lower_inverse(A, lambda t: r("T_tf32", t))  # fp32-accurate in fla
        if "T_X" in fns:  # the kernels' forward: the strengths folded into T, K and V exact
            W = r("W", r("T_X", Tm * (a * Gamma)[..., None, :]) @ k)
            Ut = r("Ut", r("T_Y", Tm * b[..., None, :]) @ v)
        else:
            W = r("W", r("T_W", Tm) @ r("X", (a * Gamma)[..., None] * k))
            Ut = r("Ut", r("T_W", Tm) @ r("Y", b[..., None] * v))
        P = r("out_P", (q @ k.mT) * Dm)
        S = x64["initial_state"][i]
        out = []
        for c in range(n):
            h = r("h", S)
            U = Ut[c] - W[c] @ r("fwd_S", S)
            out.append(scale * (Gamma[c][..., None] * (q[c] @ h) + P[c] @ r("U", U)))
            S = Gamma[c, :, -1, None, None] * S + k[c].mT @ r("fwd_U", to_end[c][..., None] * U)
        o[row, start:end] = torch.cat(out, 1)[:, :L].transpose(0, 1)
        states[i] = S
    return {"o": r("o", o), "state": states}


def main() -> int:
    import check_triton
    from _check_cases import DTYPES, make, rel

    from deltaflow import delta_rule

    labels = ("T=130 Dk=Dv=16", "T=70 Dk=16 Dv=64", "T=70 Dk=64 Dv=16")
    for kind, args in check_triton.plan(["bf16"], False, "cpu"):
        if kind != "op" or args[0] not in labels:
            continue
        label, B, T, Dk, Dv, _, rule, ne, dt, seed, _ = args
        x = make(B, T, Dk, Dv, rule, DTYPES[dt], "cpu", None, seed)
        kw = {"rule": rule, "negative_eigenvalues": ne}
        with torch.no_grad():
            o_ref, s_ref = delta_rule(
                **{n: t.double() for n, t in x.items()},
                output_final_state=True,
                backend="torch",
                **kw,
            )
        floor = emulate_forward(x, rule, ne)
        kernels = emulate_forward(x, rule, ne, knobs=KERNELS_TWO_PASS)
        print(
            f"{label:18} {rule:16} ne={ne!s:5}  floor o={rel(floor['o'], o_ref):.1e} "
            f"state={rel(floor['state'], s_ref):.1e}  the kernels' roundings "
            f"o={rel(kernels['o'], o_ref):.1e} state={rel(kernels['state'], s_ref):.1e}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
