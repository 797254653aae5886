"""Segment decomposition: one sequence split into segments that are computed independently.

The recurrence (docs/design.md §1) is linear in the state, so a segment's effect on the state that
enters it is affine. For a segment of tokens ``t = 1..L`` and an incoming state ``S_in``::

    S_end = P · S_in + S_loc          P = Π_t α_t (I − a_t k_t k_tᵀ)   (Dk × Dk, ordered)
    o_t   = o_t^loc + scale · (P_{≤t} S_in)ᵀ q_t

where ``S_loc`` and ``o^loc`` are what the segment computes from a zero incoming state and
``P_{≤t}`` is the product up to token ``t``. So every segment can run at the same time, each
from a zero state; then a short sequential pass over the segments (``chain``) gives each one
its true incoming state, and each corrects its outputs by ``q̃_t · S_in`` with
``q̃_t = scale · P_{≤t}ᵀ q_t``. One algorithm, two scales: across GPUs (context parallelism,
``deltaflow.parallel.context``) and across segments of one GPU (:func:`segmented_delta_rule`).

**How P and q̃ are computed.** The recurrence moves every column of the state independently
with its own column of ``v``; the rule's coefficients ``(a_t, b_t)`` depend on ``β`` and ``‖k‖``
only. So running the op itself with ``Dk`` extra value columns, all zero, whose initial state is
the identity, carries ``P_{≤t}`` alongside the local state::

    initial state [I | 0],  values [0 | v]   →   state [P_{≤t} | S_t^loc],  output [q̃_t | o_t^loc]

One call of :func:`deltaflow.delta_rule` (any backend, any rule, decay, negative eigenvalues)
gives everything, exactly, and its backward gives every gradient. Only segments that receive an
incoming state pay for the extra columns.

**Documents** (``cu_seqlens``). A segment may hold the end of a document that started earlier
(it "continues in"), whole documents, and the start of one that goes on after it ("continues
out"). Only the first document receives the incoming state (only its tokens get the correction),
and only the last one's state leaves the segment: ``P`` is the first document's product if that
document spans the whole segment, and zero as soon as a document starts inside it (that
document begins from its own initial state, so the outgoing state no longer depends on the
incoming one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deltaflow.compat import cast_output
from deltaflow.ops.checks import compute_dtype
from deltaflow.ops.delta_rule import delta_rule


# ---------------------------------------------------------------------------- the plan (host)
@dataclass(frozen=True)
class SegmentPlan:
    """Where segment ``[lo, hi)`` of a packed sequence lies among the documents.

    ``docs`` are the global indices of the non-empty documents with tokens in the segment, in
    order; ``cu`` their local offsets (``[len(docs) + 1]``, from 0 to ``hi − lo``).
    ``continues_in``: the first document started before ``lo`` (at ``first_start``).
    ``continues_out``: the last one goes on after ``hi``. ``empty_docs``: documents without
    tokens; segment 0 reports their final state (their initial state), so that exactly one
    segment owns every document's final state.
    For unpacked rows (no ``cu_seqlens``) every row is one document crossing every boundary:
    ``docs`` is empty and ``rows`` is True.
    """

    lo: int
    hi: int
    continues_in: bool
    continues_out: bool
    docs: tuple[int, ...] = ()
    cu: tuple[int, ...] = ()
    empty_docs: tuple[int, ...] = ()
    rows: bool = False
    first_start: int = 0

    @property
    def length(self) -> int:
        return self.hi - self.lo


def plan_segment(lo: int, hi: int, total: int, cu_seqlens: list[int] | None = None) -> SegmentPlan:
    """The :class:`SegmentPlan` of tokens ``[lo, hi)`` of a sequence of ``total`` tokens.

    ``cu_seqlens``: the offsets of the packed documents (host ints, ``[N + 1]``, 0 to
    ``total``), or None for unpacked rows.
    """
    if not 0 <= lo < hi <= total:
        raise ValueError(f"segment [{lo}, {hi}) must be non-empty and inside [0, {total})")
    if cu_seqlens is None:
        return SegmentPlan(lo, hi, continues_in=lo > 0, continues_out=hi < total, rows=True)
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {cu_seqlens}")
    docs, cu = [], [0]
    for g, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        if start < end and start < hi and end > lo:  # non-empty and overlapping the segment
            docs.append(g)
            cu.append(min(end, hi) - lo)
    first_start, last_end = cu_seqlens[docs[0]], cu_seqlens[docs[-1] + 1]
    empty = []
    if lo == 0:  # segment 0 owns the documents without tokens
        empty = [g for g, (s, e) in enumerate(zip(cu_seqlens, cu_seqlens[1:])) if s == e]
    return SegmentPlan(
        lo,
        hi,
        continues_in=first_start < lo,
        continues_out=last_end > hi,
        docs=tuple(docs),
        cu=tuple(cu),
        empty_docs=tuple(empty),
        first_start=first_start,
    )


def split_bounds(total: int, n_segments: int) -> list[int]:
    """``n_segments + 1`` offsets splitting ``total`` tokens into near-equal segments."""
    if not 1 <= n_segments <= total:
        raise ValueError(f"cannot split {total} tokens into {n_segments} non-empty segments")
    return [total * i // n_segments for i in range(n_segments + 1)]


# ---------------------------------------------------------------------------- one segment
@dataclass
class SegmentSummary:
    """What a segment computes from a zero incoming state (state tensors in float32/64).

    ``o``: ``[B, L, H, Dv]`` outputs for a zero incoming state.
    ``q_in``: ``[n, L0, H, Dk]``: ``scale · P_{≤t}ᵀ q_t`` for the first ``L0`` tokens (those of
    the document that continues in), or None when nothing continues in.
    ``head``: ``[n, H, Dk, Dk + Dv]``: ``[P | S_loc]`` of that document where it ends in (or
    leaves) the segment; None when nothing continues in.
    ``out``: ``[n, H, Dk, Dk + Dv]``: ``[P | S]`` handed to the next segment (zeros when the
    next segment starts a new document).
    ``head_final_docs``: documents whose final state is ``head`` applied to the incoming state.
    ``finals`` / ``final_docs``: final states of the other documents that end here.
    ``n`` is ``B`` for unpacked rows, 1 for packed documents.
    """

    o: Tensor
    q_in: Tensor | None
    head: Tensor | None
    out: Tensor
    head_final_docs: list[int]
    finals: Tensor | None
    final_docs: list[int]


def _with_transition_columns(v: Tensor, Dk: int) -> Tensor:
    """``[0 | v]``: Dk zero value columns in front of v (they carry ``P`` through the op)."""
    return torch.cat([v.new_zeros(*v.shape[:-1], Dk), v], dim=-1)


def _identity_state(n: int, H: int, Dk: int, Dv: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """``[I | 0]``: ``[n, H, Dk, Dk + Dv]``."""
    state = torch.zeros(n, H, Dk, Dk + Dv, dtype=dtype, device=like.device)
    state[..., :Dk].diagonal(dim1=-2, dim2=-1).fill_(1.0)
    return state


def summarize_segment(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    plan: SegmentPlan,
    *,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    **op_kwargs,
) -> SegmentSummary:
    """Run the op on one segment (``q, k, v, beta, log_decay`` hold its tokens only) from a
    zero incoming state, with the transition columns where a document continues in.

    ``initial_state``: the GLOBAL initial states (``[B, ...]`` for rows, ``[N, ...]`` per
    document); a segment applies those of the documents that start in it. ``op_kwargs`` go to
    :func:`deltaflow.delta_rule` (rule, negative_eigenvalues, eps, scale, chunk_size, backend).
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    if L != plan.length:
        raise ValueError(f"the segment holds {L} tokens but its plan says {plan.length}")
    # the op's state dtype (float64 if any input is): every segment's transition must agree
    state_dtype = compute_dtype(q, k, v, beta, initial_state)

    def op(sl: slice, v_: Tensor, s0: Tensor | None, cu: list[int] | None):
        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[:, sl]

        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device=q.device)
        return delta_rule(
            q[:, sl],
            k[:, sl],
            v_[:, sl],
            pick(beta),
            log_decay=pick(log_decay),
            initial_state=s0,
            output_final_state=True,
            cu_seqlens=cu_t,
            **op_kwargs,
        )

    def zeros_out(n: int) -> Tensor:
        return q.new_zeros(n, H, Dk, Dk + Dv, dtype=state_dtype)

    def as_out(S: Tensor) -> Tensor:  # [0 | S]: a state that does not depend on the incoming one
        return torch.cat([S.new_zeros(*S.shape[:-1], Dk), S], dim=-1)

    everything = slice(None)
    if plan.rows:
        if not plan.continues_in:
            o, S = op(everything, v, initial_state, None)
            out = as_out(S) if plan.continues_out else zeros_out(B)
            ends = [] if plan.continues_out or not output_final_state else list(range(B))
            return SegmentSummary(o, None, None, out, [], S if ends else None, ends)
        v_aug = _with_transition_columns(v, Dk)
        o_aug, head = op(everything, v_aug, _identity_state(B, H, Dk, Dv, q, state_dtype), None)
        out = head if plan.continues_out else zeros_out(B)
        ends = [] if plan.continues_out or not output_final_state else list(range(B))
        q_in, o = o_aug.split([Dk, Dv], dim=-1)  # one split: its backward is one cat
        return SegmentSummary(o, q_in, head, out, ends, None, [])

    # Packed documents: B == 1; document j of the segment is global document plan.docs[j].
    docs, cu = list(plan.docs), list(plan.cu)

    def own_initial(ds: list[int]) -> Tensor | None:
        return None if initial_state is None else initial_state[ds]

    o_parts: list[Tensor] = []
    finals: list[Tensor] = []
    final_docs: list[int] = []
    if plan.continues_in:  # the first document: transition columns, its tokens only
        head_len = cu[1]
        v_aug = _with_transition_columns(v[:, :head_len], Dk)
        o_aug, head = op(
            slice(0, head_len), v_aug, _identity_state(1, H, Dk, Dv, q, state_dtype), None
        )
        q_in, o_head = o_aug.split([Dk, Dv], dim=-1)
        o_parts.append(o_head)
        head_final_docs = [docs[0]] if (len(docs) > 1 or not plan.continues_out) else []
        rest_docs, rest_cu, rest_from = docs[1:], [c - head_len for c in cu[1:]], head_len
    else:
        q_in = head = None
        head_final_docs = []
        rest_docs, rest_cu, rest_from = docs, cu, 0
    if rest_docs:
        o_rest, S_rest = op(slice(rest_from, L), v, own_initial(rest_docs), rest_cu)
        o_parts.append(o_rest)
        ending = len(rest_docs) - (1 if plan.continues_out else 0)
        finals.append(S_rest[:ending])
        final_docs += rest_docs[:ending]
        out = as_out(S_rest[-1:]) if plan.continues_out else zeros_out(1)
    else:  # the continuing document fills the segment
        out = head if plan.continues_out else zeros_out(1)
    o = o_parts[0] if len(o_parts) == 1 else torch.cat(o_parts, dim=1)
    if not output_final_state:
        return SegmentSummary(o, q_in, head, out, [], None, [])
    if plan.empty_docs:  # documents without tokens keep their state
        empty = list(plan.empty_docs)
        if initial_state is None:
            finals.append(q.new_zeros(len(empty), H, Dk, Dv, dtype=state_dtype))
        else:
            finals.append(initial_state[empty].to(state_dtype))
        final_docs += empty
    stacked = torch.cat(finals) if finals else None
    return SegmentSummary(o, q_in, head, out, head_final_docs, stacked, final_docs)


# ---------------------------------------------------------------------------- across segments
def chain(transitions: Tensor) -> Tensor:
    """States entering each segment, from the segments' ``[P | S]`` (``[R, n, H, Dk, Dk+Dv]``).

    ``X_0 = 0``, ``X_{r+1} = P_r X_r + S_r``, in the transitions' dtype (float32 or float64).
    Returns ``[R + 1, n, H, Dk, Dv]``: ``X_r`` enters segment ``r``; ``X_R`` leaves the last.
    """
    Dk = transitions.shape[-2]
    P, S = transitions[..., :Dk], transitions[..., Dk:]
    X = S.new_zeros(S.shape[1:])
    states = [X]
    for r in range(transitions.shape[0]):
        X = P[r] @ X + S[r]
        states.append(X)
    return torch.stack(states)


def chain_backward(transitions: Tensor, states: Tensor, grad_states: Tensor) -> Tensor:
    """Gradient of :func:`chain` w.r.t. ``transitions`` (zero incoming state), given the
    gradient of every state it returned (``[R + 1, ...]``; the entry for ``X_0`` is unused).

    Reverse pass: ``G_R = dX_R``, ``dP_r = G_{r+1} X_rᵀ``, ``dS_r = G_{r+1}``,
    ``G_r = dX_r + P_rᵀ G_{r+1}``.
    """
    Dk = transitions.shape[-2]
    P = transitions[..., :Dk]
    R = transitions.shape[0]
    grad = torch.zeros_like(transitions)
    G = grad_states[R]
    for r in reversed(range(R)):
        grad[r, ..., :Dk] = G @ states[r].mT
        grad[r, ..., Dk:] = G
        G = grad_states[r] + P[r].mT @ G
    return grad


def apply_incoming(summary: SegmentSummary, incoming: Tensor) -> tuple[Tensor, Tensor | None]:
    """The segment's true outputs and the final states it owns, given its incoming state
    ``[n, H, Dk, Dv]`` (differentiable torch ops).

    Returns ``o`` and the owned final states in the order ``head_final_docs + final_docs``
    (None when it owns none).
    """
    o = summary.o
    finals = []
    if summary.q_in is not None:
        L0 = summary.q_in.shape[1]
        fix = torch.einsum("nthk,nhkv->nthv", summary.q_in.to(incoming.dtype), incoming)
        # returned by _SegmentExchange's forward: no no-op cast there (deltaflow/compat.py)
        head_o = cast_output(o[:, :L0].to(incoming.dtype) + fix, o.dtype)
        o = head_o if L0 == o.shape[1] else torch.cat([head_o, o[:, L0:]], dim=1)
        if summary.head_final_docs:
            Dk = incoming.shape[-2]
            finals.append(summary.head[..., :Dk] @ incoming + summary.head[..., Dk:])
    if summary.finals is not None:
        finals.append(summary.finals)
    return o, (torch.cat(finals) if finals else None)


def apply_incoming_backward(
    q_in: Tensor | None,
    head: Tensor | None,
    incoming: Tensor,
    grad_o: Tensor,
    grad_head_finals: Tensor | None,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """Hand-written backward of the correction in :func:`apply_incoming` (the head tokens'
    outputs and the head documents' final states): the gradients of ``q_in``, ``head`` and the
    incoming state. The gradients of ``o`` and of the other final states pass through as they
    are."""
    grad_in = torch.zeros_like(incoming)
    if q_in is None:
        return None, None, grad_in
    L0 = q_in.shape[1]
    g = grad_o[:, :L0].to(incoming.dtype)
    grad_q_in = torch.einsum("nthv,nhkv->nthk", g, incoming).to(q_in.dtype)
    grad_in += torch.einsum("nthk,nthv->nhkv", q_in.to(incoming.dtype), g)
    grad_head = None
    if grad_head_finals is not None:
        Dk = incoming.shape[-2]
        grad_head = torch.cat([grad_head_finals @ incoming.mT, grad_head_finals], dim=-1)
        grad_in += head[..., :Dk].mT @ grad_head_finals
    return grad_q_in, grad_head, grad_in


# ---------------------------------------------------------------------------- in one process
def segmented_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None = None,
    *,
    bounds: list[int],
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    **op_kwargs,
) -> tuple[Tensor, Tensor | None]:
    """:func:`deltaflow.delta_rule` computed as independent segments ``bounds`` (offsets along
    T, from 0 to T), chained, and corrected: the same function as the op, to rounding.

    This is the in-device form of the context-parallel algorithm (each segment could run on its
    own stream or GPU); autograd differentiates through it. Same arguments as the op.
    """
    T = q.shape[1]
    if list(bounds) != sorted(set(bounds)) or bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"bounds must increase strictly from 0 to T={T}, got {list(bounds)}")
    cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    state_dtype = compute_dtype(q, k, v, beta, initial_state)
    plans = [plan_segment(lo, hi, T, cu) for lo, hi in zip(bounds, bounds[1:])]
    summaries = []
    for plan in plans:
        sl = slice(plan.lo, plan.hi)
        summaries.append(
            summarize_segment(
                q[:, sl],
                k[:, sl],
                v[:, sl],
                None if beta is None else beta[:, sl],
                plan,
                log_decay=None if log_decay is None else log_decay[:, sl],
                initial_state=initial_state,
                output_final_state=output_final_state,
                **op_kwargs,
            )
        )
    outputs, finals, owners = [], [], []
    with torch.autocast(q.device.type, enabled=False):  # the chain stays in fp32 / fp64
        incoming = chain(torch.stack([s.out.to(state_dtype) for s in summaries]))
        for r, s in enumerate(summaries):
            o, owned = apply_incoming(s, incoming[r])
            outputs.append(o)
            if owned is not None:
                finals.append(owned)
                owners += s.head_final_docs + s.final_docs
    o = torch.cat(outputs, dim=1)
    if not output_final_state:
        return o, None
    stacked = torch.cat(finals)
    order = torch.as_tensor(owners, device=stacked.device).argsort()
    return o, stacked[order]
