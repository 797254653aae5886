"""Long-run growth of the state ||S_t|| under each step rule, in each precision.

We run the bare recurrence (no decay, one head)

    S_t = S_{t-1} + k_t (b_t v_t - a_t S_{t-1}^T k_t)^T        (= (I - a kk^T) S + b k v^T)

over long random sequences, for many independent chains at once: every (rule, negative
eigenvalues, key regime, beta regime, seed) is one row of a batch, so one Python loop over t
advances all of them. Chains that differ only in rule or precision see the same (k, v, beta), so
their curves are paired comparisons.

Low precision is emulated the way a low-precision kernel computes: k, v and beta are rounded to
the input dtype; lam = ||k||^2 and (a, b) = `deltaflow.rules.step_coefficients(...)` are computed
in that dtype; the update is computed in float32 (float64 for the reference) from those values and
the new state is rounded to the state dtype after every step. A float64 run on the unrounded
inputs is the reference for the error.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from deltaflow.rules import get_rule, step_coefficients

DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
KEY_REGIMES = {
    "unit": "x / ||x||, x ~ N(0, I): L2-normalized keys (||k|| = 1 before rounding)",
    "gaussian": "k ~ N(0, I): raw keys, ||k||^2 ~ Dk",
    "heavy": "multivariate Student-t, 2 degrees of freedom: raw keys with heavy-tailed norms",
    "vocab:V": "unit keys drawn from a fixed set of V unit vectors (repeated tokens)",
}
BETA_REGIMES = {
    "uniform": "beta ~ U(0, 1) (uniform:HI for U(0, HI))",
    "near1": "beta = 1 - U(0, 1e-3): pinned near 1 (rounds to exactly 1 in bf16)",
    "one": "beta = 1",
    "const:C": "beta = C",
    "softplus": "beta = softplus(2 z), z ~ N(0, 1): unbounded (median 0.69, 1% above 5)",
}


@dataclass(frozen=True)
class Precision:
    """Input dtype (k, v, beta, lam, a, b) and state dtype; written 'bf16' or 'bf16/fp32'."""

    name: str
    input_dtype: torch.dtype
    state_dtype: torch.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        # The arithmetic of one step: float64 only for the float64 reference.
        both64 = self.input_dtype == torch.float64 and self.state_dtype == torch.float64
        return torch.float64 if both64 else torch.float32


def parse_precision(spec: str) -> Precision:
    """'fp32' | 'bf16' | 'fp16' | 'fp64' (inputs and state), or 'IN/STATE', e.g. 'bf16/fp32'."""
    parts = spec.split("/")
    if len(parts) not in (1, 2) or any(p not in DTYPES for p in parts):
        raise ValueError(
            f"precision {spec!r}: expected D or D_in/D_state with D in {sorted(DTYPES)}"
        )
    return Precision(spec, DTYPES[parts[0]], DTYPES[parts[-1]])


@dataclass(frozen=True)
class Chain:
    """One independent run of the recurrence."""

    rule: str
    negative_eigenvalues: bool
    keys: str
    betas: str
    seed: int

    @property
    def stream(self) -> tuple[str, str, int]:
        # Chains with the same stream see the same (k, v, beta) sequence.
        return (self.keys, self.betas, self.seed)

    @property
    def label(self) -> str:
        return f"{self.rule}{'[-1,1]' if self.negative_eigenvalues else ''}"


def check_regimes(keys: Sequence[str], betas: Sequence[str]) -> None:
    for k in keys:
        if _vocab_size(k) is None and k not in KEY_REGIMES:
            raise ValueError(f"key regime {k!r}: expected one of {sorted(KEY_REGIMES)}")
    for b in betas:
        _beta_sampler(b)  # raises on a bad spec


def _beta_sampler(spec: str):
    name, _, arg = spec.partition(":")
    try:
        val = float(arg) if arg else None
    except ValueError:
        val = math.nan
    if name == "uniform" and (val is None or 0 < val):
        hi = 1.0 if val is None else val
        return lambda n, g: torch.rand(n, generator=g, dtype=torch.float64) * hi
    if name == "near1" and not arg:
        return lambda n, g: 1 - 1e-3 * torch.rand(n, generator=g, dtype=torch.float64)
    if name == "one" and not arg:
        return lambda n, g: torch.ones(n, dtype=torch.float64)
    if name == "const" and val is not None and val >= 0:
        return lambda n, g: torch.full((n,), val, dtype=torch.float64)
    if name == "softplus" and not arg:
        return lambda n, g: torch.nn.functional.softplus(
            2 * torch.randn(n, generator=g, dtype=torch.float64)
        )
    raise ValueError(
        f"beta regime {spec!r}: expected uniform, uniform:HI (HI > 0), near1, one, const:C "
        "(C >= 0) or softplus"
    )


def _vocab_size(keys: str) -> int | None:
    name, _, arg = keys.partition(":")
    if name != "vocab":
        return None
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"key regime {keys!r}: expected vocab:V with an integer V >= 1")
    return int(arg)


def sample_stream(
    keys: str, betas: str, n: int, dk: int, dv: int, g: torch.Generator, vocab_seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n steps of (k [n, dk], v [n, dv], beta [n]) in float64 from generator g.

    For vocab:V keys the V unit vectors come from `vocab_seed`, so every block of a stream
    draws from the same vocabulary."""
    x = torch.randn(n, dk, generator=g, dtype=torch.float64)
    vocab = _vocab_size(keys)
    if vocab is not None:
        vg = torch.Generator().manual_seed(vocab_seed)
        table = torch.randn(vocab, dk, generator=vg, dtype=torch.float64)
        table = table / table.norm(dim=-1, keepdim=True)
        k = table[torch.randint(vocab, (n,), generator=g)]
    elif keys == "unit":
        k = x / x.norm(dim=-1, keepdim=True)
    elif keys == "gaussian":
        k = x
    elif keys == "heavy":
        # k = z / sqrt(w / nu), w ~ chi2(nu), nu = 2: chi2(2) is Exp(mean 2), so w/nu ~ Exp(1).
        w = -torch.log1p(-torch.rand(n, 1, generator=g, dtype=torch.float64))
        k = x / w.sqrt()
    else:
        raise ValueError(f"key regime {keys!r}: expected one of {sorted(KEY_REGIMES)}")
    v = torch.randn(n, dv, generator=g, dtype=torch.float64)
    beta = _beta_sampler(betas)(n, g)
    return k, v, beta


def _stream_seed(stream: tuple[str, str, int], base_seed: int) -> int:
    # Stable across runs and Python versions (unlike hash()).
    return zlib.crc32(f"{stream}|{base_seed}".encode()) & 0x7FFFFFFF


def _input_blocks(streams, steps: int, dk: int, dv: int, seed: int, block: int):
    """Yield (k [tb, S, dk], v [tb, S, dv], beta [tb, S]) float64 blocks for the streams.
    Each stream has its own generator, so a stream's inputs do not depend on the others."""
    seeds = [_stream_seed(s, seed) for s in streams]
    gens = [torch.Generator().manual_seed(sd) for sd in seeds]
    for t0 in range(0, steps, block):
        tb = min(block, steps - t0)
        ks, vs, bs = zip(
            *(
                sample_stream(s[0], s[1], tb, dk, dv, g, sd + 1)
                for s, g, sd in zip(streams, gens, seeds)
            )
        )
        yield torch.stack(ks, 1), torch.stack(vs, 1), torch.stack(bs, 1)


def stream_inputs(
    chain: Chain, steps: int, dk: int, dv: int, seed: int = 0, block: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact float64 (k [T, dk], v [T, dv], beta [T]) that `simulate` feeds `chain` (same
    steps, dk, dv, seed and block): for checking the simulation against `deltaflow.delta_rule`."""
    parts = list(_input_blocks([chain.stream], steps, dk, dv, seed, block))
    return tuple(torch.cat([p[i][:, 0] for p in parts]) for i in range(3))


@dataclass
class GrowthResult:
    chains: list[Chain]
    precisions: list[Precision]
    steps: torch.Tensor  # [R] recorded step indices t (1-based: S_t after t tokens)
    norms: dict[str, torch.Tensor]  # precision -> [R, N] ||S_t||_F (float64; inf/nan kept)
    rel_err: dict[str, torch.Tensor]  # precision -> [R, N] ||S_t - S_t^fp64|| / ||S_t^fp64||
    first_nonfinite: dict[str, torch.Tensor]  # precision -> [N] first t with a non-finite entry
    mu_max: dict[str, torch.Tensor]  # precision -> [N] max |mu| of the rounded (a, k) seen
    frac_mu_gt1: dict[str, torch.Tensor]  # precision -> [N] fraction of steps with |mu| > 1
    final_states: dict[str, torch.Tensor]  # precision -> [N, dk, dv] S_T in the state dtype
    config: dict = field(default_factory=dict)


def simulate(
    chains: Sequence[Chain],
    precisions: Sequence[str | Precision],
    *,
    steps: int = 10_000,
    dk: int = 32,
    dv: int = 16,
    eps: float = 1e-6,
    seed: int = 0,
    device: str | torch.device = "cpu",
    block: int = 512,
    records: int = 1000,
    initial_state: torch.Tensor | None = None,
    zero_values: bool = False,
    progress: bool = True,
) -> GrowthResult:
    """Run every chain in every precision (plus a float64 reference) for `steps` tokens.

    initial_state: optional float64 [N, dk, dv] S_0 (default zeros). zero_values=True sets v = 0
    (pure products of transitions: with a reflection, ||S_t|| must stay ||S_0|| exactly).
    """
    chains = list(chains)
    if not chains:
        raise ValueError("chains is empty")
    for c in chains:
        get_rule(c.rule)  # unknown rule -> ValueError naming the known ones
    check_regimes({c.keys for c in chains}, {c.betas for c in chains})
    if steps < 1 or dk < 1 or dv < 1 or block < 1 or records < 1:
        raise ValueError(
            f"steps, dk, dv, block, records must be >= 1, got {steps}, {dk}, {dv}, {block}, "
            f"{records}"
        )
    precs = [p if isinstance(p, Precision) else parse_precision(p) for p in precisions]
    ref = parse_precision("fp64")
    if all(p.name != "fp64" for p in precs):
        precs = [ref, *precs]
    n = len(chains)
    if initial_state is not None and tuple(initial_state.shape) != (n, dk, dv):
        raise ValueError(
            f"initial_state must be [N={n}, dk={dk}, dv={dv}], got {tuple(initial_state.shape)}"
        )
    device = torch.device(device)

    streams = sorted({c.stream for c in chains})
    sidx = torch.tensor([streams.index(c.stream) for c in chains], device=device)
    blocks = _input_blocks(streams, steps, dk, dv, seed, block)
    # Group chains by (rule, sign) so step_coefficients is called once per group per block.
    groups: dict[tuple[str, bool], list[int]] = {}
    for i, c in enumerate(chains):
        groups.setdefault((c.rule, c.negative_eigenvalues), []).append(i)
    groups_t = {g: torch.tensor(ix, device=device) for g, ix in groups.items()}

    # Record on a grid of ~`records` steps, always including the first and the last.
    rec = torch.unique(torch.linspace(1, steps, min(records, steps)).round().long())
    rec_set = set(rec.tolist())
    R = len(rec)

    states = {}
    for p in precs:
        s0 = torch.zeros(n, dk, dv, dtype=torch.float64) if initial_state is None else initial_state
        states[p.name] = s0.to(device=device, dtype=p.state_dtype).to(p.compute_dtype)
    norms = {p.name: torch.empty(R, n, dtype=torch.float64, device=device) for p in precs}
    errs = {p.name: torch.empty(R, n, dtype=torch.float64, device=device) for p in precs}
    first_bad = {p.name: torch.full((n,), -1, dtype=torch.long, device=device) for p in precs}
    mu_max = {p.name: torch.zeros(n, dtype=torch.float64, device=device) for p in precs}
    n_gt1 = {p.name: torch.zeros(n, dtype=torch.float64, device=device) for p in precs}

    r = 0
    bar = tqdm(total=steps, disable=not progress, unit="step", desc="growth", smoothing=0.1)
    for t0 in range(0, steps, block):
        k64, v64, b64 = (x.to(device)[:, sidx] for x in next(blocks))  # [tb, N, d]
        tb = k64.shape[0]
        if zero_values:
            v64 = torch.zeros_like(v64)
        inputs = {}
        for p in precs:
            k = k64.to(p.input_dtype)
            beta = b64.to(p.input_dtype)
            lam = (k * k).sum(-1)  # in the input dtype, as a kernel computing ||k||^2 would
            a = torch.empty(tb, n, dtype=p.input_dtype, device=device)
            b = torch.empty_like(a)
            for (rule, neg), ix in groups_t.items():
                ga, gb = step_coefficients(
                    rule, beta[:, ix], lam[:, ix], negative_eigenvalues=neg, eps=eps
                )
                a[:, ix], b[:, ix] = ga.to(a.dtype), gb.to(b.dtype)
            # Effective eigenvalue of the transition actually applied (rounded a, rounded k).
            mu = 1 - a.double() * (k.double() ** 2).sum(-1)
            mu_max[p.name] = torch.maximum(mu_max[p.name], mu.abs().amax(0))
            # 1e-12: float64 round-off of an exact reflection (mu = -1) is not "above 1".
            n_gt1[p.name] += (mu.abs() > 1 + 1e-12).double().sum(0)
            cd = p.compute_dtype
            inputs[p.name] = (k.to(cd), v64.to(p.input_dtype).to(cd), a.to(cd), b.to(cd))

        for i in range(tb):
            t = t0 + i + 1
            for p in precs:
                k, v, a, b = (x[i] for x in inputs[p.name])
                S = states[p.name]
                pred = torch.bmm(k.unsqueeze(1), S).squeeze(1)  # S^T k: [N, dv]
                upd = b.unsqueeze(1) * v - a.unsqueeze(1) * pred
                S = torch.baddbmm(S, k.unsqueeze(2), upd.unsqueeze(1))  # S + k upd^T
                if p.state_dtype != p.compute_dtype:
                    S = S.to(p.state_dtype).to(p.compute_dtype)  # a low-precision state store
                states[p.name] = S
                bad = ~torch.isfinite(S.abs().amax((1, 2)))  # amax propagates nan and inf
                fb = first_bad[p.name]
                first_bad[p.name] = torch.where(bad & (fb < 0), t, fb)
            if t in rec_set:
                ref_s = states["fp64"]
                ref_n = _fro(ref_s)
                for p in precs:
                    s64 = states[p.name].double()
                    norms[p.name][r] = _fro(s64)
                    errs[p.name][r] = _fro(s64 - ref_s) / ref_n.clamp_min(1e-300)
                r += 1
        bar.update(tb)
    bar.close()

    def cpu(d):
        return {k: v.cpu() for k, v in d.items()}

    return GrowthResult(
        chains=chains,
        precisions=precs,
        steps=rec,
        norms=cpu(norms),
        rel_err=cpu(errs),
        first_nonfinite=cpu(first_bad),
        mu_max=cpu(mu_max),
        frac_mu_gt1={k: v.cpu() / steps for k, v in n_gt1.items()},
        final_states={p.name: states[p.name].to(p.state_dtype).cpu() for p in precs},
        config={"steps": steps, "dk": dk, "dv": dv, "eps": eps, "seed": seed},
    )


def _fro(s: torch.Tensor) -> torch.Tensor:
    """Frobenius norm per chain [N, dk, dv] -> [N], scaled by the max entry so that a state
    with finite entries never reports an overflowed (inf) norm."""
    m = s.abs().amax((1, 2)).clamp_min(1e-300)
    return m * torch.linalg.vector_norm(s / m[:, None, None], dim=(1, 2))


def make_chains(
    rules: Sequence[str],
    keys: Sequence[str],
    betas: Sequence[str],
    seeds: int,
    negative_eigenvalues: Sequence[bool] = (False, True),
) -> list[Chain]:
    """The full factorial of chains."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    check_regimes(keys, betas)
    return [
        Chain(rule, neg, kr, br, s)
        for rule in rules
        for neg in negative_eigenvalues
        for kr in keys
        for br in betas
        for s in range(seeds)
    ]


def summarize(res: GrowthResult) -> list[dict]:
    """One row per (rule, sign, keys, betas, precision), aggregated over seeds:
    worst final norm, earliest blow-up, median final error, worst |mu|."""
    rows = []
    cells: dict[tuple, list[int]] = {}
    for i, c in enumerate(res.chains):
        cells.setdefault((c.rule, c.negative_eigenvalues, c.keys, c.betas), []).append(i)
    for (rule, neg, keys, betas), ix in cells.items():
        ixt = torch.tensor(ix)
        for p in res.precisions:
            fin = res.norms[p.name][-1, ixt]
            fb = res.first_nonfinite[p.name][ixt]
            blown = fb[fb >= 0]
            err = res.rel_err[p.name][-1, ixt]
            rows.append(
                {
                    "rule": rule,
                    "negative_eigenvalues": neg,
                    "keys": keys,
                    "betas": betas,
                    "precision": p.name,
                    "seeds": len(ix),
                    "blown_up": int(len(blown)),
                    "first_nonfinite": int(blown.min()) if len(blown) else None,
                    "final_norm_max": float(fin.max()) if len(blown) == 0 else math.inf,
                    "peak_norm_max": float(res.norms[p.name][:, ixt].nan_to_num(math.inf).max()),
                    "final_rel_err_median": float(err.median()) if len(blown) == 0 else math.nan,
                    "mu_abs_max": float(res.mu_max[p.name][ixt].max()),
                    "frac_mu_gt1": float(res.frac_mu_gt1[p.name][ixt].mean()),
                }
            )
    return rows


def plot_growth(
    res: GrowthResult,
    path: str,
    *,
    select: dict | None = None,
    title: str = "",
    by: str = "rule",
) -> None:
    """||S_t|| (log) against t (linear), one panel per precision, one line per selected chain
    (colour by rule label; seeds share a colour). A cross marks the step a chain blew up.

    select: keep chains whose attributes equal these values (e.g. {"keys": "gaussian"});
    a value may be a tuple of allowed values.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullLocator

    select = select or {}

    def keep(c: Chain) -> bool:
        for k, want in select.items():
            got = getattr(c, k)
            if isinstance(want, tuple | list | set) and got not in want:
                return False
            if not isinstance(want, tuple | list | set) and got != want:
                return False
        return True

    idx = [i for i, c in enumerate(res.chains) if keep(c)]
    if not idx:
        raise ValueError(f"no chain matches {select}")
    labels = sorted({_group_label(res.chains[i], by) for i in idx})
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    color = {lab: cmap(j % cmap.N) for j, lab in enumerate(labels)}
    precs = res.precisions
    ncols = min(3, len(precs))
    nrows = math.ceil(len(precs) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), sharey=True, squeeze=False
    )
    # y range: the finite data, up to the cross marks at 1e39 when something blew up.
    sel = torch.stack([res.norms[p.name][:, idx] for p in precs])
    fin = sel[torch.isfinite(sel) & (sel > 0)]
    blown = any(bool((res.first_nonfinite[p.name][idx] >= 0).any()) for p in precs)
    lo = float(fin.min()) / 3 if len(fin) else 1e-2
    hi = 1e40 if blown else (float(fin.max()) * 3 if len(fin) else 1.0)
    hi = min(hi, 1e40)
    t = res.steps.numpy()
    for ax, p in zip(axes.flat, precs):
        seen = set()
        for i in idx:
            c = res.chains[i]
            lab = _group_label(c, by)
            y = res.norms[p.name][:, i].clone()
            y[~torch.isfinite(y)] = math.nan
            y = y.clamp(max=1e39)  # beyond the axis (float64 reference runs reach 1e300)
            ax.plot(
                t,
                y.numpy(),
                color=color[lab],
                lw=1.0,
                alpha=0.8,
                label=None if lab in seen else lab,
            )
            seen.add(lab)
            fb = int(res.first_nonfinite[p.name][i])
            if fb >= 0:
                ax.plot([fb], [1e39], "x", color=color[lab], ms=7, mew=2)
        # Linear t: exponential growth is a straight line on these axes, sqrt(t) bends over.
        ax.set_yscale("log")
        # Few y ticks: the range can span 70 decades and per-decade minor ticks are slow to lay out.
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=8))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_ylim(lo, hi)
        ax.set_xlim(0, float(t[-1]))
        ax.set_title(f"precision {p.name}", fontsize=10)
        ax.set_xlabel("t (tokens)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(precs) :]:
        ax.set_visible(False)
    for r in range(nrows):
        axes[r, 0].set_ylabel("||S_t||_F   (x: non-finite)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    ncol = min(len(labels), 6)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    rows_of_legend = math.ceil(len(labels) / ncol)
    fig.tight_layout(rect=(0, 0.035 * rows_of_legend / nrows + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _group_label(c: Chain, by: str) -> str:
    if by == "rule":
        return c.label
    if by == "rule+betas":
        return f"{c.label} beta={c.betas}"
    if by == "rule+keys":
        return f"{c.label} keys={c.keys}"
    if by == "rule+keys+betas":
        return f"{c.label} keys={c.keys} beta={c.betas}"
    if by == "keys+betas":
        return f"keys={c.keys} beta={c.betas}"
    raise ValueError(
        f"by={by!r}: expected rule, rule+betas, rule+keys, rule+keys+betas or keys+betas"
    )
