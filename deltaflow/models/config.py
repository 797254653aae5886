"""DeltaFlowConfig: a transformers config for delta-rule language models and hybrids."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from transformers import PretrainedConfig

from deltaflow.layers.delta_attention import BETA_ACTIVATIONS, DeltaAttention, resolve_qk_norm
from deltaflow.ops.checks import check_backend, check_chunk_size
from deltaflow.rules import RULES
from deltaflow.validation import check_bool, check_float, check_known_keys, check_str

MIXER_TYPES = ("delta", "attention", "sliding_attention")
POSITION_EMBEDDINGS = ("rope", "learned")


class DeltaFlowConfig(PretrainedConfig):
    """Configuration of :class:`deltaflow.models.DeltaFlowForCausalLM`.

    Model: ``vocab_size``, ``hidden_size``, ``num_layers``, ``intermediate_size`` (SwiGLU width,
    default 8/3·hidden rounded up to a multiple of 64), ``norm_eps``, ``tie_word_embeddings``.

    Delta-rule mixers (see :class:`deltaflow.layers.DeltaAttention`): ``num_heads``, ``head_dim``
    (key dim, default hidden_size // num_heads), ``expand_v`` / ``head_v_dim``, ``num_v_heads``,
    ``rule``, ``use_decay``, ``negative_eigenvalues``, ``beta_activation``, ``qk_norm`` (None =
    rule default, 'l2' | 'none', or [q, k]), ``use_short_conv``, ``conv_size``,
    ``use_output_gate``, ``eps``, ``chunk_size`` (None: the op chooses), ``backend``.

    Mixer per layer: ``mixer_types`` (list of 'delta' | 'attention' | 'sliding_attention'; the
    argument ``layer_types`` is an alias, stored as ``mixer_types`` because transformers 5
    validates ``layer_types`` against its own vocabulary), or the shorthand ``attn_every=k``
    (every k-th layer is softmax attention: layers k-1, 2k-1, ...).
    Softmax attention: ``attn_num_heads`` (default num_heads), ``attn_num_kv_heads``,
    ``attn_head_dim``, ``rope_theta``, ``sliding_window`` (for 'sliding_attention'),
    ``attn_qk_norm``.

    Positions: ``position_embedding`` 'rope' (rotary, in every softmax-attention layer) or
    'learned' (absolute embeddings of ``max_position_embeddings`` positions added to the token
    embeddings, no RoPE: Zoology's attention baseline). ``use_mlp=False`` drops the SwiGLU
    from every block (mixer only, as Zoology's MQAR models).

    Init: normal(0, ``initializer_range``); residual out-projections (mixer ``o_proj``, MLP
    ``down_proj``) use std / sqrt(2·num_layers) when ``rescale_residual``.

    Loss: ``labels_are_shifted=False`` is the transformers convention (labels = input_ids, the
    model shifts); ``True`` means ``labels[t]`` is already the target of position ``t``.
    """

    model_type = "deltaflow"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the name before and from 5.24
    # The conventional transformers names, read and written as aliases of deltaflow's own.
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "rms_norm_eps": "norm_eps",
    }

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 512,
        num_layers: int = 8,
        num_heads: int = 4,
        head_dim: int | None = None,
        expand_v: float = 1.0,
        head_v_dim: int | None = None,
        num_v_heads: int | None = None,
        rule: str = "delta",
        use_decay: bool = False,
        negative_eigenvalues: bool = False,
        beta_activation: str = "sigmoid",
        qk_norm: str | list[str] | None = None,
        use_short_conv: bool = True,
        conv_size: int = 4,
        use_output_gate: bool = True,
        eps: float = 1e-6,
        chunk_size: int | None = None,
        backend: str = "auto",
        mixer_types: list[str] | None = None,
        layer_types: list[str] | None = None,
        attn_every: int = 0,
        attn_num_heads: int | None = None,
        attn_num_kv_heads: int | None = None,
        attn_head_dim: int | None = None,
        rope_theta: float = 10000.0,
        sliding_window: int | None = None,
        attn_qk_norm: bool = False,
        position_embedding: str = "rope",
        max_position_embeddings: int | None = None,
        use_mlp: bool = True,
        intermediate_size: int | None = None,
        norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        rescale_residual: bool = True,
        tie_word_embeddings: bool = True,
        labels_are_shifted: bool = False,
        use_cache: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        # A misspelt argument must not build the default model: anything that is neither ours
        # (nor an alias) nor a key transformers itself writes or passes is refused.
        check_known_keys(
            "DeltaFlowConfig",
            [k for k in kwargs if k not in _transformers_keys()],
            own_keys(),
        )
        # Resolve the conventional names first: everything derived from the layer count
        # (mixer_types) must see the value the caller meant, or the saved config.json holds a
        # num_layers and a mixer_types of different lengths that from_pretrained rejects.
        given = {"num_layers": num_layers, "num_heads": num_heads, "norm_eps": norm_eps}
        defaults = _init_defaults()
        for alias, name in self.attribute_map.items():
            if alias not in kwargs:
                continue
            value = kwargs.pop(alias)
            if given[name] != defaults[name] and given[name] != value:
                raise ValueError(
                    f"{alias}={value!r} is an alias of {name}, which was given as "
                    f"{given[name]!r}; give one of them"
                )
            given[name] = value
        num_layers, num_heads, norm_eps = given["num_layers"], given["num_heads"], given["norm_eps"]
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.expand_v = expand_v
        self.head_v_dim = head_v_dim
        self.num_v_heads = num_v_heads
        self.rule = rule
        self.use_decay = use_decay
        self.negative_eigenvalues = negative_eigenvalues
        self.beta_activation = beta_activation
        self.qk_norm = list(qk_norm) if isinstance(qk_norm, (list, tuple)) else qk_norm
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_output_gate = use_output_gate
        self.eps = eps
        self.chunk_size = chunk_size
        self.backend = backend
        self.attn_every = attn_every
        self.attn_num_heads = attn_num_heads
        self.attn_num_kv_heads = attn_num_kv_heads
        self.attn_head_dim = attn_head_dim
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.attn_qk_norm = attn_qk_norm
        self.position_embedding = position_embedding
        self.max_position_embeddings = max_position_embeddings
        self.use_mlp = use_mlp
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.rescale_residual = rescale_residual
        self.labels_are_shifted = labels_are_shifted
        self.use_cache = use_cache
        if (
            mixer_types is not None
            and layer_types is not None
            and list(mixer_types) != list(layer_types)
        ):
            raise ValueError("give mixer_types or its alias layer_types, not two different lists")
        self.mixer_types = self._resolve_mixer_types(
            mixer_types if mixer_types is not None else layer_types, attn_every, num_layers
        )
        self._validate()
        check_bool("tie_word_embeddings", tie_word_embeddings)  # set after the base's __init__
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        # transformers 5 keeps tie_word_embeddings only if the subclass declares it; be explicit.
        self.tie_word_embeddings = tie_word_embeddings

    @staticmethod
    def _resolve_mixer_types(
        mixer_types: list[str] | None, attn_every: int, num_layers: int
    ) -> list[str]:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(attn_every, int) or isinstance(attn_every, bool) or attn_every < 0:
            raise ValueError(f"attn_every must be an int >= 0, got {attn_every!r}")
        if attn_every > num_layers:  # every k-th layer of fewer than k: none at all
            raise ValueError(
                f"attn_every={attn_every} with num_layers={num_layers} makes no layer softmax "
                "attention; give attn_every <= num_layers (0: no attention layers)"
            )
        from_every = [
            "attention" if attn_every and (i + 1) % attn_every == 0 else "delta"
            for i in range(num_layers)
        ]
        if mixer_types is None:
            return from_every
        if isinstance(mixer_types, str) or not all(isinstance(t, str) for t in mixer_types):
            raise ValueError(f"mixer_types must be a list of strings, got {mixer_types!r}")
        mixer_types = list(mixer_types)
        if attn_every and mixer_types != from_every:
            raise ValueError(
                f"mixer_types {mixer_types} contradicts attn_every={attn_every}; give only one"
            )
        return mixer_types

    def _validate(self) -> None:
        for name in _BOOL_ARGS:
            check_bool(name, getattr(self, name))
        for name in _FLOAT_ARGS:  # numeric strings (YAML 1.1 reads "1e-6" as one) are converted
            setattr(self, name, check_float(name, getattr(self, name)))
        for name in ("rule", "beta_activation", "backend", "position_embedding"):
            check_str(name, getattr(self, name))

        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            positive_int(name)
        for name in ("head_dim", "head_v_dim", "num_v_heads", "intermediate_size", "chunk_size"):
            positive_int(name, allow_none=True)
        for name in ("attn_num_heads", "attn_num_kv_heads", "attn_head_dim", "sliding_window"):
            positive_int(name, allow_none=True)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding must be one of {POSITION_EMBEDDINGS}, got "
                f"{self.position_embedding!r}"
            )
        learned = self.position_embedding == "learned"
        if learned:
            positive_int("max_position_embeddings")
        elif self.max_position_embeddings is not None:  # would be silently unused
            raise ValueError(
                "max_position_embeddings sizes learned positions: give it with "
                "position_embedding='learned' only"
            )
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; known rules: {', '.join(sorted(RULES))}")
        if self.beta_activation not in BETA_ACTIVATIONS:
            raise ValueError(
                f"beta_activation must be one of {BETA_ACTIVATIONS}, got {self.beta_activation!r}"
            )
        resolve_qk_norm(self.rule, self.qk_norm)  # raises on bad values
        if self.head_dim is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}) when head_dim is not given"
            )
        key_dim = self.head_dim or self.hidden_size // self.num_heads
        if self.head_v_dim is None and (
            self.expand_v <= 0 or not float(key_dim * self.expand_v).is_integer()
        ):
            raise ValueError(
                f"head_dim * expand_v must be a positive integer, got {key_dim} * {self.expand_v}"
            )
        if self.num_v_heads is not None and self.num_v_heads % self.num_heads != 0:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.use_short_conv:
            positive_int("conv_size")
        check_chunk_size(self.chunk_size)  # the op's checks
        check_backend(self.backend)
        if len(self.mixer_types) != self.num_layers:
            raise ValueError(
                f"mixer_types has {len(self.mixer_types)} entries but num_layers={self.num_layers}"
            )
        for t in self.mixer_types:
            if t not in MIXER_TYPES:
                raise ValueError(f"mixer_types entries must be in {MIXER_TYPES}, got {t!r}")
        if any(t != "delta" for t in self.mixer_types):
            heads = self.attn_num_heads or self.num_heads
            kv = self.attn_num_kv_heads or heads
            if self.attn_head_dim is None and self.hidden_size % heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by attn_num_heads "
                    f"({heads}) when attn_head_dim is not given"
                )
            if heads % kv != 0:
                raise ValueError(f"attn_num_kv_heads ({kv}) must divide attn_num_heads ({heads})")
            if not learned and (self.attn_head_dim or self.hidden_size // heads) % 2 != 0:
                raise ValueError("the softmax-attention head dim must be even (RoPE)")
        if "sliding_attention" in self.mixer_types and self.sliding_window is None:
            raise ValueError("mixer_types has 'sliding_attention' but sliding_window is None")
        for name in ("norm_eps", "initializer_range", "eps"):
            if not getattr(self, name) > 0:  # also NaN
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def mlp_hidden_size(self) -> int:
        """SwiGLU width: intermediate_size, or 8/3·hidden rounded up to a multiple of 64."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)


_BOOL_ARGS = (
    "use_decay",
    "negative_eigenvalues",
    "use_short_conv",
    "use_output_gate",
    "attn_qk_norm",
    "use_mlp",
    "rescale_residual",
    "labels_are_shifted",
    "use_cache",
)
_FLOAT_ARGS = ("expand_v", "eps", "rope_theta", "norm_eps", "initializer_range")


# DeltaAttention's arguments that are not DeltaFlowConfig fields: the layer's index (set per
# layer by the model) and fused_projections (chosen from the device at run time).
LAYER_ONLY_ARGS = ("layer_idx", "fused_projections")


@functools.cache
def delta_attention_arg_names() -> tuple[str, ...]:
    """DeltaAttention's arguments that the config holds, under the same names: declared once, in
    the layer's signature (tests/test_one_source.py checks that the config has each one, with
    the same default)."""
    params = inspect.signature(DeltaAttention.__init__).parameters
    return tuple(n for n in params if n != "self" and n not in LAYER_ONLY_ARGS)


def delta_attention_kwargs(config: DeltaFlowConfig) -> dict[str, Any]:
    """The keyword arguments of a delta-rule layer of ``config``."""
    return {name: getattr(config, name) for name in delta_attention_arg_names()}


@functools.cache
def own_keys() -> frozenset[str]:
    """DeltaFlowConfig's own arguments and their conventional aliases (``num_hidden_layers``,
    ...): what a training config's ``model`` section may hold (besides vocab_size)."""
    params = inspect.signature(DeltaFlowConfig.__init__).parameters
    own = {n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
    return frozenset(own | set(DeltaFlowConfig.attribute_map))


@functools.cache
def _transformers_keys() -> frozenset[str]:
    """Keys transformers itself passes to a config's __init__ (from config.json, from
    ``from_pretrained`` / ``for_model``): PretrainedConfig's fields and what its base class
    writes and pops. Computed from the installed version where it can be, so a new
    transformers field does not make saved models unloadable."""
    keys = set(PretrainedConfig().to_dict())
    if dataclasses.is_dataclass(PretrainedConfig):
        keys |= {f.name for f in dataclasses.fields(PretrainedConfig)}
    try:
        from transformers import GenerationConfig

        keys |= set(GenerationConfig._get_default_generation_params())  # popped by the base
    except (ImportError, AttributeError):
        pass
    keys |= {  # read and popped by PretrainedConfig / from_dict, or written by save_pretrained
        "model_type",
        "transformers_version",
        "architectures",
        "auto_map",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "torch_dtype",
        "dtype",
        "num_labels",
        "id2label",
        "label2id",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
        "per_layer_config",
        "return_dict",
        "output_hidden_states",
    }
    return frozenset(keys - own_keys())


@functools.cache
def _init_defaults() -> dict[str, Any]:
    """DeltaFlowConfig's constructor defaults (to tell an alias from an explicit value)."""
    params = inspect.signature(DeltaFlowConfig.__init__).parameters
    return {name: p.default for name, p in params.items() if p.default is not p.empty}
