"""check_triton.py's cases: the inputs, the float64 references and what each case compares
(the op forward and backward, decode in place and under CUDA-graph capture, non-finite
causality, torch.compile), and where a case process spends its time. Each case is a picklable
tuple (kind, args) that a worker runs; it returns report rows (label, rule, neg. eig., dtype,
errors, ok, note). While TRACING (check_triton.trace), a case runs on CPU tensors with its
Triton launches intercepted and stops after them."""

from __future__ import annotations

import contextlib
import os
import time

import torch

# fp16: bf16's 5e-3 scaled by 2^-3 (three more mantissa bits: unit roundoff 2^-11 vs 2^-8) is
# 6.3e-4; 1e-3 since the forward's T products take fp32 operands as tf32 (10 bits, truncated on
# sm_90: up to 2^-10 = 9.8e-4 relative per operand), which gain nothing from fp16's extra bits.
TOL = {"bf16": 5e-3, "fp16": 1e-3, "fp32": 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]
H = 2  # one head count everywhere: H is a compile-time constant of every kernel

# (label, B, T, Dk, Dv, varlen lengths): every chunk boundary case, head sizes not a power of
# two, Dk != Dv both ways, D = 256, a long sequence, varlen with empty and 1-token sequences,
# and heads of 16 columns: bf16/fp16 inputs there run the fp32 kernels (triton_ops.HALF_MIN_HEAD,
# since session 18: on the half-precision kernels, padded to 64-column blocks, 7 such bf16 cases
# were at 5.0-6.7e-3), so their errors are the outputs' and gradients' bf16 storage alone.
SHAPES = [
    ("T=1", 2, 1, 64, 64, None),
    ("T=63", 2, 63, 64, 64, None),
    ("T=64", 2, 64, 128, 128, None),
    ("T=65", 2, 65, 128, 64, None),
    ("T=1000 Dk=100 Dv=72", 1, 1000, 100, 72, None),
    ("T=4096", 1, 4096, 128, 128, None),
    ("varlen", 1, None, 64, 128, [0, 1, 63, 64, 65, 1000, 0, 300]),
    ("T=200 Dk=Dv=256", 1, 200, 256, 256, None),
    ("T=130 Dk=Dv=16", 1, 130, 16, 16, None),
    ("T=70 Dk=16 Dv=64", 1, 70, 16, 64, None),
    ("T=70 Dk=64 Dv=16", 1, 70, 64, 16, None),
    ("T=65 Dk=20 Dv=12", 1, 65, 20, 12, None),  # fp32 blocks 32 / 16 faulted (common.py)
]
SMOKE_SHAPES = [("T=65", 1, 65, 32, 16, None)]
SMOKE_RULES = [
    "delta",
    "efla",
    "kaczmarz",
    "gated_efla",
]  # unit keys, raw keys, a rule without beta, the rule whose strengths read the decay


def make(B, T, Dk, Dv, rule, dtype, device, n_states=None, seed=0):
    from deltaflow.rules import RULES

    device = on(device)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(B, T, H, Dk, device=device, generator=g)
    if RULES[rule].qk_norm[1] == "l2":  # the rules used with L2-normalized keys
        k = torch.nn.functional.normalize(k, dim=-1)
    else:  # raw keys of varied norm
        k = k * (0.1 + torch.rand(B, T, H, 1, device=device, generator=g))
    x = {
        "q": torch.randn(B, T, H, Dk, device=device, generator=g),
        "k": k,
        "v": torch.randn(B, T, H, Dv, device=device, generator=g),
        "beta": torch.rand(B, T, H, device=device, generator=g),
        "log_decay": -0.1 * torch.rand(B, T, H, device=device, generator=g),
        "initial_state": torch.randn(n_states or B, H, Dk, Dv, device=device, generator=g),
    }
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return x


# While TRACING, a case runs on CPU tensors with every Triton launch intercepted (_launches.py):
# sizes still follow the case's device ("cuda" sizes for the GPU plan), tensors do not, and the
# case stops after its Triton calls (the float64 references would only cost CPU time).
TRACING = False


def on(device: str) -> str:
    """Where a case's tensors live: its device, or the CPU while tracing."""
    return "cpu" if TRACING else device


# Where a case process spends its time (reported beside each case's result): the seconds of
# each phase of the case, and Triton compiles it did itself (the compile phase should leave
# none: a compile here is a specialization the trace missed).
TIMES: dict[str, float] = {}


@contextlib.contextmanager
def timed(phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        TIMES[phase] = TIMES.get(phase, 0.0) + time.perf_counter() - start


COMPILED: list[str] = []  # kernels a case compiled itself, named in its log line


def _on_compile(*, src, metadata, metadata_group, times, cache_hit) -> None:
    """Name a kernel compiled outside the compile phase, and its pointers Triton did not find
    16-byte aligned (the specialization detail most likely to differ from the trace's)."""
    if cache_hit:
        return
    sig, attrs = getattr(src, "signature", {}), getattr(src, "attrs", {})
    aligned = {i for (i, *_), v in attrs.items() if any(a[0] == "tt.divisibility" for a in v)}
    odd = [n for i, (n, t) in enumerate(sig.items()) if str(t).startswith("*") and i not in aligned]
    COMPILED.append(f"{getattr(src, 'name', '?')}(unaligned: {' '.join(odd) or 'none'})")


def process_age() -> float:
    """Seconds since this process started (Linux; 0 elsewhere): a case's start-up cost."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def rel(x, ref):
    if x is None or ref is None:  # an unused input (beta of kaczmarz): None and zeros agree
        other = ref if x is None else x
        return 0.0 if other is None or not other.abs().any() else float("inf")
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    if ref.norm() == 0:
        return x.norm().item()
    return ((x - ref).norm() / ref.norm()).item()


def run(x, backend, dtype=None, grad_dtype=torch.float64, **kw):
    """Output, final state and input gradients of one call. The output gradient reaches a bf16
    output as bf16: both the kernel and its float64 reference get it rounded to ``grad_dtype``
    (the case's dtype), so that, as with the inputs, only the kernels' arithmetic is measured."""
    from deltaflow import delta_rule

    leaves = {n: t.detach().clone().to(dtype or t.dtype).requires_grad_(True) for n, t in x.items()}
    o, s = delta_rule(**leaves, output_final_state=True, backend=backend, **kw)
    do, ds = output_grads(o, s, grad_dtype)
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    return o.detach(), s.detach(), {n: leaves[n].grad for n in NAMES}


def output_grads(o, s, grad_dtype=torch.float64):
    """The gradients :func:`run` sends into the output ``o`` (rounded to ``grad_dtype``) and the
    final state ``s`` (float32), as float64: fixed by the shapes (seeded)."""
    g = torch.Generator(device=o.device).manual_seed(123)
    do = torch.randn(o.shape, device=o.device, generator=g, dtype=torch.float64)
    ds = torch.randn(s.shape, device=o.device, generator=g, dtype=torch.float64)
    return do.to(grad_dtype).double(), ds.float().double()  # the state is float32


def decode_step(*args, **kw):
    """deltaflow.delta_rule_step; while tracing (CPU tensors, which the public step keeps on
    its torch path), the Triton entry it dispatches to on a GPU. eps and scale are runtime
    arguments of the kernel: any value traces the same specialization."""
    from deltaflow import delta_rule_step

    if not TRACING:
        return delta_rule_step(*args, **kw)
    from deltaflow.ops import triton_backend

    defaults = {"log_decay": None, "negative_eigenvalues": False, "eps": 1e-6, "scale": 1.0}
    return triton_backend.delta_rule_step(*args, **{"rule": "delta", **defaults, **kw})


def forward(x, mode: str, **kw):
    """The Triton forward's output with ``triton_backend.FORWARD_MODE`` pinned to ``mode``."""
    from deltaflow import delta_rule
    from deltaflow.ops import triton_backend

    triton_backend.FORWARD_MODE = mode
    try:
        with torch.no_grad():
            return delta_rule(**x, backend="triton", **kw)[0]
    finally:
        triton_backend.FORWARD_MODE = "auto"


def worst(errs: dict) -> float:
    return max(errs.values(), key=lambda e: float("inf") if e != e else e)


# ------------------------------------------------------------------------------------ the cases
# Each case is a picklable tuple (kind, args); a worker runs it and returns report rows
# (label, rule, neg. eig., dtype, errors, ok, note).


def case_op(label, B, T, Dk, Dv, lengths, rule, ne, dt, seed, device):
    from deltaflow import delta_rule

    cu = None
    if lengths is not None:
        T = sum(lengths)
        cu = torch.tensor([0] + lengths, device=on(device)).cumsum(0)
    x = make(
        B, T, Dk, Dv, rule, DTYPES[dt], device, None if lengths is None else len(lengths), seed
    )
    kw = {"rule": rule, "negative_eigenvalues": ne, "cu_seqlens": cu}
    # The forward as "auto" chooses it (two-pass at H = 2: fewer programs than multiprocessors),
    # and the fused forward, which large batches take: both kernels, every shape and dtype.
    with timed("kernels"):
        o, s, grads = run(x, "triton", grad_dtype=DTYPES[dt], **kw)
        o_fused = forward(x, "fused", **kw)
    if TRACING:
        return []
    with timed("reference"):
        o_ref, s_ref, g_ref = run(x, "torch", dtype=torch.float64, grad_dtype=DTYPES[dt], **kw)
    if T <= 1000:  # the chunked float64 reference against the token loop
        with torch.no_grad(), timed("token loop"):
            o_naive, s_naive = delta_rule(
                **{n: t.double() for n, t in x.items()},
                output_final_state=True,
                backend="reference",
                **kw,
            )
        assert rel(o_ref, o_naive) < 1e-9 and rel(s_ref, s_naive) < 1e-9, "reference disagrees"
    errs = {"o": rel(o, o_ref), "o fused": rel(o_fused, o_ref), "state": rel(s, s_ref)}
    errs.update({f"d{n}": rel(grads[n], g_ref[n]) for n in NAMES})
    ok = worst(errs) <= TOL[dt]
    if dt != "fp32" and not ok:  # over tolerance: how far does half precision itself get here?
        with timed("floor"):
            errs["bf16 floor"], ok = bf16_floor(
                x,
                errs,
                g_ref,
                output_grads(o_ref, s_ref, DTYPES[dt]),
                TOL[dt],
                low=DTYPES[dt],
                refs={"o": o_ref, "state": s_ref},
                **kw,
            )
    return [(label, rule, ne, dt, errs, ok, "")]


# A gradient over tolerance passes within this factor of its floor: where the kernels round
# exactly where the floor does (T = 1: GPU 1.2e-2 vs floor 1.2e-2, session 12), the two still
# differ by fp32 accumulation order; anything further is the kernels' own error.
FLOOR_MARGIN = 1.1


def bf16_floor(
    x,
    errs,
    g_ref,
    grads,
    tol,
    *,
    rule,
    negative_eigenvalues,
    cu_seqlens,
    low=torch.bfloat16,
    refs=None,
):
    """(the floor's error of the worst entry of ``errs`` over ``tol``, whether every entry over
    it is within FLOOR_MARGIN of its floor): the float64 gradients for the output gradients
    ``grads`` recomputed with ``bf16_floor.FLOOR``'s roundings, to ``low`` (bf16, or fp16 for
    the fp16 cases: the same rounding points, fp16's storage); with ``refs`` (the float64 "o"
    and "state"), the output and the final state likewise (forward_floor.py: fla's forward
    roundings); without, those have no floor: over tolerance, they fail."""
    from bf16_floor import FLOOR, emulate
    from forward_floor import emulate_forward

    floor = emulate(
        x, rule, negative_eigenvalues, *grads, cu_seqlens=cu_seqlens, knobs=FLOOR, low=low
    )
    over = [n for n, e in errs.items() if not e <= tol]  # NaN is over
    floors = {n: rel(floor[n[1:]], g_ref[n[1:]]) if n[1:] in floor else float("nan") for n in over}
    forward = {"o": "o", "o fused": "o", "state": "state"}
    if refs is not None and any(n in forward for n in over):
        fwd = emulate_forward(x, rule, negative_eigenvalues, cu_seqlens=cu_seqlens, low=low)
        for n in over:
            if n in forward:
                ref = refs[forward[n]]
                floors[n] = rel(fwd[forward[n]].to(ref.device), ref)
    worst_over = max(over, key=lambda n: float("inf") if errs[n] != errs[n] else errs[n])
    return floors[worst_over], all(errs[n] <= FLOOR_MARGIN * floors[n] for n in over)


def case_decode(rule, device):
    from deltaflow import delta_rule

    Dk, Dv = (128, 64) if device == "cuda" else (32, 16)
    x = make(4, 6, Dk, Dv, rule, torch.bfloat16, device, seed=7)
    o_ref, s_ref = delta_rule(
        **{n: t.double() for n, t in x.items()},
        rule=rule,
        output_final_state=True,
        backend="reference",
    )
    state = x["initial_state"].clone()
    outs = [
        decode_step(
            *(x[n][:, t : t + 2] for n in ("q", "k", "v", "beta")),
            state,
            rule=rule,
            log_decay=x["log_decay"][:, t : t + 2],
        )
        for t in range(0, 6, 2)
    ]
    errs = {"o": rel(torch.cat(outs, 1), o_ref), "state": rel(state, s_ref)}
    return [("decode 3x2 tokens", rule, False, "bf16", errs, worst(errs) <= TOL["bf16"], "")]


def case_decode_graph(device):
    """Decode under CUDA-graph capture: no host sync, the state updated in place on replay."""
    from deltaflow import delta_rule

    x = make(8, 1, 128, 128, "delta", torch.bfloat16, device, seed=5)
    state = x["initial_state"].clone()
    args = [x[n].clone() for n in ("q", "k", "v", "beta")]
    decay = x["log_decay"].clone()
    decode_step(*args, state.clone(), log_decay=decay)  # compile outside the capture
    if TRACING:
        return []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(*args, state, log_decay=decay)
    state.copy_(x["initial_state"])
    graph.replay()
    o_ref, s_ref = delta_rule(
        **{n: t.double() for n, t in x.items()}, output_final_state=True, backend="reference"
    )
    errs = {"o": rel(out, o_ref), "state": rel(state, s_ref)}
    return [("decode in a CUDA graph", "delta", False, "bf16", errs, worst(errs) <= 5e-3, "")]


def case_causal(rule, device):
    """A NaN or inf planted in k, v or beta at token t leaves every earlier output of that
    sequence bit-identical (both forward kernels), and makes that head's outputs from t on and
    its final state non-finite."""
    from deltaflow import delta_rule
    from deltaflow.ops import triton_backend
    from deltaflow.rules import RULES

    T = 300 if device == "cuda" else 70
    tokens = [5, 70, 129, 250] if device == "cuda" else [5, 40]
    # bf16 on the GPU; fp32 in the CPU interpreter, whose bf16 dot turns NaN operands finite
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    D = 64 if device == "cuda" else 16
    rows, base = [], make(2, T, D, D, rule, dtype, device, seed=11)
    for mode in ("fused", "two_pass"):
        triton_backend.FORWARD_MODE = mode
        try:
            clean, _ = delta_rule(**base, rule=rule, backend="triton", output_final_state=True)
            bad_runs = 0
            for i, t in enumerate(tokens):
                # kaczmarz never reads beta: plant in k and v only for rules without beta
                names = ("k", "v", "beta") if RULES[rule].needs_beta else ("k", "v")
                name = names[i % len(names)]
                value = float("nan") if i % 2 == 0 else float("inf")
                x = {n: v.clone() for n, v in base.items()}
                if name == "beta":
                    x[name][1, t, 0] = value
                else:
                    x[name][1, t, 0, 0] = value
                o, s = delta_rule(
                    **x, rule=rule, backend="triton", output_final_state=True, check_values=False
                )
                same_before = torch.equal(o[1, :t], clean[1, :t]) and torch.equal(o[0], clean[0])
                poisoned = (
                    not torch.isfinite(o[1, t:, 0]).any() and not torch.isfinite(s[1, 0]).all()
                )
                bad_runs += not (same_before and poisoned)
        finally:
            triton_backend.FORWARD_MODE = "auto"
        errs = {"o": float(bad_runs)}
        label = f"non-finite causal ({mode}, tokens {tokens})"
        dt = "bf16" if dtype == torch.bfloat16 else "fp32"
        rows.append((label, rule, False, dt, errs, bad_runs == 0, "o = failing plants"))
    return rows


def case_compile(device):
    from deltaflow import delta_rule

    x = make(2, 300, 64, 64, "efla", torch.bfloat16, device, seed=3)

    def f(q, k, v, beta, log_decay, initial_state):
        # backend: what "auto" picks on a GPU, named so that a CPU trace picks it too
        kw = {"log_decay": log_decay, "initial_state": initial_state, "backend": "triton"}
        o, s = delta_rule(q, k, v, beta, rule="efla", output_final_state=True, **kw)
        return o.float().sum() + s.sum()

    if TRACING:  # the compiled graph launches the eager call's kernels
        f(*(x[n].detach().clone().requires_grad_(True) for n in NAMES)).backward()
        return []
    compiled = torch.compile(f, fullgraph=True)
    leaves = [x[n].detach().clone().requires_grad_(True) for n in NAMES]
    compiled(*leaves).backward()
    eager = [x[n].detach().clone().requires_grad_(True) for n in NAMES]
    f(*eager).backward()
    errs = {f"d{n}": rel(a.grad, b.grad) for n, a, b in zip(NAMES, leaves, eager)}
    return [("torch.compile fullgraph", "efla", False, "bf16", errs, worst(errs) <= 1e-3, "")]


CASES = {
    "op": case_op,
    "decode": case_decode,
    "decode_graph": case_decode_graph,
    "causal": case_causal,
    "compile": case_compile,
}
