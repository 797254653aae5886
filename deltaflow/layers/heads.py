"""Head-size bookkeeping shared by the token mixers."""

from __future__ import annotations


def resolve_head_dim(hidden_size: int, num_heads: int, head_dim: int | None) -> int:
    """The per-head key dimension: ``head_dim`` if given, else ``hidden_size // num_heads``."""
    if hidden_size <= 0 or num_heads <= 0:
        raise ValueError(
            f"hidden_size and num_heads must be positive, got {hidden_size}, {num_heads}"
        )
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) "
                "when head_dim is not given"
            )
        head_dim = hidden_size // num_heads
    return head_dim
