"""The chunked PyTorch backend: docs/design.md §3 (the UT transform with separate erase and write
strengths) and §7 (its backward, written out by hand).

Inside a chunk of ``C`` tokens every token writes ``S_i = α_i S_{i−1} + k_i u_iᵀ``; solving for all
``u_i`` at once is one unit-lower-triangular system, so the only sequential work left is one
state update per chunk. Everything else is batched over batch, heads and chunks.

Inputs arrive with the rule already applied (``a``, ``b``) and padded tokens made identity
steps (``k = v = 0``, ``a = b = 0``, ``log_decay = 0``), so this file knows nothing of rules.

Non-finite inputs stay causal. Every product over a chunk's tokens (``T X``, ``P U``) multiplies
the masked-out future by exact zeros, and ``0 · NaN = NaN``: one NaN in ``k`` or ``v`` at token 20
of a chunk would make tokens 0–19 NaN although the recurrence never lets them see it. So the
chunked algorithm runs on finite copies (non-finite entries zeroed, fused into the copies that
chunking makes anyway), and a per-token *poison*, 0 before a sequence's first non-finite
``k``, ``v``, ``a``, ``b`` or ``log α`` and NaN from there on, is added to the outputs' row scale
and to the final state. Outputs before that token are exactly those of finite inputs; from it on,
every output and the final state are NaN (the reference may keep some value columns finite).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per chunk, C of docs/design.md §3, written once: the Triton kernels' one chunk length
# (ops/triton/common.py's CHUNK is this number) and the torch backend's default off CPU.
TRITON_CHUNK_SIZE = 64
# The torch backend's default chunk on CPU: with the forward-only path, 32-token chunks beat 64
# by ~15% at B=1, T=4096, H=4, D=64 (less C×C work per token; the loop's extra steps are cheap
# on CPU).
CPU_CHUNK_SIZE = 32


def default_chunk_size(device: torch.device | str) -> int:
    """The chunk length the op uses on ``device`` when given ``chunk_size=None``: what
    :func:`deltaflow.delta_rule` runs and what FLOP estimates assume."""
    return CPU_CHUNK_SIZE if torch.device(device).type == "cpu" else TRITON_CHUNK_SIZE


def _to_chunks(x: Tensor, n_chunks: int, chunk_size: int) -> Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...]."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, n_chunks, chunk_size, H, *x.shape[3:])
    return x.movedim(3, 1).contiguous()  # one copy here instead of one per matmul


def _finite(x: Tensor) -> Tensor:
    """``x`` with NaN and ±inf entries replaced by 0."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def unit_lower_inverse(A: Tensor) -> Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two).

    The recursion of LAPACK's trtri, batched: from 1×1 diagonal blocks up, two inverted blocks
    merge as ``[[X1, 0], [L21, X2]]^{-1} = [[X1⁻¹, 0], [−X2⁻¹ L21 X1⁻¹, X2⁻¹]]``. Exact (no
    series), a handful of batched matmuls, and much faster on CPU than a batched triangular solve.
    """
    C = A.shape[-1]
    lead = A.shape[:-2]
    X = torch.ones(*lead, C, 1, 1, dtype=A.dtype, device=A.device)  # inverted 1×1 blocks
    b = 1
    while b < C:
        n = C // (2 * b)
        blocks = A.reshape(*lead, n, 2 * b, n, 2 * b)
        blocks = torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)  # 2b×2b diagonal blocks
        X1, X2 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        lower = -(X2 @ blocks[..., b:, :b] @ X1)
        X = torch.cat([torch.cat([X1, torch.zeros_like(X1)], -1), torch.cat([lower, X2], -1)], -2)
        b *= 2
    return X.squeeze(-3)


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor | None,
    scale: float,
    initial_state: Tensor | None,
    chunk_size: int,
    documents: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """All inputs in the compute dtype. Returns ``o [B,T,H,Dv]`` and the final state.

    ``documents``: ``(doc, start)``, int ``[T]`` each, for B == 1 rows packing documents in
    place: token t belongs to document ``doc[t]``, which begins at token ``start[t]``; the
    recurrence restarts from a zero state at every document's first token (and the non-finite
    poison restarts with it); the final state is the last document's. See
    :func:`document_masks`."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    if initial_state is None:
        initial_state = q.new_zeros(B, H, Dk, Dv)
    poison = non_finite_poison(k, v, a, b, log_decay, documents)
    pad = (-T) % C
    N = (T + pad) // C
    masks = None if documents is None else document_masks(documents[0], N, C)
    if not _needs_grad(q, k, v, a, b, log_decay, initial_state):
        return _forward_only(q, k, v, a, b, log_decay, initial_state, scale, C, poison, masks)
    if log_decay is None:
        log_decay = torch.zeros_like(a)
    if pad:  # identity steps at the end: k = v = 0, a = b = 0, α = 1
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        a, b, log_decay = (F.pad(x, (0, 0, 0, pad)) for x in (a, b, log_decay))
    chunks = [_to_chunks(x, N, C) for x in (q, k, v, a, b, log_decay)]  # [B, H, N, C, ...]
    # [N, C, C] / [N, C] masks broadcast over [B, H, N, ...] (documents imply B == 1)
    same, carry, tail = (None,) * 3 if masks is None else masks
    o, state, *_ = ChunkedRecurrence.apply(*chunks, initial_state, scale, same, carry, tail)
    o = o.movedim(1, 3).reshape(B, N * C, H, Dv)[:, :T] + poison[..., None]
    return o, state + poison[:, -1, :, None, None]


def document_masks(doc: Tensor, n_chunks: int, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The masks that restart the recurrence at document starts inside ``n_chunks`` chunks.

    A document starting at token r is the recurrence with ``α_r = 0``: every decay product
    that spans r is zero, so the masks zero exactly those factors (no ``log α = −inf``, whose
    differences would be NaN): ``same [N, C, C]`` keeps e^{γ_i − γ_j} for i, j of one
    document; ``carry [N, C]`` keeps Γ_i = e^{γ_i} (how token i sees the state entering the
    chunk) where token i belongs to that state's document (the document of the token before
    the chunk; the first chunk's is document 0); ``tail [N, C]`` keeps e^{γ_C − γ_j} (token
    j's write reaching the chunk's end) where j belongs to the last token's document. All
    are tensor ops on ``doc [T]``: no size depends on the documents' lengths or count."""
    pad = n_chunks * chunk_size - doc.shape[0]
    if pad:  # the identity steps at the end belong to the last document
        doc = torch.cat([doc, doc[-1:].expand(pad)])
    doc = doc.view(n_chunks, chunk_size)
    same = doc[:, :, None] == doc[:, None, :]
    entering = torch.cat([doc.new_zeros(1), doc[:-1, -1]])  # the state's document, per chunk
    carry = doc == entering[:, None]
    tail = doc == doc[:, -1:]
    return same, carry, tail


def non_finite_poison(
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    log_decay: Tensor | None,
    documents: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``[B, T, H]``: 0 before the first token whose ``k``, ``v``, ``a``, ``b`` or ``log α`` holds a
    NaN or ±inf, NaN from that token on (per batch row and head; with ``documents``, see
    :func:`chunk_delta_rule`, per document: from that token to its document's end).

    ``x · 0`` is 0 for finite ``x`` and NaN otherwise; a row sum is non-finite when any entry is
    (or when it overflows, where the chunked products would overflow too). The cumulative sum
    then carries the NaN forward in time, never backward."""
    with torch.no_grad():
        flags = k.sum(-1) + v.sum(-1) + a + b
        if log_decay is not None:
            flags = flags + log_decay
        if documents is None:
            return (flags * 0).cumsum(1)
        # per document: count the non-finite tokens since the document's first token
        bad = (flags * 0).isnan().long()
        seen = bad.cumsum(1)
        before = (seen - bad)[:, documents[1]]  # the count before each token's document
        return torch.where(seen > before, torch.nan, 0.0).to(flags.dtype)


def _needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd (or a torch.func transform) may ask for gradients of this call."""
    if torch._C._are_functorch_transforms_active():  # grad/vmap wrappers hide requires_grad
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _forward_only(q, k, v, a, b, log_decay, S, scale, C, poison, masks=None):
    """The forward of :func:`_forward` when no gradient is needed (inference, evaluation).

    Same equations, arranged for speed on CPU (benchmarks/NOTES.md, issue 10): chunk-major
    layout ``[N, B·H, C, D]`` so each step of the sequential loop reads contiguous blocks;
    nothing is kept for a backward; the states entering each chunk and the chunk's U are written
    side by side into one buffer, so the output is the single product ``[Γq | P]·[S₀; U]``;
    without decay the decay matrix is just the causal mask. ``poison`` (see
    :func:`non_finite_poison`) rides on the output's row scale and the final state.
    ``masks``: :func:`document_masks` (documents packed in place, B == 1).
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    pad = N * C - T
    BH = B * H

    def chunks(x: Tensor, finite: bool = True) -> Tensor:
        """[B, T, H, ...] -> [N, B·H, C, ...], zero-padded; ``finite``: NaN, ±inf -> 0."""
        if pad:  # identity steps at the end: k = v = 0, a = b = 0, α = 1
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(B, N, C, H, *x.shape[3:]).movedim(2, 3).transpose(0, 1)
        # the one copy of each input (contiguous also when B == 1 would allow a strided view);
        # zeroing non-finite entries rides on that copy
        out = x.clone(memory_format=torch.contiguous_format)
        if finite:
            torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)  # as _finite
        return out.view(N, BH, C, *x.shape[4:])

    q = chunks(q, finite=False)  # q is never summed over tokens: it needs no finite copy
    k, v, a, b = (chunks(x) for x in (k, v, a, b))
    state_poison = poison[:, -1].reshape(B, H, 1, 1)
    poison = chunks(poison, finite=False)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if masks is not None:  # [N, C, C] / [N, C] over [N, B·H, ...] (B == 1)
        causal = causal & masks[0][:, None]
    if log_decay is None and masks is None:
        decay = causal.to(q.dtype)  # e^{γ_i − γ_j} = 1 for j ≤ i
        Gamma = Gamma_C = to_end = None
    else:  # (the document masks act on Γ: the general form also without decay)
        log_decay = torch.zeros_like(a) if log_decay is None else chunks(log_decay)
        gamma = log_decay.cumsum(-1)  # γ_i = Σ_{j≤i} log α_j
        # e^{γ_i − γ_j} for j ≤ i from the difference (never Γ_i / Γ_j), 0 above the diagonal
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill_(~causal, -torch.inf)
        decay = decay.exp_()
        # the masks' [N, C] broadcast over this layout's B·H: [N, 1, C]
        cuts = None if masks is None else (None, masks[1][:, None], masks[2][:, None])
        Gamma, to_end = _gamma_to_end(gamma, cuts)
        Gamma_C = Gamma[..., -1, None, None]  # [N, B·H, 1, 1]
        to_end = to_end[..., None]

    # (3) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i: decay is 0 above the diagonal, so only the
    # diagonal needs clearing
    A = (k @ k.mT).mul_(decay).mul_(a[..., :, None])
    A.diagonal(dim1=-2, dim2=-1).zero_()
    T_inv = _unit_lower_inverse_inplace(A.reshape(N * BH, C, C)).view(N, BH, C, C)
    # (4) W = T diag(aΓ) K,  Ũ = T diag(b) V: the diagonal scalings go on T's columns (C² values
    # per chunk instead of C·D), the products as [N·B·H, C, D] (3-D: plain batched GEMMs)
    aG = a if Gamma is None else a * Gamma
    W = ((T_inv * aG[..., None, :]).view(N * BH, C, C) @ k.view(N * BH, C, Dk)).view(k.shape)
    U_tilde = (T_inv.mul_(b[..., None, :]).view(N * BH, C, C) @ v.view(N * BH, C, Dv)).view(v.shape)
    k_to_end = k if to_end is None else k * to_end  # K̃ = diag(e^{γ_C − γ_j}) K

    # contiguous per-chunk slices: strided ones make baddbmm fall back to one GEMM per matrix
    states = q.new_empty(N + 1, BH, Dk, Dv)  # the state entering each chunk; slot N the final
    U = q.new_empty(N, BH, C, Dv)
    states[0] = S.reshape(BH, Dk, Dv)
    for n in range(N):  # the only sequential part: one state update per chunk
        torch.baddbmm(U_tilde[n], W[n], states[n], alpha=-1, out=U[n])  # U = Ũ − W S_0
        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U   (K̃ᵀ as a transposed view: no copy)
        if Gamma_C is None:
            torch.baddbmm(states[n], k_to_end[n].mT, U[n], out=states[n + 1])
        else:
            torch.mul(states[n], Gamma_C[n], out=states[n + 1])
            states[n + 1].baddbmm_(k_to_end[n].mT, U[n])

    # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]: one GEMM, one GEMM-add.
    # The row scale carries the poison: + 0 before a non-finite input, + NaN from it on.
    row_scale = scale + poison if Gamma is None else scale * Gamma + poison
    qG = q * row_scale[..., None]
    P = (q @ k.mT).mul_(decay).mul_(scale)
    o = torch.bmm(qG.view(N * BH, C, Dk), states[:N].view(N * BH, Dk, Dv))
    o.baddbmm_(P.view(N * BH, C, C), U.view(N * BH, C, Dv))
    o = o.view(N, B, H, C, Dv).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)
    return o[:, :T], states[N].reshape(B, H, Dk, Dv) + state_poison


def _unit_lower_inverse_inplace(A: Tensor) -> Tensor:
    """:func:`unit_lower_inverse` for ``A [M, C, C]`` without autograd: the same block recursion,
    each level written into one preallocated result instead of concatenated (fewer copies)."""
    M, C, _ = A.shape
    X = torch.zeros_like(A)
    X.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    b = 1
    while b < C:
        n = C // (2 * b)
        # the n diagonal 2b×2b blocks of every matrix, as writable views [M, n, 2b, 2b]
        Xb = X.view(M, n, 2 * b, n, 2 * b).diagonal(dim1=1, dim2=3).movedim(-1, 1)
        Ab = A.view(M, n, 2 * b, n, 2 * b).diagonal(dim1=1, dim2=3).movedim(-1, 1)
        X1, X2 = Xb[..., :b, :b], Xb[..., b:, b:]
        Xb[..., b:, :b] = -(X2 @ Ab[..., b:, :b] @ X1)
        b *= 2
    return X


class ChunkedRecurrence(torch.autograd.Function):
    """(3)–(6) on chunked tensors, with the hand-derived backward of :func:`_backward`.

    New-style (``setup_context``) so that torch.func transforms work through it; the saved
    intermediates leave ``forward`` as extra, non-differentiable outputs.

    ``k, v, a, b, log α`` are used with their non-finite entries zeroed (the module docstring
    says why); the backward treats that replacement as the identity, so it costs one cheap pass
    per input in the forward and nothing in the backward.
    """

    @staticmethod
    def forward(q, k, v, a, b, log_decay, initial_state, scale, same=None, carry=None, tail=None):
        k, v, a, b, log_decay = (_finite(x) for x in (k, v, a, b, log_decay))
        masks = None if same is None else (same, carry, tail)
        o, state, saved = _forward(q, k, v, a, b, log_decay, initial_state, scale, masks)
        return (o, state, k, v, a, b, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, _, _, _, _, _, _, scale, *masks = inputs
        _, _, *saved = output  # the finite k, v, a, b, then _forward's intermediates
        ctx.mark_non_differentiable(*saved)
        ctx.masked = bool(masks) and masks[0] is not None
        # the decay the forward kept is already masked; the backward rebuilds Γ and e^{γ_C − γ}
        ctx.save_for_backward(q, *saved, *(masks[1:] if ctx.masked else ()))
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad_o, grad_state, *_):
        q, k, v, a, b, *saved = ctx.saved_tensors
        masks = None
        if ctx.masked:
            *saved, carry, tail = saved
            masks = (None, carry, tail)
        # in the forward's dtype also when backward() is called inside an autocast region
        with torch.autocast(q.device.type, enabled=False):
            grads = _backward(q, k, v, a, b, saved, grad_o, grad_state, ctx.scale, masks)
        return (*grads, None, None, None, None)


def _forward(q, k, v, a, b, log_decay, S, scale, masks=None):
    """Chunked forward on [B, H, N, C, ...]; returns o, the final state, and what backward needs.
    ``masks``: :func:`document_masks` (documents packed in place, B == 1)."""
    C = q.shape[-2]
    N = q.shape[2]
    gamma = log_decay.cumsum(-1)  # γ_i = Σ_{j≤i} log α_j
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # j < i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j ≤ i
    if masks is not None:  # no decay product across a document start (A is masked with it)
        causal = causal & masks[0]
    # e^{γ_i − γ_j} for j ≤ i, formed from the difference (never Γ_i / Γ_j), 0 above the diagonal.
    decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf))

    # (3) A_ij = a_i e^{γ_i − γ_j} k_iᵀk_j for j < i;  T = (I + A)^{-1}
    A = (a[..., :, None] * decay * (k @ k.mT)).masked_fill(~strict, 0)
    Gamma, to_end = _gamma_to_end(gamma, masks)  # Γ_i = e^{γ_i}, e^{γ_C − γ_j}
    # (4) W = T diag(aΓ) K,  Ũ = T diag(b) V   (all chunks at once)
    T_inv = unit_lower_inverse(A)
    W = T_inv @ ((a * Gamma)[..., None] * k)
    U_tilde = T_inv @ (b[..., None] * v)
    # diag(e^{γ_C − γ_j}) K: token j's key, weighted by how much of its write survives to the
    # chunk's end; transposed, it carries U into the state (6).
    k_to_end = k * to_end[..., None]
    k_to_end_t = k_to_end.mT.contiguous()
    Gamma_C = Gamma[..., -1, None, None]  # [B, H, N, 1, 1]

    states, updates = [], []
    for n in range(N):  # the only sequential part: one state update per chunk
        U = U_tilde[:, :, n] - W[:, :, n] @ S  # U = Ũ − W S_0
        states.append(S)
        updates.append(U)
        # (6) S_C = Γ_C S_0 + Kᵀ diag(e^{γ_C − γ_j}) U
        S = Gamma_C[:, :, n] * S + k_to_end_t[:, :, n] @ U
    S0 = torch.stack(states, dim=2)  # state entering each chunk, [B, H, N, Dk, Dv]
    U = torch.stack(updates, dim=2)  # [B, H, N, C, Dv]

    # (5) O = scale [diag(Γ) Q S_0 + ((Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}) U]
    o = scale * (Gamma[..., None] * (q @ S0) + ((q @ k.mT) * decay) @ U)
    return o, S, (gamma, decay, T_inv, W, k_to_end, S0, U)


def _gamma_to_end(gamma: Tensor, masks: tuple | None) -> tuple[Tensor, Tensor]:
    """``Γ = e^{γ}`` and ``e^{γ_C − γ}``, zeroed where :func:`document_masks` cut them. Their
    derivatives in γ are themselves (a mask is a constant), so the backward's formulas hold
    unchanged with the masked values."""
    Gamma = torch.exp(gamma)
    to_end = torch.exp(gamma[..., -1:] - gamma)
    if masks is not None:
        Gamma = torch.where(masks[1], Gamma, 0.0)
        to_end = torch.where(masks[2], to_end, 0.0)
    return Gamma, to_end


def _backward(q, k, v, a, b, saved, dO, dS, scale, masks=None):
    """Gradients of (5)–(6) and (3)–(4) for q, k, v, a, b, log α and the initial state.

    Reverse over chunks only for the state's gradient g (the mirror of (6)):
    dU_n = scale·P_nᵀ dO_n + K̃_n g_{n+1},  g_n = scale·(diag(Γ)Q_n)ᵀ dO_n + Γ_C g_{n+1} − W_nᵀ dU_n,
    with K̃ = diag(e^{γ_C − γ}) K and P = (Q Kᵀ) ⊙ M ⊙ e^{γ_i − γ_j}; everything else is batched.
    """
    gamma, decay, T_inv, W, k_to_end, S0, U = saved
    N = q.shape[2]
    Gamma, to_end = _gamma_to_end(gamma, masks)
    Gamma_C = Gamma[..., -1]  # [B, H, N]
    QK = q @ k.mT
    P = QK * decay
    dU_local = scale * (P.mT @ dO)  # from the output (5)
    QG_t = (scale * Gamma[..., None] * q).mT  # d o / d S_0, transposed: [B, H, N, Dk, C]

    g = dS
    dUs, gs = [None] * N, [None] * N
    for n in reversed(range(N)):  # the state's gradient, chunk by chunk from the end
        gs[n] = g  # gradient of the state leaving chunk n
        dU_n = dU_local[:, :, n] + k_to_end[:, :, n] @ g
        dUs[n] = dU_n
        g = QG_t[:, :, n] @ dO[:, :, n] + Gamma_C[:, :, n, None, None] * g - W[:, :, n].mT @ dU_n
    d_initial = g
    dU = torch.stack(dUs, dim=2)  # [B, H, N, C, Dv]
    g_end = torch.stack(gs, dim=2)  # [B, H, N, Dk, Dv]

    # (5): O = scale [diag(Γ) Q S_0 + P U]
    dP = scale * (dO @ U.mT)  # [B, H, N, C, C]
    dq = scale * Gamma[..., None] * (dO @ S0.mT) + (dP * decay) @ k
    dk = (dP * decay).mT @ q
    d_decay = dP * QK
    d_Gamma = scale * (dO * (q @ S0)).sum(-1)

    # (6): S_C = Γ_C S_0 + K̃ᵀ U, K̃ = diag(e^{γ_C − γ}) K
    d_k_to_end = U @ g_end.mT  # [B, H, N, C, Dk]
    dk = dk + to_end[..., None] * d_k_to_end
    t = (d_k_to_end * k_to_end).sum(-1)  # d/dγ_C of K̃ (and minus d/dγ_i)
    d_gamma = -t
    d_gamma_C = t.sum(-1) + (g_end * S0).sum((-1, -2)) * Gamma_C

    # (4): U = Ũ − W S_0, Ũ = T Y, W = T X with X = diag(aΓ) K, Y = diag(b) V
    dW = -(dU @ S0.mT)
    X = (a * Gamma)[..., None] * k
    Y = b[..., None] * v
    dT = dW @ X.mT + dU @ Y.mT
    dX = T_inv.mT @ dW
    dY = T_inv.mT @ dU
    # (3): T = (I + A)^{-1} → dA = −Tᵀ dT Tᵀ on the strictly lower part
    strict = torch.ones_like(decay, dtype=torch.bool).tril(-1)
    dA = -(T_inv.mT @ dT @ T_inv.mT) * strict
    KK = k @ k.mT
    da = (dA * decay * KK).sum(-1)
    dKK = dA * (a[..., :, None] * decay)
    dk = dk + dKK @ k + dKK.mT @ k
    d_decay = d_decay + dA * a[..., :, None] * KK
    xk = (dX * k).sum(-1)
    da = da + Gamma * xk
    d_Gamma = d_Gamma + a * xk
    dk = dk + (a * Gamma)[..., None] * dX
    db = (dY * v).sum(-1)
    dv = b[..., None] * dY

    # decay_ij = e^{γ_i − γ_j}, Γ_i = e^{γ_i}, γ_C = γ of the chunk's last token
    dE = d_decay * decay
    d_gamma = d_gamma + dE.sum(-1) - dE.sum(-2) + d_Gamma * Gamma
    d_gamma[..., -1] += d_gamma_C
    d_log_decay = d_gamma.flip(-1).cumsum(-1).flip(-1)  # γ = cumsum(log α)
    return dq, dk, dv, da, db, d_log_decay, d_initial
