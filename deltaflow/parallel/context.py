"""Context parallelism: one long sequence trained across the ranks of a process group.

Every rank of the group holds one contiguous segment of each sequence (rank r the r-th), and
runs the model on it. Only two things in a DeltaFlow model look across a segment boundary:

- the short convolutions read the ``conv_size − 1`` tokens before each position: each rank
  receives the last ones of the previous rank (:class:`_Halo`; the backward sends their
  gradient back);
- the delta-rule recurrence carries its state: each rank computes its segment's transition
  ``[P | S]`` from a zero incoming state (``deltaflow.ops.segments``), the ranks all-gather the
  transitions, chain them in float32 to get each segment's incoming state, and correct their
  outputs (:class:`_SegmentExchange`; its backward chains the gradients back and sums every
  rank's contribution to every transition with one all-reduce).

Everything else (projections, norms, MLPs, the loss) is per token. Softmax attention layers
would need a ring or all-gather attention: :func:`enable_context_parallel` refuses them.

Gradients: inputs that every rank holds in full (weights, ``initial_state``) get each rank's
share of the gradient; their sum over the ranks is the gradient (DDP's and FSDP's all-reduce
over the whole world does that sum for weights). Outputs that every rank holds in full (the
final states) take the sum of the ranks' gradients. Every rank must run the same layers in the
same order, forward and backward (collectives), as with DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from deltaflow.ops.segments import (
    SegmentPlan,
    SegmentSummary,
    apply_incoming,
    apply_incoming_backward,
    chain,
    chain_backward,
    plan_segment,
    summarize_segment,
)


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism needs an initialized torch.distributed process group "
            "(torchrun, or dist.init_process_group)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(x: Tensor, group: dist.ProcessGroup | None, world: int) -> Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (list form: supported by gloo and NCCL)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


# ---------------------------------------------------------------------------- the state
@dataclass(frozen=True)
class _ExchangeMeta:
    group: dist.ProcessGroup | None
    rank: int
    world: int
    head_final_docs: tuple[int, ...]
    final_docs: tuple[int, ...]
    n_final: int  # number of final states the op returns (0: none requested)


class _SegmentExchange(torch.autograd.Function):
    """All-gather the segments' transitions, chain them, correct this rank's outputs and owned
    final states, and share the final states (forward); the mirror image backward.

    One Function for every collective of one op call: its backward runs on every rank (each
    rank's outputs depend on it), so the ranks meet in the same collectives in the same order.
    """

    @staticmethod
    def forward(ctx, meta, o, q_in, head, out, finals):
        with torch.autocast(o.device.type, enabled=False):  # the chain stays in fp32/fp64
            transitions = _all_gather(out, meta.group, meta.world)  # [R, n, H, Dk, Dk + Dv]
            states = chain(transitions[: meta.rank])  # only the earlier segments matter here
            incoming = states[meta.rank]
            summary = SegmentSummary(
                o, q_in, head, out, list(meta.head_final_docs), finals, list(meta.final_docs)
            )
            o_true, owned = apply_incoming(summary, incoming)
            shared = o.new_zeros(0)
            if meta.n_final:
                Dk = out.shape[-2]
                shared = out.new_zeros(meta.n_final, *out.shape[1:-1], out.shape[-1] - Dk)
                if owned is not None:
                    docs = list(meta.head_final_docs) + list(meta.final_docs)
                    shared[docs] = owned.to(shared.dtype)
                dist.all_reduce(shared, group=meta.group)  # each document has one owner
        ctx.meta = meta
        ctx.o_dtype = o.dtype
        # q_in is a view of the op's output [q̃ | o]: a copy of it alone lets the rest go
        q_in = None if q_in is None else q_in.contiguous()
        ctx.save_for_backward(q_in, head, transitions[: meta.rank], states)
        return o_true, shared

    @staticmethod
    def backward(ctx, grad_o, grad_shared):
        meta = ctx.meta
        q_in, head, transitions, states = ctx.saved_tensors
        with torch.autocast(grad_o.device.type, enabled=False):
            grad_head_finals = grad_finals = None
            if meta.n_final:
                # every rank holds the final states: their gradient is the sum of the ranks'
                total = grad_shared.contiguous().clone()
                dist.all_reduce(total, group=meta.group)
                n_head = len(meta.head_final_docs)
                if n_head:
                    grad_head_finals = total[list(meta.head_final_docs)]
                if meta.final_docs:
                    grad_finals = total[list(meta.final_docs)]
            grad_q_in, grad_head, grad_incoming = apply_incoming_backward(
                q_in, head, states[meta.rank], grad_o, grad_head_finals
            )
            # d/d(every segment's transition) from this rank's incoming state, then summed
            # over the ranks: rank j's transition reaches every later rank.
            R, rank = meta.world, meta.rank
            Dk, Dv = grad_incoming.shape[-2:]
            grad_all = grad_incoming.new_zeros(R, *grad_incoming.shape[:-1], Dk + Dv)
            if rank > 0:
                grad_states = torch.zeros_like(states)
                grad_states[rank] = grad_incoming
                grad_all[:rank] = chain_backward(transitions, states, grad_states)
            dist.all_reduce(grad_all, group=meta.group)
            grad_out = grad_all[rank]
        return None, grad_o.to(ctx.o_dtype), grad_q_in, grad_head, grad_out, grad_finals


def context_parallel_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    bounds: Sequence[int] | None = None,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    **op_kwargs,
) -> tuple[Tensor, Tensor | None]:
    """:func:`deltaflow.delta_rule` of a sequence split along T over the ranks of ``group``.

    Each rank passes its own segment (``q, k, v, beta, log_decay``: ``[B, T_r, ...]``, rank r
    holding the r-th segment) and gets its segment's outputs; the result equals the op on the
    whole sequence. ``cu_seqlens``: the GLOBAL offsets of documents packed along T (B == 1),
    the same on every rank; documents may cross any number of segment boundaries.
    ``bounds``: the segments' global offsets (``[R + 1]``); needed with ``cu_seqlens`` when
    the segments are not all the same length (default: equal segments). ``initial_state``:
    ``[B or N, H, Dk, Dv]`` on every rank; each rank applies those of the documents that start
    in its segment (the gradient it gets is its share). ``output_final_state``: every rank
    returns all final states. Other keyword arguments go to the op (rule, negative_eigenvalues,
    eps, scale, chunk_size, backend).
    """
    rank, world = _group_rank_and_size(group)
    L = q.shape[1]
    if L == 0:
        raise ValueError("context parallelism: every rank needs at least one token (T_r >= 1)")
    plan = _plan(rank, world, L, cu_seqlens, bounds)
    summary = summarize_segment(
        q,
        k,
        v,
        beta,
        plan,
        log_decay=log_decay,
        initial_state=initial_state,
        output_final_state=output_final_state,
        **op_kwargs,
    )
    n_final = 0
    if output_final_state:
        n_final = q.shape[0] if plan.rows else len(_host_offsets(cu_seqlens)) - 1
    meta = _ExchangeMeta(
        group, rank, world, tuple(summary.head_final_docs), tuple(summary.final_docs), n_final
    )
    o, finals = _SegmentExchange.apply(
        meta, summary.o, summary.q_in, summary.head, summary.out, summary.finals
    )
    return o, (finals if output_final_state else None)


def _host_offsets(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    if isinstance(cu_seqlens, Tensor):
        return [int(c) for c in cu_seqlens.tolist()]
    return [int(c) for c in cu_seqlens]


def _plan(
    rank: int,
    world: int,
    length: int,
    cu_seqlens: Tensor | Sequence[int] | None,
    bounds: Sequence[int] | None,
) -> SegmentPlan:
    """This rank's segment plan. Unpacked rows only need to know first / last rank."""
    if cu_seqlens is None:
        lo = rank * length
        return SegmentPlan(
            lo, lo + length, continues_in=rank > 0, continues_out=rank < world - 1, rows=True
        )
    offsets = _host_offsets(cu_seqlens)
    total = offsets[-1]
    if bounds is None:
        if total != world * length:
            raise ValueError(
                f"cu_seqlens ends at {total} tokens but {world} ranks x {length} local tokens "
                f"= {world * length}: pass bounds=[...] (the segments' global offsets) when "
                "the segments differ in length"
            )
        bounds = [r * length for r in range(world + 1)]
    bounds = [int(b) for b in bounds]
    if len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"bounds must hold {world + 1} offsets from 0 to {total}, got {bounds}")
    if bounds[rank + 1] - bounds[rank] != length:
        raise ValueError(
            f"rank {rank} holds {length} tokens but bounds give it "
            f"[{bounds[rank]}, {bounds[rank + 1]})"
        )
    return plan_segment(bounds[rank], bounds[rank + 1], total, offsets)


# ---------------------------------------------------------------------------- conv halos
class _Halo(torch.autograd.Function):
    """Each rank gets the previous rank's last ``W − 1`` tokens (zeros on rank 0); the
    backward returns their gradient to the rank they came from."""

    @staticmethod
    def forward(ctx, tail, group, rank, world):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        gathered = _all_gather(tail, group, world)
        return gathered[rank - 1] if rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, grad_halo):
        gathered = _all_gather(grad_halo, ctx.group, ctx.world)
        rank = ctx.rank
        grad = gathered[rank + 1] if rank < ctx.world - 1 else torch.zeros_like(grad_halo)
        return grad, None, None, None


def exchange_halo(tail: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The previous rank's ``tail`` (``[B, W − 1, C]``, its last tokens), zeros on rank 0."""
    rank, world = _group_rank_and_size(group)
    return _Halo.apply(tail, group, rank, world)


# ---------------------------------------------------------------------------- the layers
class ContextParallel:
    """The context-parallel group of a model's delta-rule layers (see
    :func:`enable_context_parallel`). ``set_documents`` declares packed documents (global
    offsets); it stays in effect (also for a backward's recomputation) until changed."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world = _group_rank_and_size(group)
        self.enabled = True
        self.cu_seqlens: list[int] | None = None

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        return self  # a copied model stays in the same group

    def set_documents(self, cu_seqlens: Tensor | Sequence[int] | None) -> None:
        """Global offsets ``[N + 1]`` of documents packed along each rank's ``[1, T_r]`` row
        (T = world x T_r), or None for unpacked rows."""
        self.cu_seqlens = None if cu_seqlens is None else _host_offsets(cu_seqlens)
        if self.cu_seqlens is not None and self.cu_seqlens[-1] % self.world:
            raise ValueError(
                f"cu_seqlens ends at {self.cu_seqlens[-1]} tokens, not a multiple of the "
                f"{self.world} context-parallel ranks"
            )

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the layers on whole sequences, each rank alone (e.g. evaluation on rank 0)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def check_call(
        self,
        attention_mask: Tensor | None,
        state: dict | None,
        use_cache: bool,
        cu_seqlens: Tensor | None,
    ) -> None:
        """Refuse what a layer cannot do on a segment, naming the argument."""
        if attention_mask is not None:
            raise ValueError(
                "context parallelism: attention_mask (padding) is not supported; pack "
                "documents with ContextParallel.set_documents instead"
            )
        if state or use_cache:
            raise ValueError("context parallelism: no recurrent state or cache (training only)")
        if cu_seqlens is not None:
            raise ValueError(
                "context parallelism: pass the GLOBAL document offsets once with "
                "ContextParallel.set_documents(cu_seqlens), not cu_seqlens to the model"
            )

    def plan(self, length: int) -> SegmentPlan:
        return _plan(self.rank, self.world, length, self.cu_seqlens, None)

    def _with_halo(self, x: Tensor, W: int) -> tuple[Tensor, Tensor | None]:
        """``x [B, L, C]`` with the previous rank's last ``W − 1`` tokens in front (zeros on
        rank 0), and the packed offsets a causal conv of that needs (None for plain rows).
        The conv's first ``W − 1`` outputs (the halo's own) are to be dropped."""
        L = x.shape[1]
        if L < W - 1:
            raise ValueError(
                f"context parallelism: each rank needs at least conv_size - 1 = {W - 1} tokens "
                f"for the short convolutions' halo, got {L}"
            )
        halo = exchange_halo(x[:, L - (W - 1) :], self.group)
        extended = torch.cat([halo, x], dim=1)
        if self.cu_seqlens is None:
            return extended, None
        # Packed documents: the halo belongs to the first document only where that document
        # started before this segment, and only from its start on; before that it is a piece
        # of its own (whose outputs are dropped), so no tap reaches across a document start.
        plan = self.plan(L)
        halo_start = W - 1
        if plan.continues_in:
            halo_start = max(0, (W - 1) - (plan.lo - plan.first_start))
        cu = ([0, halo_start] if halo_start > 0 else [0]) + [W - 1 + c for c in plan.cu[1:]]
        return extended, torch.tensor(cu, dtype=torch.long, device=x.device)

    def conv_silu(self, x: Tensor, weight: Tensor) -> Tensor:
        """:func:`deltaflow.layers.conv.causal_conv_silu` of this rank's segment (the fused
        q|k|v channels, ``weight [C, W]``), continuing the previous rank's."""
        from deltaflow.layers.conv import causal_conv_silu

        W = weight.shape[-1]
        if W == 1:
            return causal_conv_silu(x, weight)
        extended, cu = self._with_halo(x, W)
        return causal_conv_silu(extended, weight, cu)[:, W - 1 :]

    def short_convs(self, convs: Sequence[nn.Module], xs: Sequence[Tensor]) -> list[Tensor]:
        """The ShortConvolution modules ``convs`` (one kernel size) of q, k, v on this rank's
        segment, continuing the previous rank's: one halo exchange for the three."""
        W = convs[0].kernel_size
        if W == 1:
            return [conv(x)[0] for conv, x in zip(convs, xs)]
        extended, cu = self._with_halo(torch.cat(list(xs), dim=-1), W)
        parts = extended.split([x.shape[-1] for x in xs], dim=-1)
        return [conv(part, cu_seqlens=cu)[0][:, W - 1 :] for conv, part in zip(convs, parts)]

    def delta_rule(self, q, k, v, beta=None, **kwargs) -> tuple[Tensor, Tensor | None]:
        """:func:`context_parallel_delta_rule` over this group and documents."""
        kwargs.pop("cu_seqlens", None)  # check_call refused a local one
        return context_parallel_delta_rule(
            q, k, v, beta, group=self.group, cu_seqlens=self.cu_seqlens, **kwargs
        )


def enable_context_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> ContextParallel:
    """Make every delta-rule layer of ``model`` run context-parallel over ``group``.

    Call it on every rank, before wrapping the model in DDP / FSDP2; feed each rank its
    segment of every sequence (rank r of the group: tokens ``[r·T/R, (r+1)·T/R)``). Softmax
    attention layers (hybrid models) are refused: they would need a ring or all-gather
    attention.

    ``group=None`` creates a new group of all ranks rather than using the default one: the
    layers' collectives must not share a communicator with DDP's or FSDP's gradient
    reductions, which are issued as gradients become ready, in an order that may differ
    between ranks whose graphs differ (NCCL runs a communicator's collectives in the order
    each rank issues them).
    """
    from deltaflow.layers.delta_attention import DeltaAttention
    from deltaflow.layers.softmax_attention import SoftmaxAttention

    attention = [name for name, m in model.named_modules() if isinstance(m, SoftmaxAttention)]
    if attention:
        raise ValueError(
            f"context parallelism supports delta-rule layers only; this model has softmax "
            f"attention layers ({', '.join(attention[:3])}{', ...' if len(attention) > 3 else ''})"
            ": train hybrid models with data parallelism (DDP / FSDP2)"
        )
    layers = [m for m in model.modules() if isinstance(m, DeltaAttention)]
    if not layers:
        raise ValueError("context parallelism: the model has no DeltaAttention layer")
    if group is None:
        _group_rank_and_size(None)  # a clear error without a process group
        group = dist.new_group(list(range(dist.get_world_size())))
    cp = ContextParallel(group)
    for layer in layers:
        layer.context_parallel = cp
    return cp


def disable_context_parallel(model: nn.Module) -> None:
    """Undo :func:`enable_context_parallel`: every layer sees whole sequences again."""
    from deltaflow.layers.delta_attention import DeltaAttention

    for m in model.modules():
        if isinstance(m, DeltaAttention):
            m.context_parallel = None
