"""The causal depthwise short convolution (+ SiLU) as two Triton kernels behind ``torch.library``
custom ops (issue 31 item 4): what :func:`deltaflow.layers.conv.causal_conv_taps` computes,

    y[b, t, c] = act(sum_j w[c, j] * x[b, t - (W-1-j), c])   (zeros before each sequence),

reading x in place through its strides (the layer passes the q|k|v columns of the fused
projection's output, a view with row stride > C: no ``.contiguous()`` copy), with packed
sequences (``cu_seqlens``: a tap never reaches into the previous sequence) or an initial conv
window (``initial_state`` [B, C, W-1], the previous W-1 inputs oldest first, as
:class:`~deltaflow.layers.conv.ShortConvolution` keeps it for decoding).

Forward: one launch, one program per (BT rows, BC channels, batch row); each of the W taps is a
shifted load of the same tile (served by L1/L2: x is read from HBM about once), accumulated in
float32. Backward: one launch that recomputes the pre-activation z instead of storing it. For
the rows t of its tile it needs dz at t, t+1, ..., t+W-1 (dx[t] = sum_j w_j dz[t + W-1-j]), so
it recomputes z at each of those W shifts from the 2W-1 shifted tiles of x it covers (rows
t-(W-1) .. t+W-1, each loaded once; all but the first from L1/L2), and sums
dz[t] * x[t - back] over its rows into one float32 partial of dw per program (summed after
the launch by one torch ``sum``: deterministic, no atomics). With an initial state the grid has one
more row tile, rows [-BT, 0), whose "dx" is the state's gradient.

The torch reference is :func:`deltaflow.layers.conv.causal_conv_taps`; the switch that routes the
layer here is ``deltaflow.layers.conv.TRITON_SHORT_CONV``. Design and prediction:
benchmarks/NOTES.md, "Issue 31 item 4, session 14".
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from deltaflow.layers.mask import position_in_sequence

try:
    import triton
    import triton.language as tl

    # the launch grids' arithmetic without Triton's constexpr_function wrappers (µs a call)
    from deltaflow.ops.triton.common import cdiv, next_power_of_2
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

# Launch settings (module constants so a GPU sweep can set them; read at call time): the fastest
# of `benchmarks/short_conv.py time --sweep` on an H100 at 8 x 2048 x 3072 of 4112, bf16
# (benchmarks/results/issue31/s15call2/short_conv.log): forward 0.093 ms (2.2x its bytes floor;
# session 14's 32 x 128 x 8 warps: 0.146), forward + backward 0.71 ms (4.2x; was 1.41 ms).
FWD_BT, FWD_BC, FWD_WARPS = 16, 128, 4
BWD_BT, BWD_BC, BWD_WARPS = 32, 32, 4
# Row tiles per backward program: each program writes one float32 [BC, W] partial of dw, so
# more tiles per program means a smaller partial buffer (B * T / (BWD_BT * BWD_TILES) rows).
BWD_TILES = 1
# Input dtypes the kernels take (float64 stays on the torch reference).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# triton.jit reads TRITON_INTERPRET when it decorates a kernel, so whether this module's (and
# conv_norm_triton's) kernels are interpreted is fixed at import: a script that sets the variable
# later (benchmarks' smoke modes) still has compiled kernels, which cannot run on the CPU.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRETED


def usable(x: Tensor) -> bool:
    """The kernels can run on ``x``: Triton is importable, x is on a GPU (or on the CPU with the
    interpreter switched on) and has one of :data:`DTYPES`."""
    if triton is None or x.dtype not in DTYPES:
        return False
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


if triton is not None:

    @triton.jit
    def _tap(
        x_ptr,
        s_ptr,
        pos_ptr,
        b,
        r,
        c,
        back,
        T,
        sx_b,
        sx_t,
        sx_c,
        ss_b,
        ss_c,
        ss_w,
        cmask,
        W: tl.constexpr,
        HAS_STATE: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """x[b, r - back, c] in float32 for rows r (zeros for r outside [0, T), and before the
        sequence start unless an initial state supplies the W-1 inputs before t = 0)."""
        in_t = (r >= 0) & (r < T)
        if VARLEN:
            p = tl.load(pos_ptr + r, mask=in_t, other=0)
        else:
            p = r
        ok = (in_t & (p >= back))[:, None] & cmask[None, :]
        src = (r - back).to(tl.int64)
        offs = b.to(tl.int64) * sx_b + src[:, None] * sx_t + c[None, :] * sx_c
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_STATE:  # r - back in [-(W-1), 0): the window's slot W-1 + r - back
            from_state = (in_t & (p < back))[:, None] & cmask[None, :]
            slot = (W - 1 + r - back).to(tl.int64)
            s_offs = b.to(tl.int64) * ss_b + c[None, :] * ss_c + slot[:, None] * ss_w
            xv += tl.load(s_ptr + s_offs, mask=from_state, other=0.0).to(tl.float32)
        return xv

    @triton.jit
    def _rows(
        x_ptr,
        s_ptr,
        b,
        rows,
        c,
        T,
        sx_b,
        sx_t,
        sx_c,
        ss_b,
        ss_c,
        ss_w,
        cmask,
        W: tl.constexpr,
        HAS_STATE: tl.constexpr,
    ):
        """x[b, rows, c] in float32, rows in [-(W-1), T) read from the initial window when
        negative (HAS_STATE), zeros elsewhere; no sequence masks (the caller's)."""
        ok = ((rows >= 0) & (rows < T))[:, None] & cmask[None, :]
        offs = b.to(tl.int64) * sx_b + rows.to(tl.int64)[:, None] * sx_t + c[None, :] * sx_c
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_STATE:
            slot = (W - 1 + rows).to(tl.int64)
            from_state = ((rows < 0) & (slot >= 0))[:, None] & cmask[None, :]
            s_offs = b.to(tl.int64) * ss_b + c[None, :] * ss_c + slot[:, None] * ss_w
            xv += tl.load(s_ptr + s_offs, mask=from_state, other=0.0).to(tl.float32)
        return xv

    @triton.jit
    def _preactivation(
        x_ptr,
        w_ptr,
        s_ptr,
        pos_ptr,
        b,
        r,
        c,
        T,
        sx_b,
        sx_t,
        sx_c,
        ss_b,
        ss_c,
        ss_w,
        cmask,
        W: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        HAS_STATE: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """z[b, r, c] = sum_j w[c, j] x[b, r - (W-1-j), c] in float32."""
        z = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(W):
            w_j = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
            xv = _tap(x_ptr, s_ptr, pos_ptr, b, r, c, W - 1 - j, T, sx_b, sx_t, sx_c,
                      ss_b, ss_c, ss_w, cmask, W, HAS_STATE, VARLEN)  # fmt: skip
            z += w_j[None, :] * xv
        return z

    @triton.jit
    def short_conv_fwd_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        pos_ptr,
        y_ptr,
        T,
        C,
        sx_b,
        sx_t,
        sx_c,
        ss_b,
        ss_c,
        ss_w,
        W: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        SILU: tl.constexpr,
        HAS_STATE: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """y = act(z) for BT rows x BC channels of batch row b; y is contiguous [B, T, C]."""
        i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        r = i_t * BT + tl.arange(0, BT)
        c = i_c * BC + tl.arange(0, BC)
        cmask = c < C
        z = _preactivation(x_ptr, w_ptr, s_ptr, pos_ptr, b, r, c, T, sx_b, sx_t, sx_c,
                           ss_b, ss_c, ss_w, cmask, W, BT, BC, HAS_STATE, VARLEN)  # fmt: skip
        if SILU:
            z = z * tl.sigmoid(z)
        offs = (b.to(tl.int64) * T + r[:, None]) * C + c[None, :]
        tl.store(y_ptr + offs, z.to(y_ptr.dtype.element_ty), mask=(r < T)[:, None] & cmask[None, :])

    @triton.jit
    def short_conv_bwd_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        pos_ptr,
        dy_ptr,
        dx_ptr,
        ds_ptr,
        dw_ptr,
        T,
        C,
        n_tiles,
        n_programs_t,
        sx_b,
        sx_t,
        sx_c,
        ss_b,
        ss_c,
        ss_w,
        sdy_b,
        sdy_t,
        sdy_c,
        W: tl.constexpr,
        WP: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        TILES: tl.constexpr,
        SILU: tl.constexpr,
        HAS_STATE: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        """dx (contiguous [B, T, C]), the state's gradient (contiguous [B, C, W-1], from the
        extra first tile of rows [-BT, 0) when HAS_STATE) and one float32 partial of dw per
        program (``dw_ptr``: [B * n_programs_t, C, W]). Program i_p takes the n_tiles row tiles
        TILES at a time."""
        i_p, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        c = i_c * BC + tl.arange(0, BC)
        cmask = c < C
        taps = tl.arange(0, WP)
        dw = tl.zeros((BC, WP), dtype=tl.float32)
        for tile in range(0, tl.minimum(TILES, n_tiles - i_p * TILES)):  # none past the end
            t = ((i_p * TILES + tile) - HAS_STATE) * BT + tl.arange(0, BT)
            # x at rows t-(W-1) .. t+W-1, each of these 2W-1 shifts loaded once: xs[i] is row
            # t + i - (W-1), so z at row t+s takes tap j from xs[s + j].
            xs = ()
            for i in tl.static_range(2 * W - 1):
                xs = xs + (_rows(x_ptr, s_ptr, b, t + i - (W - 1), c, T, sx_b, sx_t, sx_c,
                                 ss_b, ss_c, ss_w, cmask, W, HAS_STATE),)  # fmt: skip
            dx = tl.zeros((BT, BC), dtype=tl.float32)
            for s in tl.static_range(W):  # dz at rows t + s feeds dx[t] through tap W-1-s
                r = t + s
                in_t = (r >= 0) & (r < T)
                if VARLEN:  # a tap reaching before r's sequence start reads zero
                    p = tl.load(pos_ptr + r, mask=in_t, other=0)
                z = tl.zeros((BT, BC), dtype=tl.float32)
                for j in tl.static_range(W):
                    w_j = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
                    xv = xs[s + j]
                    if VARLEN:
                        xv = tl.where((p >= W - 1 - j)[:, None], xv, 0.0)
                    z += w_j[None, :] * xv
                dy_offs = b.to(tl.int64) * sdy_b + r.to(tl.int64)[:, None] * sdy_t
                dy_offs += c[None, :] * sdy_c
                dz_mask = in_t[:, None] & cmask[None, :]
                dz = tl.load(dy_ptr + dy_offs, mask=dz_mask, other=0.0).to(tl.float32)
                if SILU:
                    sig = tl.sigmoid(z)
                    dz = dz * sig * (1.0 + z * (1.0 - sig))
                dz = tl.where(dz_mask, dz, 0.0)  # rows past T: z there is never needed
                if s == 0:  # dw[c, j] += sum over this tile's rows of dz[t] x[t - (W-1-j)]
                    for j in tl.static_range(W):
                        xv = xs[j]
                        if VARLEN:
                            xv = tl.where((p >= W - 1 - j)[:, None], xv, 0.0)
                        col = tl.sum(dz * xv, axis=0)
                        dw += tl.where(taps[None, :] == j, col[:, None], 0.0)
                # Row r belongs to t's sequence when it is s or more tokens into it (packed) or
                # always (one sequence per batch row; rows t < 0 are the initial state's).
                if VARLEN:
                    same = in_t & (p >= s)
                else:
                    same = in_t
                w_s = tl.load(w_ptr + c * W + (W - 1 - s), mask=cmask, other=0.0).to(tl.float32)
                dx += tl.where(same[:, None], dz, 0.0) * w_s[None, :]
            out_mask = cmask[None, :] & (t < T)[:, None]
            dx_offs = (b.to(tl.int64) * T + t.to(tl.int64)[:, None]) * C + c[None, :]
            dx_mask = out_mask & (t >= 0)[:, None]
            tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
            if HAS_STATE:  # rows -(W-1) .. -1 are the window's slots 0 .. W-2
                slot = (t + W - 1).to(tl.int64)
                ds_offs = (b.to(tl.int64) * C + c[None, :]) * (W - 1) + slot[:, None]
                ds_mask = cmask[None, :] & ((t < 0) & (slot >= 0))[:, None]
                tl.store(ds_ptr + ds_offs, dx.to(ds_ptr.dtype.element_ty), mask=ds_mask)
        part = (b.to(tl.int64) * n_programs_t + i_p) * C
        dw_offs = (part + c[:, None]) * W + taps[None, :]
        tl.store(dw_ptr + dw_offs, dw, mask=cmask[:, None] & (taps < W)[None, :])


def _positions(cu_seqlens: Tensor | None, T: int, device: torch.device) -> Tensor | None:
    """Each packed token's position in its sequence (int32 [T]), or None without packing."""
    if cu_seqlens is None:
        return None
    return position_in_sequence(cu_seqlens.to(device), T)[1].to(torch.int32)


def _state_strides(state: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if state is None else tuple(state.stride())  # type: ignore[return-value]


def _forward(
    x: Tensor, weight: Tensor, state: Tensor | None, cu_seqlens: Tensor | None, silu: bool
) -> Tensor:
    B, T, C = x.shape
    W = weight.shape[-1]
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    if B * T * C == 0:
        return y
    w = weight.contiguous()
    pos = _positions(cu_seqlens, T, x.device)
    grid = (cdiv(T, FWD_BT), cdiv(C, FWD_BC), B)
    sx_b, sx_t, sx_c = x.stride()
    ss_b, ss_c, ss_w = _state_strides(state)
    short_conv_fwd_kernel[grid](  # keywords only: benchmarks/_launches.py traces launches
        x_ptr=x,
        w_ptr=w,
        s_ptr=x if state is None else state,  # never read without HAS_STATE
        pos_ptr=x if pos is None else pos,  # never read without VARLEN
        y_ptr=y,
        T=T,
        C=C,
        sx_b=sx_b,
        sx_t=sx_t,
        sx_c=sx_c,
        ss_b=ss_b,
        ss_c=ss_c,
        ss_w=ss_w,
        W=W,
        BT=FWD_BT,
        BC=FWD_BC,
        SILU=silu,
        HAS_STATE=state is not None,
        VARLEN=pos is not None,
        num_warps=FWD_WARPS,
    )
    return y


def _backward(
    x: Tensor,
    weight: Tensor,
    state: Tensor | None,
    cu_seqlens: Tensor | None,
    grad_y: Tensor,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    B, T, C = x.shape
    W = weight.shape[-1]
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    ds = None if state is None else torch.empty(B, C, W - 1, device=x.device, dtype=state.dtype)
    if B * T * C == 0:
        dw = torch.zeros_like(weight)
        if ds is not None:  # T = 0: no output reads the window
            ds.zero_()
        return dx, dw, ds
    w = weight.contiguous()
    pos = _positions(cu_seqlens, T, x.device)
    tiles = cdiv(T, BWD_BT) + (state is not None)
    n_programs_t = cdiv(tiles, BWD_TILES)
    partial = torch.empty(B * n_programs_t, C, W, device=x.device, dtype=torch.float32)
    sx_b, sx_t, sx_c = x.stride()
    ss_b, ss_c, ss_w = _state_strides(state)
    sdy_b, sdy_t, sdy_c = grad_y.stride()
    short_conv_bwd_kernel[(n_programs_t, cdiv(C, BWD_BC), B)](
        x_ptr=x,
        w_ptr=w,
        s_ptr=x if state is None else state,
        pos_ptr=x if pos is None else pos,
        dy_ptr=grad_y,
        dx_ptr=dx,
        ds_ptr=dx if ds is None else ds,  # never written without HAS_STATE
        dw_ptr=partial,
        T=T,
        C=C,
        n_tiles=tiles,
        n_programs_t=n_programs_t,
        sx_b=sx_b,
        sx_t=sx_t,
        sx_c=sx_c,
        ss_b=ss_b,
        ss_c=ss_c,
        ss_w=ss_w,
        sdy_b=sdy_b,
        sdy_t=sdy_t,
        sdy_c=sdy_c,
        W=W,
        WP=next_power_of_2(W),
        BT=BWD_BT,
        BC=BWD_BC,
        TILES=BWD_TILES,
        SILU=silu,
        HAS_STATE=state is not None,
        VARLEN=pos is not None,
        num_warps=BWD_WARPS,
    )
    return dx, partial.sum(0).to(weight.dtype), ds


# ---------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (fullgraph traces them through the fake implementations),
# with autograd registered. The input x keeps its strides (no copy); outputs are contiguous.


@torch.library.custom_op("deltaflow::short_conv_fwd", mutates_args=())
def short_conv_fwd_op(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    silu: bool,
) -> Tensor:
    return _forward(x, weight, initial_state, cu_seqlens, silu)


@short_conv_fwd_op.register_fake
def _(x, weight, initial_state, cu_seqlens, silu):
    return x.new_empty(x.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("deltaflow::short_conv_bwd", mutates_args=())
def short_conv_bwd_op(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    grad_y: Tensor,
    silu: bool,
) -> list[Tensor]:
    dx, dw, ds = _backward(x, weight, initial_state, cu_seqlens, grad_y, silu)
    return [dx, dw, x.new_empty(0) if ds is None else ds]


@short_conv_bwd_op.register_fake
def _(x, weight, initial_state, cu_seqlens, grad_y, silu):
    ds = x.new_empty(0) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return [x.new_empty(x.shape), weight.new_empty(weight.shape), ds]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, initial_state, cu_seqlens, silu = inputs
    ctx.save_for_backward(x, weight, initial_state, cu_seqlens)
    ctx.silu = silu


def _short_conv_backward(ctx, grad_y):
    x, weight, initial_state, cu_seqlens = ctx.saved_tensors
    dx, dw, ds = short_conv_bwd_op(x, weight, initial_state, cu_seqlens, grad_y, ctx.silu)
    return dx, dw, (ds if initial_state is not None else None), None, None


short_conv_fwd_op.register_autograd(_short_conv_backward, setup_context=_setup_context)


def short_conv(
    x: Tensor,
    weight: Tensor,
    *,
    activation: str | None = "silu",
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """``act(sum_j weight[:, j] x_{t-W+1+j})`` over x ``[B, T, C]`` (any strides) with weight
    ``[C, W]``, by the Triton kernels; returns a contiguous ``[B, T, C]`` in x's dtype.

    ``initial_state``: ``[B, C, W-1]``, the W-1 inputs before x (oldest first) instead of zeros.
    ``cu_seqlens``: long offsets ``[N + 1]`` of sequences packed in a ``[1, T, C]`` x, already
    checked (``prepare_cu_seqlens``); the conv restarts at each. Same numbers as
    :func:`deltaflow.layers.conv.causal_conv_taps` (float32 taps)."""
    if not usable(x):
        raise ValueError(
            f"short_conv: x must be a {'/'.join(str(d)[6:] for d in DTYPES)} tensor on a GPU "
            f"(or on the CPU with TRITON_INTERPRET=1) with Triton installed, got {x.dtype} on "
            f"{x.device}"
        )
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(
            f"short_conv: x must be [B, T, C] and weight [C, W >= 1], got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if activation not in (None, "silu"):
        raise ValueError(f"short_conv: activation must be 'silu' or None, got {activation!r}")
    B, _, C = x.shape
    W = weight.shape[1]
    if initial_state is not None and initial_state.shape != (B, C, W - 1):
        raise ValueError(
            f"short_conv: initial_state must be [{B}, {C}, {W - 1}], got "
            f"{tuple(initial_state.shape)}"
        )
    if cu_seqlens is not None and (B != 1 or initial_state is not None):
        raise ValueError(
            f"short_conv: cu_seqlens needs x of batch 1 and no initial_state, got batch {B}"
            f"{' and an initial_state' if initial_state is not None else ''}"
        )
    return short_conv_fwd_op(x, weight, initial_state, cu_seqlens, activation == "silu")
