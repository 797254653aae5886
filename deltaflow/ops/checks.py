"""Argument checks shared by every backend: clear errors, never silent broadcasting."""

from __future__ import annotations

import torch
from torch import Tensor

from deltaflow.rules import RULES, StepRule

BACKENDS = ("auto", "reference", "torch", "triton")  # the op's backends, written once


def check_chunk_size(chunk_size: object) -> None:
    """The op's rule for ``chunk_size``: None or a positive power of two. The layer and the
    model config call this at construction, so a bad value fails early with the op's words."""
    if chunk_size is not None and (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or chunk_size <= 0
        or (chunk_size & (chunk_size - 1))
    ):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size!r}")


def check_backend(backend: object) -> None:
    """The op's rule for ``backend``: one of :data:`BACKENDS` (the layer and the config call
    it too)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t: object, rank: int, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} (rank {rank}), got {_shape(t)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def _values_checkable(t: Tensor, check_values: bool) -> bool:
    """Value checks (beta finite and >= 0, log_decay finite and <= 0, cu_seqlens offsets) read
    the tensor on the host: on a GPU one synchronization per checked tensor. They run unless
    the caller says its inputs satisfy them (``check_values=False``) or a sync is not allowed
    (compiling, CUDA-graph capture)."""
    if not check_values or torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _raise_not_finite(name: str, t: Tensor, hint: str = "") -> None:
    """Raise if ``t`` holds NaN or ±inf, saying how many and where the first one is."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        n_nan, n_inf = int(t.isnan().sum()), int(t.isinf().sum())
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be finite, got {n_nan} NaN and {n_inf} inf values (first at index "
            f"{list(first)} of shape {_shape(t)}){hint}"
        )


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    rule: StepRule,
    log_decay: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    chunk_size: int | None,
    backend: str,
    eps: float,
    check_values: bool = True,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the argument for any malformed input."""
    _check_tensor("q", q, 4, "[B, T, H, Dk]")
    _check_tensor("k", k, 4, "[B, T, H, Dk]")
    _check_tensor("v", v, 4, "[B, T, H, Dv]")
    B, T, H, Dk = q.shape
    if k.shape != q.shape:
        what = "Dk" if k.shape[:3] == q.shape[:3] else "shape"
        raise ValueError(
            f"k must have the same shape as q {_shape(q)} ({what} mismatch), got {_shape(k)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must have shape [B, T, H, Dv] = [{B}, {T}, {H}, Dv] matching q, got {_shape(v)}"
        )
    if Dk == 0 or v.shape[3] == 0 or H == 0:
        raise ValueError(f"head dimensions must be positive, got q {_shape(q)} and v {_shape(v)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")

    if beta is None:
        if rule.needs_beta:
            raise ValueError(
                f"beta is None but rule {rule.name!r} needs beta of shape "
                f"[B, T, H] = [{B}, {T}, {H}]; only rules without a gate "
                f"({', '.join(repr(n) for n, r in RULES.items() if not r.needs_beta)}) accept "
                "beta=None"
            )
    else:
        _check_tensor("beta", beta, 3, f"[B, T, H] = [{B}, {T}, {H}]")
        if beta.shape != q.shape[:3]:
            raise ValueError(
                f"beta must have shape [B, T, H] = [{B}, {T}, {H}], got {_shape(beta)}"
            )
        # one host sync on the happy path; `beta >= 0` alone would let NaN (and +inf) through
        if _values_checkable(beta, check_values) and not bool(
            (torch.isfinite(beta) & (beta >= 0)).all()
        ):
            _raise_not_finite("beta", beta)
            raise ValueError(f"beta must be >= 0 (a step size), got min {beta.min().item():.4g}")

    rule.check_decay(log_decay is not None, "give log_decay")  # as the layer does
    if log_decay is not None:
        _check_tensor("log_decay", log_decay, 3, f"[B, T, H] = [{B}, {T}, {H}]")
        if log_decay.shape != q.shape[:3]:
            raise ValueError(
                f"log_decay must have shape [B, T, H] = [{B}, {T}, {H}], got {_shape(log_decay)}"
            )
        if _values_checkable(log_decay, check_values) and not bool(
            (torch.isfinite(log_decay) & (log_decay <= 0)).all()
        ):
            _raise_not_finite(
                "log_decay", log_decay, " (a full reset is a large negative value such as -30)"
            )
            raise ValueError(
                "log_decay must be <= 0 (decay alpha = exp(log_decay) in (0, 1]), "
                f"got max {log_decay.max().item():.4g}"
            )

    n_states = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of offsets")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (sequences packed along T), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must hold at least 2 offsets [0, ..., T]")
        if _values_checkable(cu_seqlens, check_values):
            offsets = cu_seqlens.tolist()
            if offsets[0] != 0:
                raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
            if any(b < a for a, b in zip(offsets, offsets[1:])):
                raise ValueError("cu_seqlens must be non-decreasing")
            if offsets[-1] != T:
                raise ValueError(f"cu_seqlens must end at T={T}, got {offsets[-1]}")
        n_states = cu_seqlens.numel() - 1

    if initial_state is not None:
        Dv = v.shape[3]
        lead = "N" if cu_seqlens is not None else "B"
        layout = f"[{lead}, H, Dk, Dv] = [{n_states}, {H}, {Dk}, {Dv}]"
        _check_tensor("initial_state", initial_state, 4, layout)
        if tuple(initial_state.shape) != (n_states, H, Dk, Dv):
            raise ValueError(f"initial_state must have shape {layout}, got {_shape(initial_state)}")

    check_chunk_size(chunk_size)
    check_backend(backend)
    if not eps > 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")
    if not isinstance(check_values, bool):  # None or 0 must not turn the checks off unseen
        raise TypeError(f"check_values must be True or False, got {check_values!r}")


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (exact checks), else float32 (the state's dtype)."""
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )
