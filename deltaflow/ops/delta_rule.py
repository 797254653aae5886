"""The one public op, :func:`delta_rule`: checks, rule coefficients, varlen packing, dispatch."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from deltaflow.ops.checks import check_inputs, compute_dtype
from deltaflow.ops.chunk import (
    CPU_CHUNK_SIZE,  # noqa: F401 (looked up here by callers)
    TRITON_CHUNK_SIZE,
    chunk_delta_rule,
    default_chunk_size,
)
from deltaflow.ops.naive import recurrent_delta_rule
from deltaflow.rules import CoefficientFn, StepRule, get_rule, step_inputs


def _triton_backend():
    """The Triton backend, or None where it cannot run (no Triton, or no GPU and no interpreter)."""
    try:
        from deltaflow.ops import triton_backend
    except ImportError:
        return None
    return triton_backend if triton_backend.available() else None


def resolve_backend(backend: str, q: Tensor, rule: StepRule, chunk_size: int | None = None) -> str:
    """'auto' picks the fastest correct backend for the device: Triton on CUDA for rules with a
    Triton form (``kernel_id``), unless ``chunk_size`` asks for a chunk length its kernels do
    not have. Rules without one (user rules) run on the torch backend."""
    if backend != "auto":
        return backend
    triton_chunk = chunk_size is None or chunk_size == TRITON_CHUNK_SIZE
    if q.is_cuda and rule.has_triton and triton_chunk and _triton_backend() is not None:
        return "triton"
    return "torch"


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None = None,
    *,
    rule: str | StepRule | CoefficientFn = "delta",
    log_decay: Tensor | None = None,
    negative_eigenvalues: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Delta-rule linear attention with a pluggable step rule (docs/design.md §1–§3).

    ``S_t = α_t (I − a_t k_t k_tᵀ) S_{t−1} + b_t k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``, where
    ``(a_t, b_t)`` come from ``rule`` applied to ``beta_t`` and ``λ_t = ‖k_t‖²`` (k is used as
    given, never normalized) and ``α_t = exp(log_decay_t)``.

    Args:
        q, k: ``[B, T, H, Dk]``. v: ``[B, T, H, Dv]``. beta: ``[B, T, H]``, ``>= 0``; may be None
            for the rules that read no β (``StepRule.needs_beta`` False: linear, kaczmarz).
        rule: a name from :data:`deltaflow.rules.RULES`, a :class:`StepRule`, or a function
            ``(beta, lam, eps) -> (a, b)``.
        log_decay: ``[B, T, H]``, ``<= 0``; None means no decay.
        negative_eigenvalues: double ``a`` and ``b`` (eigenvalue μ along k → 2μ − 1).
        eps: regularizer of the Kaczmarz rules, ``1/(λ + eps)``.
        scale: output scale, default ``Dk ** -0.5``.
        initial_state: ``[B, H, Dk, Dv]`` (``[N, H, Dk, Dv]`` with ``cu_seqlens``).
        output_final_state: also return the final state (float32, float64 for float64 inputs).
        cu_seqlens: int ``[N + 1]`` offsets of ``N`` sequences packed along T; requires B == 1.
        chunk_size: tokens per chunk (positive power of two); it changes speed, not the result.
            One larger than the sequence is capped at it (rounded up to a power of two).
            None lets the backend choose: the torch backend takes 32 on CPU (fastest there,
            benchmarks/NOTES.md) and 64 elsewhere; the Triton kernels compute in chunks of 64
            only, so backend='triton' refuses any other value and 'auto' then picks 'torch'.
        backend: 'auto' | 'reference' | 'torch' | 'triton'.
        check_values: check on the host that beta >= 0, log_decay <= 0 (both finite) and the
            cu_seqlens offsets (one GPU sync per checked tensor). Callers whose inputs satisfy
            them by construction (the layers: sigmoid/softplus gates) pass False; shape checks
            always run.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, Dv]`` in v's dtype; ``final_state`` is None
        unless ``output_final_state``.
    """
    step_rule = get_rule(rule)
    check_inputs(
        q,
        k,
        v,
        beta=beta,
        rule=step_rule,
        log_decay=log_decay,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        backend=backend,
        eps=eps,
        check_values=check_values,
    )
    if negative_eigenvalues and step_rule.negative_mu:
        warnings.warn(
            f"rule={step_rule.name!r} with negative_eigenvalues=True maps mu below -1 and is "
            f"unstable for large beta*||k||^2; {step_rule.name} already reaches negative mu by "
            "itself (see results/stability)",
            stacklevel=2,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    backend = resolve_backend(backend, q, step_rule, chunk_size)
    dtype = compute_dtype(q, k, v, beta, initial_state)
    if backend == "triton" and not step_rule.has_triton:
        raise ValueError(
            f"backend='triton' runs the rules of the Triton rule table only; rule "
            f"{step_rule.name!r} has no kernel_id: use backend='torch' (or 'auto')"
        )
    if q.shape[1] == 0:  # before any backend: no kernel or chunk loop ever sees T = 0
        return _empty(q, v, initial_state, cu_seqlens, output_final_state, dtype)

    if backend == "triton":
        triton_backend = _triton_backend()
        if triton_backend is None:
            raise RuntimeError(
                "backend='triton' needs Triton and a CUDA device "
                "(or TRITON_INTERPRET=1 for the CPU interpreter)"
            )
        o, state = triton_backend.delta_rule(
            q,
            k,
            v,
            beta,
            rule=step_rule,
            log_decay=log_decay,
            negative_eigenvalues=negative_eigenvalues,
            eps=eps,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
        )
        return o, state
    options = dict(
        beta=beta,
        rule=step_rule,
        log_decay=log_decay,
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        dtype=dtype,
    )
    # The torch backends compute in `dtype` (docs/design.md §1: fp32, fp64 for fp64 inputs)
    # under an autocast too, which would otherwise run their matmuls in bf16 or fp16 (and the
    # chunked backward, which runs outside it, then met bf16 intermediates with fp32 gradients).
    with torch.autocast(q.device.type, enabled=False):
        if backend == "reference":
            o, state = _reference(q, k, v, **options)
        else:
            if chunk_size is None:
                chunk_size = default_chunk_size(q.device)
            # A chunk past the sequence is only padding (chunk_size=65536 at T=10 asked for
            # 16 GB of it): the smallest power of two that holds all T tokens gives the same
            # result.
            chunk_size = min(chunk_size, 1 << max(0, q.shape[1] - 1).bit_length())
            o, state = _torch_chunked(
                q, k, v, chunk_size=chunk_size, final_state=output_final_state, **options
            )
    return o.to(v.dtype), (state if output_final_state else None)


def _empty(
    q: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    output_final_state: bool,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """T = 0: no token changes the state. ``o`` is ``[B, 0, H, Dv]``; the final state is the
    initial state (a copy, in the state dtype, still differentiable) or zeros."""
    o = v.clone()  # v is [B, 0, H, Dv]: the empty output, with v's dtype, device and graph
    if not output_final_state:
        return o, None
    if initial_state is not None:
        return o, initial_state.to(dtype).clone()
    B, _, H, Dk = q.shape
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    return o, q.new_zeros(n_states, H, Dk, v.shape[-1], dtype=dtype)


def _reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    rule: StepRule,
    log_decay: Tensor | None,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    def run(sl: slice, s0: Tensor | None) -> tuple[Tensor, Tensor]:
        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[:, sl]

        return recurrent_delta_rule(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            pick(beta),
            rule,
            pick(log_decay),
            negative_eigenvalues,
            eps,
            scale,
            s0,
            dtype,
        )

    if cu_seqlens is None:
        return run(slice(None), initial_state)
    offsets = cu_seqlens.tolist()
    outputs, states = [], []
    for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
        o_i, s_i = run(
            slice(start, end), None if initial_state is None else initial_state[i : i + 1]
        )
        outputs.append(o_i)
        states.append(s_i)
    return torch.cat(outputs, dim=1), torch.cat(states, dim=0)


def _torch_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    rule: StepRule,
    log_decay: Tensor | None,
    negative_eigenvalues: bool,
    eps: float,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_size: int,
    dtype: torch.dtype,
    final_state: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``final_state`` False: the final state may be None (the caller discards it)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    lam = (k * k).sum(-1)  # λ = ‖k‖²
    a, b, g = step_inputs(  # g: the recurrence's log α (a rule may transform the layer's)
        rule,
        None if beta is None else beta.to(dtype),
        lam,
        None if log_decay is None else log_decay.to(dtype),
        negative_eigenvalues=negative_eigenvalues,
        eps=eps,
    )
    s0 = None if initial_state is None else initial_state.to(dtype)
    if cu_seqlens is None:
        return chunk_delta_rule(
            q, k, v, a=a, b=b, log_decay=g, scale=scale, initial_state=s0, chunk_size=chunk_size
        )

    if s0 is None and not final_state and _in_place(PACK_IN_PLACE):
        return _documents_in_place(q, k, v, a, b, g, scale, cu_seqlens, chunk_size), None

    # Varlen: pack the N sequences into a zero-padded [N, T_max] batch. Padding is appended at
    # each sequence's end as identity steps (k = v = 0, a = b = 0, log α = 0), so the final
    # state is the state at the sequence's true end and empty sequences return s0 unchanged.
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    n_seq = lengths.numel()
    t_max = max(int(lengths.max()), 1)
    pos = torch.arange(t_max, device=q.device)
    valid = pos[None, :] < lengths[:, None].to(q.device)  # [N, T_max]
    index = (cu_seqlens[:-1, None].to(q.device) + pos[None, :]).clamp(max=max(q.shape[1] - 1, 0))

    def pack(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        if x.shape[1] == 0:
            return x.new_zeros(n_seq, t_max, *x.shape[2:])
        mask = valid.reshape(n_seq, t_max, *([1] * (x.dim() - 2)))
        return torch.where(mask, x[0][index], torch.zeros((), dtype=x.dtype, device=x.device))

    o, state = chunk_delta_rule(
        pack(q),
        pack(k),
        pack(v),
        a=pack(a),
        b=pack(b),
        log_decay=pack(g),
        scale=scale,
        initial_state=s0,
        chunk_size=chunk_size,
    )
    return o[valid].unsqueeze(0), state


# How the torch backend runs packed documents (cu_seqlens) without initial or final states (a
# model's training forward): None = in place under torch.compile, as a zero-padded
# [N, T_max] batch in eager mode; True / False: always / never in place (tests).
#
# Why two forms: the padded batch has sizes that depend on the offsets' VALUES (T_max =
# max length, then the chunk loop's length, o[valid]'s length), which dynamo cannot trace
# (GuardOnDataDependentSymNode at the first compiled step, so the trainer fell back to eager
# for every packed run of the torch backend). In place, the row keeps its T tokens and
# their ceil(T / C) chunks, and document starts become masks on the decay factors
# (chunk.document_masks, exact: a start is α = 0): only cu_seqlens's length is a size, one
# dynamic recompile covers every document count. Eager keeps the padded batch: its state
# loop runs T_max / C steps over N rows instead of T / C steps over one (the CPU is faster
# batched), and every eager result stays as it was. The Triton backend (CUDA) has its own
# varlen kernels behind custom ops and never comes here.
PACK_IN_PLACE: bool | None = None


def _in_place(switch: bool | None) -> bool:
    return torch.compiler.is_compiling() if switch is None else switch


def _documents_in_place(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor | None,
    scale: float,
    cu_seqlens: Tensor,
    chunk_size: int,
) -> Tensor:
    """``o`` of the documents packed in ``[1, T]`` at ``cu_seqlens``, each from a zero state,
    as one row whose recurrence restarts at every document's first token (PACK_IN_PLACE)."""
    T = q.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], torch.arange(T, device=q.device), right=True)
    o, _ = chunk_delta_rule(
        q,
        k,
        v,
        a=a,
        b=b,
        log_decay=g,
        scale=scale,
        initial_state=None,
        chunk_size=chunk_size,
        documents=(doc, cu[doc]),
    )
    return o
