"""DeltaAttention: the token mixer of DeltaNet, Gated DeltaNet, EFLA, Longhorn, Kaczmarz, ...

One layer for every step rule (docs/design.md §4):

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))
    q, k    = L2-normalized where the rule asks (per-rule defaults below)
    β       = sigmoid(W_β x)  or softplus(W_β x)                   (rules that use β)
    log α   = −exp(A_log) · softplus(W_a x + dt_bias)             (use_decay, Mamba2 style)
    o       = delta_rule(q, k, v, β, rule, log α)
    y       = W_o(RMSNorm(o) ⊙ SiLU(W_g x))       (per head; without the gate: W_o RMSNorm(o))

With the defaults and ``rule='delta', use_decay=True`` this is the Gated DeltaNet layer
(arXiv 2412.06464); Gated DeltaNet 1.3B uses ``num_heads=6, head_dim=256, expand_v=2``.

Three modes give the same outputs: full sequences (chunked op), padded batches (padding is
turned into identity steps: k = v = β = 0 and log α = 0, and the conv sees zeros; padded
positions are selected away, never multiplied by 0, so a nan there cannot reach real tokens), and
incremental decoding with a state dict holding the recurrent state and conv windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaflow.layers import conv, conv_norm_triton
from deltaflow.layers.conv import ShortConvolution, causal_conv_silu
from deltaflow.layers.heads import resolve_head_dim
from deltaflow.layers.mask import padding_as_identity_steps, prepare_mixer_inputs, zero_padding
from deltaflow.layers.norm import RMSNorm, l2_normalize
from deltaflow.ops import delta_rule, delta_rule_step
from deltaflow.ops.checks import check_backend, check_chunk_size
from deltaflow.rules import QK_NORMS, StepRule, get_rule

BETA_ACTIVATIONS = ("sigmoid", "softplus")


def default_qk_norm(rule: str | StepRule) -> tuple[str, str]:
    """Per-rule default (q_norm, k_norm): what the rule declares (``StepRule.qk_norm``)."""
    return get_rule(rule).qk_norm


def resolve_qk_norm(
    rule: str | StepRule, qk_norm: str | tuple[str, str] | list[str] | None
) -> tuple[str, str]:
    """``None`` -> the rule's default; a string applies to both q and k; a pair is (q, k)."""
    if qk_norm is None:
        return default_qk_norm(rule)
    pair = (qk_norm, qk_norm) if isinstance(qk_norm, str) else tuple(qk_norm)
    if len(pair) != 2 or any(p not in QK_NORMS for p in pair):
        raise ValueError(
            f"qk_norm must be None, one of {QK_NORMS} or a (q_norm, k_norm) pair of them, "
            f"got {qk_norm!r}"
        )
    return pair  # type: ignore[return-value]


def keep_for_backward(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each tensor through ``torch.alias_copy``: an identity (its gradient passes straight
    through) that nothing else in a block calls, so the selective-checkpointing policy
    (``deltaflow.models.block._saved_ops``) can name it to keep exactly these tensors for the
    backward (issue 31: the op's inputs, instead of recomputing the short conv, SiLU and L2
    norms before the op's backward). Compiled, inductor lowers it to a copy that fuses into the
    kernel producing the tensor, so the forward writes no extra bytes; eager, it is a real copy
    (the marker is only set on compiled blocks)."""
    return tuple(None if t is None else torch.alias_copy(t) for t in tensors)


class DeltaAttention(nn.Module):
    """Delta-rule token mixer with a pluggable step rule.

    Args:
        hidden_size: model width (input and output features).
        num_heads: number of q/k heads.
        head_dim: key dim per head; default ``hidden_size // num_heads`` (must divide then).
        expand_v: value head dim = ``head_dim * expand_v`` (must be an integer).
        head_v_dim: explicit value head dim, overrides ``expand_v``.
        num_v_heads: value heads (grouped value attention, Gated DeltaNet style): a multiple of
            ``num_heads``; each q/k head is shared by ``num_v_heads // num_heads`` value heads.
        rule: step rule name (see ``deltaflow.rules.RULES``).
        use_decay: Mamba2-style data-dependent decay α (the "gated" variants).
        negative_eigenvalues: double the step, eigenvalue μ -> 2μ − 1 (arXiv 2411.12537).
        beta_activation: 'sigmoid' (β in (0, 1)) or 'softplus' (unbounded β).
        qk_norm: None (rule default), 'l2' | 'none', or a (q_norm, k_norm) pair.
        use_short_conv, conv_size: causal depthwise conv (SiLU) on q, k, v.
        use_output_gate: ``RMSNorm(o) ⊙ SiLU(W_g x)`` before the output projection.
        norm_eps: RMSNorm epsilon. eps: Kaczmarz regularizer ``1/(λ + eps)``.
        chunk_size, backend: forwarded to :func:`deltaflow.delta_rule` (``chunk_size=None``
            lets the op choose: 32 on CPU, the Triton kernels' 64 on GPU).
        layer_idx: index in a model (only used in messages).
        fused_projections: compute all input projections as one GEMM and the q/k/v short
            convolutions as one tap-sum over their concatenated channels (same parameters,
            same math; fuses under ``torch.compile``). ``None``: on CUDA inputs only, so the
            CPU path stays the op-by-op one.
    """

    # Set by deltaflow.parallel.enable_context_parallel: the layer then runs on one segment of
    # each sequence (conv halos and recurrent state exchanged with the other ranks).
    context_parallel = None
    # Set by DeltaFlowBlock.selective_checkpointing ('mixer_inputs'): the op's inputs go through
    # keep_for_backward, which the block's checkpointing policy saves.
    keep_op_inputs: bool = False

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        head_dim: int | None = None,
        expand_v: float = 1.0,
        head_v_dim: int | None = None,
        num_v_heads: int | None = None,
        rule: str = "delta",
        use_decay: bool = False,
        negative_eigenvalues: bool = False,
        beta_activation: str = "sigmoid",
        qk_norm: str | tuple[str, str] | None = None,
        use_short_conv: bool = True,
        conv_size: int = 4,
        use_output_gate: bool = True,
        norm_eps: float = 1e-5,
        eps: float = 1e-6,
        chunk_size: int | None = None,
        backend: str = "auto",
        layer_idx: int | None = None,
        fused_projections: bool | None = None,
    ) -> None:
        super().__init__()
        head_dim = resolve_head_dim(hidden_size, num_heads, head_dim)
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        if head_v_dim is None:
            if expand_v <= 0 or not float(head_dim * expand_v).is_integer():
                raise ValueError(
                    f"head_dim * expand_v must be a positive integer, got {head_dim} * {expand_v}"
                )
            head_v_dim = int(head_dim * expand_v)
        if head_v_dim <= 0:
            raise ValueError(f"head_v_dim must be positive, got {head_v_dim}")
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads <= 0 or num_v_heads % num_heads != 0:
            raise ValueError(
                f"num_v_heads ({num_v_heads}) must be a positive multiple of "
                f"num_heads ({num_heads})"
            )
        self.step_rule = get_rule(rule)  # raises ValueError naming the known rules
        self.step_rule.check_decay(use_decay, "set use_decay=True")  # as the op does
        if beta_activation not in BETA_ACTIVATIONS:
            raise ValueError(
                f"beta_activation must be one of {BETA_ACTIVATIONS}, got {beta_activation!r}"
            )
        if use_short_conv and conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        for name, value in (("norm_eps", norm_eps), ("eps", eps)):
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        check_chunk_size(chunk_size)  # the op's checks, at construction
        check_backend(backend)

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * head_v_dim
        self.rule = self.step_rule.name
        self.use_beta = self.step_rule.needs_beta
        self.use_decay = use_decay
        self.negative_eigenvalues = negative_eigenvalues
        self.beta_activation = beta_activation
        self.q_norm, self.k_norm = resolve_qk_norm(self.step_rule, qk_norm)
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_output_gate = use_output_gate
        self.eps = eps
        self.chunk_size = chunk_size
        self.backend = backend
        self.layer_idx = layer_idx
        self.fused_projections = fused_projections

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if self.use_beta:
            self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        if use_decay:
            self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(num_v_heads))
            self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
            # Optimizers should not weight-decay these (read by the training harness).
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv = ShortConvolution(self.key_dim, conv_size, activation="silu")
            self.k_conv = ShortConvolution(self.key_dim, conv_size, activation="silu")
            self.v_conv = ShortConvolution(self.value_dim, conv_size, activation="silu")
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = RMSNorm(head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.reset_decay_parameters()

    @torch.no_grad()
    def reset_decay_parameters(self, generator: torch.Generator | None = None) -> None:
        """Mamba2 init: A ~ U(0, 16) (A_log = log A), dt log-uniform in [1e-3, 0.1],
        dt_bias = softplus⁻¹(dt) so that softplus(dt_bias) = dt at W_a x = 0."""
        if not self.use_decay:
            return
        for p, value in zip((self.A_log, self.dt_bias), self._decay_init_values(generator)):
            if not getattr(p, "_is_hf_initialized", False):  # don't overwrite loaded weights
                p.copy_(value)

    def _decay_init_values(
        self, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_v_heads
        A = torch.empty(n, dtype=torch.float32).uniform_(0, 16, generator=generator)
        A_log = torch.log(A.clamp_min(1e-4))  # guard log(0) for an exact-zero draw
        dt_min, dt_max = 1e-3, 0.1
        u = torch.rand(n, dtype=torch.float32, generator=generator)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        return A_log, dt_bias

    def _active_context_parallel(self):
        """The :class:`deltaflow.parallel.ContextParallel` this layer runs under, or None."""
        cp = self.context_parallel
        return cp if cp is not None and cp.enabled else None

    def _fused_inputs(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """q, k, v (after conv + SiLU), W_g x, and the β and decay logits from ONE GEMM over
        the concatenated weights (one read of x instead of six, one launch forward and two
        backward) and ONE short conv over the q|k|v channels. Parameters stay separate, so
        checkpoints are unchanged; the concatenation copies ~2·hidden² numbers per step.

        The last element says whether q and k are already L2-normalized where the rule asks
        (``conv.TRITON_CONV_NORM``: one Triton op for conv, SiLU and the norms)."""
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        if self.use_output_gate:
            weights.append(self.g_proj.weight)
        if self.use_beta:
            weights.append(self.b_proj.weight)
        if self.use_decay:
            weights.append(self.a_proj.weight)
        normalized = False
        out = F.linear(x, torch.cat(weights))  # [B, T, 2·Dk·H + Dv·Hv (+ Dv·Hv + 2 Hv)]
        qkv_dim = 2 * self.key_dim + self.value_dim
        head = out[..., :qkv_dim]  # q|k|v lead the output: convolve them as one tensor
        if self.use_short_conv:
            w = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])[:, 0]
            cp = self._active_context_parallel()
            if cp is None and self._conv_norm_kernel(head):
                begin, end = self._l2_channels()
                head = conv_norm_triton.conv_silu_l2(
                    head, w, head_dim=self.head_dim, norm_begin=begin, norm_end=end,
                    cu_seqlens=cu_seqlens,
                )  # fmt: skip
                normalized = True
            elif cp is None:
                head = causal_conv_silu(head, w, cu_seqlens)
            else:
                head = cp.conv_silu(head, w)
        else:
            head = F.silu(head)
        q, k, v = head.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rest = list(out[..., qkv_dim:].split([w.shape[0] for w in weights[3:]], dim=-1))
        g = rest.pop(0) if self.use_output_gate else None
        b_logits = rest.pop(0) if self.use_beta else None
        a_logits = rest.pop(0) if self.use_decay else None
        return q, k, v, g, b_logits, a_logits, normalized

    def _conv_norm_kernel(self, head: torch.Tensor) -> bool:
        """The fused q|k|v conv goes to the conv + SiLU + L2 norm kernel: the switch is on, the
        kernels can take ``head``, and the q/k norms are ones it computes (l2 or none)."""
        return (
            conv.TRITON_CONV_NORM
            and conv_norm_triton.usable(head)
            and {self.q_norm, self.k_norm} <= {"l2", "none"}
        )

    def _l2_channels(self) -> tuple[int, int]:
        """[begin, end) of the q|k|v channels that are L2-normalized per head: q's, k's, both
        (q and k are adjacent) or none."""
        begin = 0 if self.q_norm == "l2" else self.key_dim
        end = 2 * self.key_dim if self.k_norm == "l2" else self.key_dim
        return (begin, end) if begin < end else (0, 0)

    def _activate_beta_decay(
        self, b_logits: torch.Tensor | None, a_logits: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """β = sigmoid|softplus(logits), log α = −exp(A_log)·softplus(logits + dt_bias), both
        [B, T, Hv] in float32 (float64 for a float64 model; None where the layer has none):
        the op keeps its gates in at least float32, so half-precision logits are widened once
        here, before the activations."""
        beta = log_decay = None
        if b_logits is not None:
            act = torch.sigmoid if self.beta_activation == "sigmoid" else F.softplus
            beta = act(b_logits.to(torch.promote_types(b_logits.dtype, torch.float32)))
        if a_logits is not None:
            acc = torch.promote_types(a_logits.dtype, torch.float32)
            dt = F.softplus(a_logits.to(acc) + self.dt_bias.to(acc))
            log_decay = -torch.exp(self.A_log.to(acc)) * dt
        return beta, log_decay

    def _beta_and_log_decay(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """β [B, T, Hv] and log α [B, T, Hv] in float32 (float64 for a float64 model; None
        where the layer has none), from the op-by-op projections.

        With both, W_β and W_a run as one [2 Hv, hidden] matmul: two skinny GEMMs over the
        same input cost two reads of x (and two launches, forward and backward) for 2 Hv
        outputs. The parameters stay separate (checkpoints unchanged)."""
        b_logits = a_logits = None
        if self.use_beta and self.use_decay:
            w = torch.cat([self.b_proj.weight, self.a_proj.weight])
            b_logits, a_logits = F.linear(x, w).chunk(2, dim=-1)
        elif self.use_beta:
            b_logits = self.b_proj(x)
        elif self.use_decay:
            a_logits = self.a_proj(x)
        return self._activate_beta_decay(b_logits, a_logits)

    def extra_repr(self) -> str:
        return (
            f"rule={self.rule}, heads={self.num_heads}/{self.num_v_heads}, "
            f"head_dim={self.head_dim}, head_v_dim={self.head_v_dim}, decay={self.use_decay}, "
            f"neg_eig={self.negative_eigenvalues}, "
            f"beta={self.beta_activation if self.use_beta else None}, "
            f"qk_norm=({self.q_norm}, {self.k_norm}), "
            f"conv={self.conv_size if self.use_short_conv else 0}, "
            f"gate={self.use_output_gate}"
        )

    def _heads(self, q, k, v, B: int, T: int, normalized: bool = False) -> tuple[torch.Tensor, ...]:
        """[B, T, H·D] projections -> [B, T, Hv, D] heads, q/k L2-normalized where the rule
        asks (unless ``normalized``: done already), q/k repeated over grouped value heads."""
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_heads, self.head_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        if self.q_norm == "l2" and not normalized:
            q = l2_normalize(q)
        if self.k_norm == "l2" and not normalized:
            k = l2_normalize(k)
        if self.num_v_heads != self.num_heads:  # grouped value heads share q/k
            group = self.num_v_heads // self.num_heads
            q = q.repeat_interleave(group, dim=2)
            k = k.repeat_interleave(group, dim=2)
        return q, k, v

    def _output(
        self, o: torch.Tensor, x: torch.Tensor, B: int, T: int, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y = W_o(RMSNorm(o) ⊙ SiLU(W_g x)) per head (without the gate: W_o RMSNorm(o)).
        ``g``: W_g x when the caller already computed it (the fused projections)."""
        if self.use_output_gate:
            g = self.g_proj(x) if g is None else g
            g = g.view(B, T, self.num_v_heads, self.head_v_dim)
        o = self.o_norm(o, g)  # RMSNorm(o) ⊙ SiLU(g) in one function
        return self.o_proj(o.reshape(B, T, self.value_dim))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        state: dict[str, torch.Tensor] | None = None,
        use_cache: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        mask_prepared: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """hidden_states ``[B, T, hidden]``; attention_mask ``[B, T]`` (1 = token, 0 = padding).

        ``state``: the dict returned by a previous call (continue that sequence), or None.
        ``cu_seqlens``: int offsets ``[N + 1]`` of N sequences packed in a ``[1, T, hidden]``
        input (training without padding; each sequence starts from a zero state and conv).
        ``mask_prepared``: attention_mask / cu_seqlens are already checked (the outputs of
        ``prepare_padding_mask`` / ``prepare_cu_seqlens``), so per-layer host syncs are skipped.
        Returns ``(y [B, T, hidden], state)``; with ``use_cache`` the state dict (updated in
        place) holds ``recurrent_state`` [B, Hv, Dk, Dv] float32 and ``conv_q/k/v`` windows.
        """
        x = hidden_states
        B, T, mask, cu_seqlens, state = prepare_mixer_inputs(
            "DeltaAttention",
            x,
            self.hidden_size,
            attention_mask,
            state,
            use_cache,
            cu_seqlens,
            mask_prepared,
        )
        weight = self.q_proj.weight
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"DeltaAttention: hidden_states are {x.dtype} but the layer's weights are "
                f"{weight.dtype}: convert one (layer.to({x.dtype}) or x.to({weight.dtype})), "
                "or run under torch.autocast"
            )
        x = zero_padding(x, mask)  # a nan at a padded position must not reach real tokens
        new_state: dict[str, torch.Tensor] = state if use_cache else {}
        cp = self._active_context_parallel()
        if cp is not None:
            cp.check_call(mask, state, use_cache, cu_seqlens)

        fused = self.fused_projections
        if fused is None:
            fused = x.is_cuda
        if fused and mask is None and not use_cache and not state:
            # Training / scoring: one GEMM for every input projection, one conv over q|k|v.
            q, k, v, g, b_logits, a_logits, normalized = self._fused_inputs(x, cu_seqlens)
            beta, log_decay = self._activate_beta_decay(b_logits, a_logits)
        else:
            g, normalized = None, False
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.use_short_conv and cp is not None:
                q, k, v = cp.short_convs((self.q_conv, self.k_conv, self.v_conv), (q, k, v))
            elif self.use_short_conv:
                cu = cu_seqlens
                q, new_state["conv_q"] = self.q_conv(q, mask, state.get("conv_q"), use_cache, cu)
                k, new_state["conv_k"] = self.k_conv(k, mask, state.get("conv_k"), use_cache, cu)
                v, new_state["conv_v"] = self.v_conv(v, mask, state.get("conv_v"), use_cache, cu)
            else:
                q, k, v = F.silu(q), F.silu(k), F.silu(v)
            beta, log_decay = self._beta_and_log_decay(x)
        q, k, v = self._heads(q, k, v, B, T, normalized)

        # Padding = identity step for every rule: no erase, no write (k = v = 0), no decay.
        k, v, beta, log_decay = padding_as_identity_steps(mask, k, v, beta, log_decay)
        if self.keep_op_inputs and torch.is_grad_enabled() and not use_cache:
            q, k, v, beta, log_decay = keep_for_backward(q, k, v, beta, log_decay)

        S0 = state.get("recurrent_state")
        if S0 is not None and T == 1 and not torch.is_grad_enabled():
            # Decoding: one recurrent step, updating the state buffer in place.
            S = S0 if use_cache else S0.clone()
            o = delta_rule_step(
                q,
                k,
                v,
                beta,
                S,
                rule=self.step_rule,
                log_decay=log_decay,
                negative_eigenvalues=self.negative_eigenvalues,
                eps=self.eps,
            )
        else:
            o, S = (delta_rule if cp is None else cp.delta_rule)(
                q,
                k,
                v,
                beta,
                rule=self.step_rule,
                log_decay=log_decay,
                negative_eigenvalues=self.negative_eigenvalues,
                eps=self.eps,
                initial_state=S0,
                output_final_state=use_cache,
                cu_seqlens=cu_seqlens,
                chunk_size=self.chunk_size,
                backend=self.backend,
                # β >= 0 and log α <= 0 hold by construction: skip the op's host-side value
                # checks (one GPU sync each, per layer and training step).
                check_values=False,
            )
        if use_cache:
            new_state["recurrent_state"] = S

        y = self._output(o, x, B, T, g)
        return y, (new_state if use_cache else None)

    # ---------------------------------------------------------------- static decoding

    def decode_state(
        self, batch_size: int, max_length: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Zeroed buffers for :meth:`decode_step` (``max_length`` is unused: the state has a
        constant size). Same names and layout as the dynamic cache entries, so a prefilled
        :class:`~deltaflow.layers.DeltaFlowCache` layer can be copied in."""
        dtype = self.q_proj.weight.dtype
        H, Dk, Dv = self.num_v_heads, self.head_dim, self.head_v_dim
        # fp32 state for half-precision models (as the chunked op keeps it); fp64 models keep fp64
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        state = {
            "recurrent_state": torch.zeros(batch_size, H, Dk, Dv, device=device, dtype=state_dtype)
        }
        if self.use_short_conv:
            W = self.conv_size - 1
            state["conv_q"] = torch.zeros(batch_size, self.key_dim, W, device=device, dtype=dtype)
            state["conv_k"] = torch.zeros(batch_size, self.key_dim, W, device=device, dtype=dtype)
            state["conv_v"] = torch.zeros(batch_size, self.value_dim, W, device=device, dtype=dtype)
        return state

    def decode_step(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token per row, x ``[B, hidden]`` -> y ``[B, hidden]``, updating ``state`` (from
        :meth:`decode_state`) in place: no host sync, no checks, no re-bound buffers, so a
        whole model step can be captured in a CUDA graph. Same math as :meth:`forward`."""
        B = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q = self.q_conv.step(q, state["conv_q"])
            k = self.k_conv.step(k, state["conv_k"])
            v = self.v_conv.step(v, state["conv_v"])
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k, v = self._heads(q, k, v, B, 1)
        beta, log_decay = self._beta_and_log_decay(x[:, None])
        o = delta_rule_step(
            q,
            k,
            v,
            beta,
            state["recurrent_state"],
            rule=self.step_rule,
            log_decay=log_decay,
            negative_eigenvalues=self.negative_eigenvalues,
            eps=self.eps,
        )
        return self._output(o, x, B, 1).view(B, self.hidden_size)
