"""Causal depthwise short conv + SiLU + per-head L2 normalization in one pair of Triton kernels
behind ``torch.library`` custom ops (issue 31, session 15): what DeltaAttention's fused path
computes over the q|k|v columns of its projection,

    u = silu(causal_conv_taps(x, w))                              [B, T, C]
    y = u / sqrt(||u_g||^2 + eps)  for each head group g of ``head_dim`` channels inside
        [norm_begin, norm_end) (q and/or k), y = u elsewhere (v)

The Triton short conv alone (short_conv_triton.py) was faster in isolation but slower in the
model: as an opaque op it cut the conv off from the L2 norms that inductor had fused with it.
This op takes the norms with it. One program covers BT rows of ONE head group (its channels
padded to a power of two), so the norm's row reduction stays in registers; the conv reuses the
short conv's helpers (strided reads of the projection in place, packed sequences by position).

Backward, two kernels, recomputing from x (nothing saved but x and the weight, as the short
conv's backward does). The first takes BT rows of one head group: z (from the W taps of x it
reads once), u = silu(z), the group's norm n and y = u / n, then du = (dy - y <dy, y>) / n (the
L2 norm's backward, as deltaflow.layers.norm's) and dz = du silu'(z), written out in x's dtype
(as eager autograd rounds it), and dw's float32 partial from the same taps (one per program,
summed after the launch: deterministic, no atomics). The second is the conv's transpose,
dx[t] = sum_s w[W-1-s] dz[t+s] within t's sequence. (The first form did both in one kernel by
recomputing z at each of the W shifts dx needs: 10x its bytes floor on the H100.) No initial
conv state: decoding keeps the op-by-op path.

The switch that routes the layer here is ``deltaflow.layers.conv.TRITON_CONV_NORM`` (on since
session 17); the torch reference is :func:`reference`. Prediction: benchmarks/NOTES.md, "Issue 31,
session 15: conv + SiLU + L2 norm in one kernel".
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaflow.layers.conv import causal_conv_taps
from deltaflow.layers.norm import l2_normalize
from deltaflow.layers.short_conv_triton import DTYPES, _positions, usable

try:
    import triton
    import triton.language as tl

    # the launch grids' arithmetic without Triton's constexpr_function wrappers (µs a call)
    from deltaflow.ops.triton.common import cdiv, next_power_of_2
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = ["conv_silu_l2", "reference", "usable"]

# Launch settings (module constants so a GPU sweep can set them; read at call time). The
# channel block of the forward and of the backward's dz kernel is one head group (next power of
# two of head_dim), fixed by the norm; only the rows per program, the row tiles a dz program
# walks (BWD_TILES: dw's products summed across warps once per program, not per tile) and the
# warps are free. The H100 sweeps' fastest (session 16, calls 3-4, benchmarks/NOTES.md): the
# forward 0.094 ms at 8 x 2048 x 3072 (1.4x its bytes floor); the backward's dz kernel, 0.53 ms a
# layer in the model with one tile a program, went from 0.86 to 0.59 ms forward + backward alone
# with 8 (timed through autograd, so partly at the host's pace); dx ~0.05 ms a layer.
FWD_BT, FWD_WARPS = 16, 4
BWD_BT, BWD_WARPS, BWD_TILES = 16, 8, 8  # dz + dw partials, one head group
DX_BT, DX_BC, DX_WARPS = 32, 128, 4  # dx, the conv's transpose over dz

if triton is not None:
    # the short conv's jitted helpers exist only where Triton does (the layer imports this
    # module unconditionally, so a machine without Triton must still import it)
    from deltaflow.layers.short_conv_triton import _preactivation

    @triton.jit
    def _norm_scale(u, normed, eps):
        """Per row 1 / sqrt(sum u^2 + eps) where the group is normalized, else 1 (float32)."""
        rn = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) + eps)
        return tl.where(normed, rn, 1.0)

    @triton.jit
    def conv_silu_l2_fwd_kernel(
        x_ptr,
        w_ptr,
        pos_ptr,
        y_ptr,
        T,
        C,
        sx_b,
        sx_t,
        sx_c,
        norm_begin,
        norm_end,
        eps,
        D: tl.constexpr,
        W: tl.constexpr,
        BT: tl.constexpr,
        DP: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """y (contiguous [B, T, C]) for BT rows of head group i_g (channels i_g*D ..) of row b."""
        i_t, i_g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        r = i_t * BT + tl.arange(0, BT)
        d = tl.arange(0, DP)
        c = i_g * D + d
        cmask = (d < D) & (c < C)  # padded lanes load zeros: they add nothing to the norm
        z = _preactivation(x_ptr, w_ptr, x_ptr, pos_ptr, b, r, c, T, sx_b, sx_t, sx_c,
                           0, 0, 0, cmask, W, BT, DP, False, VARLEN)  # fmt: skip
        u = z * tl.sigmoid(z)
        normed = (i_g * D >= norm_begin) & (i_g * D < norm_end)
        y = u * _norm_scale(u, normed, eps)[:, None]
        offs = (b.to(tl.int64) * T + r[:, None]) * C + c[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=(r < T)[:, None] & cmask[None, :])

    @triton.jit
    def conv_silu_l2_dz_kernel(
        x_ptr,
        w_ptr,
        pos_ptr,
        dy_ptr,
        dz_ptr,
        dw_ptr,
        T,
        C,
        n_tiles,
        n_programs_t,
        sx_b,
        sx_t,
        sx_c,
        sdy_b,
        sdy_t,
        sdy_c,
        norm_begin,
        norm_end,
        eps,
        D: tl.constexpr,
        W: tl.constexpr,
        WP: tl.constexpr,
        BT: tl.constexpr,
        DP: tl.constexpr,
        TILES: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """dz (the gradient of the conv's output, contiguous [B, T, C]) for TILES tiles of BT rows
        of head group i_g, and this program's float32 partial of dw (``dw_ptr``:
        [B * n_programs_t, C, W]). Each row's z, u and norm are recomputed once, from the W taps
        of x it reads. dw's products accumulate per element over the tiles and are summed over
        rows once at the end (a sum across warps per tile would stall each tile)."""
        i_p, i_g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        d = tl.arange(0, DP)
        c = i_g * D + d
        cmask = (d < D) & (c < C)
        normed = (i_g * D >= norm_begin) & (i_g * D < norm_end)
        x_b = x_ptr + b.to(tl.int64) * sx_b
        w_taps = ()
        acc = ()  # acc[j]: sum over this program's tiles of dz[t] x[t - (W-1-j)], per element
        for j in tl.static_range(W):
            w_taps = w_taps + (tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32),)
            acc = acc + (tl.zeros((BT, DP), dtype=tl.float32),)
        for tile in range(0, tl.minimum(TILES, n_tiles - i_p * TILES)):  # none past the end
            t = (i_p * TILES + tile) * BT + tl.arange(0, BT)
            in_t = t < T
            if VARLEN:
                p = tl.load(pos_ptr + t, mask=in_t, other=0)
            # xs[j] = x[t - (W-1-j)] (zero before the sequence): z's taps, and dw's
            xs = ()
            z = tl.zeros((BT, DP), dtype=tl.float32)
            for j in tl.static_range(W):
                rows = t - (W - 1 - j)
                ok = in_t & (rows >= 0)
                if VARLEN:
                    ok = ok & (p >= W - 1 - j)
                offs = rows.to(tl.int64)[:, None] * sx_t + c[None, :] * sx_c
                xv = tl.load(x_b + offs, mask=ok[:, None] & cmask[None, :], other=0.0)
                xs = xs + (xv.to(tl.float32),)
                z += w_taps[j][None, :] * xs[j]
            sig = tl.sigmoid(z)
            u = z * sig
            rn = _norm_scale(u, normed, eps)
            mask = in_t[:, None] & cmask[None, :]
            dy_offs = b.to(tl.int64) * sdy_b + t.to(tl.int64)[:, None] * sdy_t
            g = tl.load(dy_ptr + dy_offs + c[None, :] * sdy_c, mask=mask, other=0.0)
            g = g.to(tl.float32)
            # L2 norm's backward, y = u rn: du = rn (dy - y <dy, y>) (rn = 1, no dot: not normed)
            y = u * rn[:, None]
            dot = tl.where(normed, tl.sum(g * y, axis=1), 0.0)
            du = rn[:, None] * (g - y * dot[:, None])
            dz = tl.where(mask, du * sig * (1.0 + z * (1.0 - sig)), 0.0)
            dz_offs = (b.to(tl.int64) * T + t.to(tl.int64)[:, None]) * C + c[None, :]
            tl.store(dz_ptr + dz_offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            acc_next = ()
            for j in tl.static_range(W):
                acc_next = acc_next + (acc[j] + dz * xs[j],)
            acc = acc_next
        taps = tl.arange(0, WP)
        dw = tl.zeros((DP, WP), dtype=tl.float32)
        for j in tl.static_range(W):
            dw += tl.where(taps[None, :] == j, tl.sum(acc[j], axis=0)[:, None], 0.0)
        part = (b.to(tl.int64) * n_programs_t + i_p) * C
        dw_offs = (part + c[:, None]) * W + taps[None, :]
        tl.store(dw_ptr + dw_offs, dw, mask=cmask[:, None] & (taps < W)[None, :])

    @triton.jit
    def conv_dx_kernel(
        dz_ptr,
        w_ptr,
        pos_ptr,
        dx_ptr,
        T,
        C,
        W: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """dx[t] = sum_s w[W-1-s] dz[t+s] over the rows t+s of t's sequence (the causal conv's
        transpose), BT rows x BC channels of batch row b; dz and dx contiguous [B, T, C]."""
        i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = i_t * BT + tl.arange(0, BT)
        c = i_c * BC + tl.arange(0, BC)
        cmask = c < C
        base = b.to(tl.int64) * T * C
        dx = tl.zeros((BT, BC), dtype=tl.float32)
        for s in tl.static_range(W):
            r = t + s
            same = r < T
            if VARLEN:  # row r is in t's sequence when it is s or more tokens into it
                same = same & (tl.load(pos_ptr + r, mask=same, other=0) >= s)
            offs = base + r.to(tl.int64)[:, None] * C + c[None, :]
            g = tl.load(dz_ptr + offs, mask=same[:, None] & cmask[None, :], other=0.0)
            w_s = tl.load(w_ptr + c * W + (W - 1 - s), mask=cmask, other=0.0).to(tl.float32)
            dx += g.to(tl.float32) * w_s[None, :]
        offs = base + t.to(tl.int64)[:, None] * C + c[None, :]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty),
                 mask=(t < T)[:, None] & cmask[None, :])  # fmt: skip


def _forward(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor | None,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float,
) -> Tensor:
    B, T, C = x.shape
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if B * T * C == 0:
        return y
    pos = _positions(cu_seqlens, T, x.device)
    sx_b, sx_t, sx_c = x.stride()
    grid = (cdiv(T, FWD_BT), cdiv(C, head_dim), B)
    conv_silu_l2_fwd_kernel[grid](  # keywords only: benchmarks/_launches.py traces launches
        x_ptr=x,
        w_ptr=weight.contiguous(),
        pos_ptr=x if pos is None else pos,  # never read without VARLEN
        y_ptr=y,
        T=T,
        C=C,
        sx_b=sx_b,
        sx_t=sx_t,
        sx_c=sx_c,
        norm_begin=norm_begin,
        norm_end=norm_end,
        eps=eps,
        D=head_dim,
        W=weight.shape[-1],
        BT=FWD_BT,
        DP=next_power_of_2(head_dim),
        VARLEN=pos is not None,
        num_warps=FWD_WARPS,
    )
    return y


def _backward(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor | None,
    grad_y: Tensor,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    B, T, C = x.shape
    W = weight.shape[-1]
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if B * T * C == 0:
        return dx, torch.zeros_like(weight)
    pos = _positions(cu_seqlens, T, x.device)
    w = weight.contiguous()
    n_tiles = cdiv(T, BWD_BT)
    n_programs_t = cdiv(n_tiles, BWD_TILES)
    partial = torch.empty(B * n_programs_t, C, W, device=x.device, dtype=torch.float32)
    dz = torch.empty(B, T, C, device=x.device, dtype=x.dtype)  # as eager autograd rounds it
    sx_b, sx_t, sx_c = x.stride()
    sdy_b, sdy_t, sdy_c = grad_y.stride()
    conv_silu_l2_dz_kernel[(n_programs_t, cdiv(C, head_dim), B)](
        x_ptr=x,
        w_ptr=w,
        pos_ptr=x if pos is None else pos,
        dy_ptr=grad_y,
        dz_ptr=dz,
        dw_ptr=partial,
        T=T,
        C=C,
        n_tiles=n_tiles,
        n_programs_t=n_programs_t,
        sx_b=sx_b,
        sx_t=sx_t,
        sx_c=sx_c,
        sdy_b=sdy_b,
        sdy_t=sdy_t,
        sdy_c=sdy_c,
        norm_begin=norm_begin,
        norm_end=norm_end,
        eps=eps,
        D=head_dim,
        W=W,
        WP=next_power_of_2(W),
        BT=BWD_BT,
        DP=next_power_of_2(head_dim),
        TILES=BWD_TILES,
        VARLEN=pos is not None,
        num_warps=BWD_WARPS,
    )
    conv_dx_kernel[(cdiv(T, DX_BT), cdiv(C, DX_BC), B)](
        dz_ptr=dz,
        w_ptr=w,
        pos_ptr=x if pos is None else pos,
        dx_ptr=dx,
        T=T,
        C=C,
        W=W,
        BT=DX_BT,
        BC=DX_BC,
        VARLEN=pos is not None,
        num_warps=DX_WARPS,
    )
    return dx, partial.sum(0).to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (fullgraph traces them through the fake implementations),
# with autograd registered. x keeps its strides (no copy); outputs are contiguous.


@torch.library.custom_op("deltaflow::conv_silu_l2_fwd", mutates_args=())
def conv_silu_l2_fwd_op(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor | None,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float,
) -> Tensor:
    return _forward(x, weight, cu_seqlens, head_dim, norm_begin, norm_end, eps)


@conv_silu_l2_fwd_op.register_fake
def _(x, weight, cu_seqlens, head_dim, norm_begin, norm_end, eps):
    return x.new_empty(x.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("deltaflow::conv_silu_l2_bwd", mutates_args=())
def conv_silu_l2_bwd_op(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor | None,
    grad_y: Tensor,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float,
) -> list[Tensor]:
    return list(_backward(x, weight, cu_seqlens, grad_y, head_dim, norm_begin, norm_end, eps))


@conv_silu_l2_bwd_op.register_fake
def _(x, weight, cu_seqlens, grad_y, head_dim, norm_begin, norm_end, eps):
    return [x.new_empty(x.shape), weight.new_empty(weight.shape)]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, cu_seqlens, head_dim, norm_begin, norm_end, eps = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)  # the backward recomputes y from x
    ctx.args = (head_dim, norm_begin, norm_end, eps)


def _conv_silu_l2_backward(ctx, grad_y):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = conv_silu_l2_bwd_op(x, weight, cu_seqlens, grad_y, *ctx.args)
    return dx, dw, None, None, None, None, None


conv_silu_l2_fwd_op.register_autograd(_conv_silu_l2_backward, setup_context=_setup_context)


def _check(x: Tensor, weight: Tensor, head_dim: int, norm_begin: int, norm_end: int) -> None:
    """One clear line for inputs the kernels cannot take."""
    if not usable(x):
        raise ValueError(
            f"conv_silu_l2: x must be a {'/'.join(str(d)[6:] for d in DTYPES)} tensor on a GPU "
            f"(or on the CPU with TRITON_INTERPRET=1) with Triton installed, got {x.dtype} on "
            f"{x.device}"
        )
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(
            f"conv_silu_l2: x must be [B, T, C] and weight [C, W >= 1], got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    C = x.shape[-1]
    aligned = norm_begin % head_dim == 0 and norm_end % head_dim == 0 if head_dim > 0 else False
    if not (aligned and 0 <= norm_begin <= norm_end <= C):
        raise ValueError(
            f"conv_silu_l2: need head_dim > 0 and 0 <= norm_begin <= norm_end <= C = {C}, both "
            f"multiples of head_dim, got head_dim={head_dim}, [{norm_begin}, {norm_end})"
        )


def conv_silu_l2(
    x: Tensor,
    weight: Tensor,
    *,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float = 1e-6,
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> Tensor:
    """``silu(causal conv(x, weight))`` over x ``[B, T, C]`` (any strides), weight ``[C, W]``,
    then each group of ``head_dim`` channels in ``[norm_begin, norm_end)`` divided by
    ``sqrt(||group||^2 + eps)`` (:func:`deltaflow.layers.norm.l2_normalize`); by the Triton
    kernels, returning a contiguous ``[B, T, C]`` in x's dtype.

    ``cu_seqlens``: checked long offsets ``[N + 1]`` of sequences packed in a ``[1, T, C]`` x;
    the conv restarts at each. ``initial_state`` is not supported (decoding keeps the
    op-by-op path): passing one raises."""
    _check(x, weight, head_dim, norm_begin, norm_end)
    if initial_state is not None:
        raise ValueError(
            "conv_silu_l2: initial_state is not supported (use short_conv_triton.short_conv "
            "and l2_normalize for a conv window)"
        )
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"conv_silu_l2: cu_seqlens needs x of batch 1, got batch {x.shape[0]}")
    return conv_silu_l2_fwd_op(x, weight, cu_seqlens, head_dim, norm_begin, norm_end, float(eps))


def reference(
    x: Tensor,
    weight: Tensor,
    *,
    head_dim: int,
    norm_begin: int,
    norm_end: int,
    eps: float = 1e-6,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The torch computation :func:`conv_silu_l2` replaces, as DeltaAttention runs it:
    :func:`causal_conv_taps` + SiLU, then :func:`l2_normalize` on the head groups of
    ``[norm_begin, norm_end)`` (fuses under ``torch.compile``)."""
    B, T, C = x.shape
    u = causal_conv_taps(x, weight, cu_seqlens)
    if norm_end == norm_begin:
        return u
    n = l2_normalize(u[..., norm_begin:norm_end].reshape(B, T, -1, head_dim), eps)
    return torch.cat([u[..., :norm_begin], n.reshape(B, T, -1), u[..., norm_end:]], dim=-1)
