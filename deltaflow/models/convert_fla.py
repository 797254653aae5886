"""Convert an fla (flash-linear-attention) checkpoint into a deltaflow model folder.

    deltaflow convert-fla path/to/fla_gdn --out converted/gdn

reads a folder that fla's ``save_pretrained`` wrote (``config.json`` + ``model.safetensors``,
or shards with ``model.safetensors.index.json``) of a ``GatedDeltaNetForCausalLM``
(``model_type: gated_deltanet``) or a ``DeltaNetForCausalLM`` (``model_type: delta_net``)
and writes a ``DeltaFlowForCausalLM`` ``save_pretrained`` folder with the same outputs
(tokenizer files beside the weights are copied along). The models are the same computation:

    h = h + Mixer(RMSNorm(h));  h = h + SwiGLU(RMSNorm(h));  logits = lm_head(RMSNorm(h))
    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x)); q, k L2-normalized
    β = sigmoid(W_b x) (x 2 with allow_neg_eigval);  log α = −exp(A_log) softplus(W_a x + dt_bias)
    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ;  o_t = S_tᵀ q_t / sqrt(d_k)
    y = W_o(RMSNorm(o) ⊙ SiLU(W_g x))  (no gate: W_o RMSNorm(o))

DeltaNet is the same without the decay (and with its output gate off by default). Value
heads beyond the q/k heads (``num_v_heads``) share q/k heads in blocks, as in deltaflow.
Every config field is either mapped, known to leave the outputs unchanged (kernel choices,
fused-kernel switches, loss options), or refused with one line; every weight is mapped by
name and shape, and a weight left over on either side is an error.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FLA_MODEL_TYPES = {"gated_deltanet": "GatedDeltaNetForCausalLM", "delta_net": "DeltaNetForCausalLM"}

# Fields that change nothing a converted model computes: kernel and fusion switches, the loss
# (fused cross entropy, l2warp), positions for softmax layers (refused below when present),
# init scales and caching. ``use_output_norm`` is stored by DeltaNetConfig but its layer in
# fla 0.6.0 always normalizes the output, so it is ignored there too.
_NO_EFFECT = {
    "attn_mode",
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
    "use_l2warp",
    "max_position_embeddings",
    "use_cache",
    "hidden_ratio",  # read to derive intermediate_size
    "use_output_norm",
}
# Mapped one to one (fla name -> DeltaFlowConfig name).
_RENAMED = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_heads": "num_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "norm_eps",
    "use_short_conv": "use_short_conv",
    "conv_size": "conv_size",
    "use_gate": "use_output_gate",
    "allow_neg_eigval": "negative_eigenvalues",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
# Read by the per-model code below (not copied as they are).
_DERIVED = {
    "gated_deltanet": {"head_dim", "expand_v", "num_v_heads", "intermediate_size", "hidden_act"},
    "delta_net": {
        "expand_k",
        "expand_v",
        "intermediate_size",
        "hidden_act",
        "use_beta",
        "qk_norm",
        "qk_activation",
    },
}
# Fields whose only representable value is given here (None = must be absent or null).
_REQUIRED = {
    "attn": (None, "hybrid softmax-attention layers (attn) are not converted"),
    "attnres_block_size": (None, "attention residuals (attnres_block_size) have no deltaflow form"),
    "hidden_act": ("swish", "deltaflow's MLP is SwiGLU (hidden_act 'swish')"),
    "output_gate_activation": ("swish", "deltaflow's output gate is SiLU ('swish'/'silu')"),
    "use_beta": (True, "deltaflow's delta rule reads β (use_beta false fixes β = 1)"),
    "qk_norm": ("l2", "deltaflow's delta rule L2-normalizes q and k (qk_norm 'l2')"),
    "qk_activation": ("silu", "deltaflow applies SiLU to q and k (qk_activation 'silu')"),
}


# fla 0.6.0's config defaults (GatedDeltaNetConfig, DeltaNetConfig): a config.json without a
# field means this value.
_COMMON_DEFAULTS = {
    "hidden_size": 2048,
    "use_short_conv": True,
    "allow_neg_eigval": False,
    "conv_size": 4,
    "hidden_ratio": 4,
    "intermediate_size": None,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "attn": None,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "vocab_size": 32000,
    "attnres_block_size": None,
}
FLA_DEFAULTS = {
    "gated_deltanet": _COMMON_DEFAULTS
    | {
        "expand_v": 2.0,
        "use_gate": True,
        "head_dim": 256,
        "num_heads": 6,
        "num_v_heads": None,
        "num_hidden_layers": 21,
        "output_gate_activation": "swish",
    },
    "delta_net": _COMMON_DEFAULTS
    | {
        "expand_k": 1.0,
        "expand_v": 1.0,
        "use_gate": False,
        "use_beta": True,
        "num_heads": 16,
        "qk_norm": "l2",
        "qk_activation": "silu",
        "num_hidden_layers": 24,
    },
}


def _refuse(model_type: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"cannot convert this fla {model_type} model: {field}={value!r}: {why}")


def _check_required(model_type: str, fla: dict[str, Any]) -> None:
    for field, (want, why) in _REQUIRED.items():
        value = fla.get(field, want)
        if field == "output_gate_activation" and value == "silu":
            continue  # fla's alias of swish
        if value != want:
            raise _refuse(model_type, field, value, why)


def _fla_intermediate_size(fla: dict[str, Any]) -> int:
    """fla's GatedMLP width: intermediate_size, else 2/3 · hidden · hidden_ratio rounded up to
    a multiple of 256 (hidden_ratio None means 4)."""
    if fla.get("intermediate_size") is not None:
        return int(fla["intermediate_size"])
    ratio = fla.get("hidden_ratio") or 4
    width = int(fla["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def _integer(model_type: str, field: str, value: float) -> int:
    if abs(value - round(value)) > 1e-6 or round(value) <= 0:
        raise _refuse(model_type, field, value, "must give a positive integer head size")
    return int(round(value))


def read_fla_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An fla ``config.json`` (as a dict) with fla's defaults filled in for absent fields."""
    model_type = raw.get("model_type")
    if model_type not in FLA_MODEL_TYPES:
        raise ValueError(
            f"config.json has model_type {model_type!r}; convert-fla reads fla's "
            f"{' or '.join(repr(t) for t in FLA_MODEL_TYPES)} checkpoints "
            f"({', '.join(FLA_MODEL_TYPES.values())})"
        )
    return FLA_DEFAULTS[model_type] | raw


def config_from_fla(fla: dict[str, Any]) -> dict[str, Any]:
    """DeltaFlowConfig keyword arguments for an fla config (`read_fla_config`); one
    ``ValueError`` line for a setting deltaflow cannot represent."""
    from deltaflow.models.config import _transformers_keys

    model_type = fla["model_type"]
    known = set(_RENAMED) | _NO_EFFECT | _DERIVED[model_type] | set(_REQUIRED) | {"model_type"}
    unknown = sorted(k for k in fla if k not in known and k not in _transformers_keys())
    if unknown:
        raise ValueError(
            f"cannot convert this fla {model_type} model: unknown config fields {unknown} "
            "(written by a newer fla?); convert-fla knows fla 0.6.0's fields"
        )
    _check_required(model_type, fla)
    out = {new: fla[old] for old, new in _RENAMED.items() if old in fla}
    out["num_layers"] = fla["num_hidden_layers"]
    out.update(
        rule="delta",
        beta_activation="sigmoid",
        qk_norm="l2",
        intermediate_size=_fla_intermediate_size(fla),
        tie_word_embeddings=bool(fla.get("tie_word_embeddings", False)),
    )
    hidden, heads = fla["hidden_size"], fla["num_heads"]
    if model_type == "gated_deltanet":
        head_dim = int(fla.get("head_dim", 256))
        num_v_heads = fla.get("num_v_heads")
        if num_v_heads is not None and (num_v_heads < heads or num_v_heads % heads):
            raise _refuse(model_type, "num_v_heads", num_v_heads, f"must be a multiple of {heads}")
        out.update(
            use_decay=True,
            head_dim=head_dim,
            head_v_dim=_integer(model_type, "expand_v", head_dim * float(fla.get("expand_v", 2))),
            num_v_heads=num_v_heads,
        )
    else:
        key_dim = hidden * float(fla.get("expand_k", 1.0)) / heads
        value_dim = hidden * float(fla.get("expand_v", 1.0)) / heads
        out.update(
            use_decay=False,
            head_dim=_integer(model_type, "expand_k", key_dim),
            head_v_dim=_integer(model_type, "expand_v", value_dim),
        )
    return out


# ---------------------------------------------------------------------------- weights
def _layer_map(fla: dict[str, Any], model_type: str) -> dict[str, str]:
    """fla name -> deltaflow name for one block's weights (prefix ``layers.{i}.`` omitted)."""
    names = {"attn_norm.weight": "mixer_norm.weight", "mlp_norm.weight": "mlp_norm.weight"}
    for proj in ("q", "k", "v", "o"):
        names[f"attn.{proj}_proj.weight"] = f"mixer.{proj}_proj.weight"
    if model_type == "gated_deltanet" or fla.get("use_beta", True):
        names["attn.b_proj.weight"] = "mixer.b_proj.weight"
    if model_type == "gated_deltanet":
        names.update(
            {
                "attn.a_proj.weight": "mixer.a_proj.weight",
                "attn.A_log": "mixer.A_log",
                "attn.dt_bias": "mixer.dt_bias",
            }
        )
    if fla.get("use_short_conv", True):
        for x in ("q", "k", "v"):
            names[f"attn.{x}_conv1d.weight"] = f"mixer.{x}_conv.weight"
    if fla.get("use_gate", model_type == "gated_deltanet"):
        names["attn.g_proj.weight"] = "mixer.g_proj.weight"
    names["attn.o_norm.weight"] = "mixer.o_norm.weight"
    for proj in ("gate", "up", "down"):
        names[f"mlp.{proj}_proj.weight"] = f"mlp.{proj}_proj.weight"
    return names


def weight_names(fla: dict[str, Any]) -> dict[str, str]:
    """Every fla weight name -> its deltaflow name (``lm_head.weight`` omitted when tied)."""
    model_type = fla["model_type"]
    names = {
        "model.embeddings.weight": "model.embed_tokens.weight",
        "model.norm.weight": "model.norm.weight",
    }
    if not fla.get("tie_word_embeddings", False):
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(fla["num_hidden_layers"]):
        for old, new in _layer_map(fla, model_type).items():
            names[f"model.layers.{i}.{old}"] = f"model.layers.{i}.{new}"
    return names


def convert_state_dict(
    fla: dict[str, Any], state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """fla weights renamed to deltaflow's; ``expected`` (name -> shape of the deltaflow model)
    must be filled exactly, with every fla weight used (a tied ``lm_head`` copy excepted)."""
    names = weight_names(fla)
    extra = sorted(k for k in state if k not in names)
    if fla.get("tie_word_embeddings", False) and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # a tied head saved anyway: the embedding is the head
    if extra:
        raise ValueError(
            f"fla weights with no deltaflow counterpart: {extra[:6]}"
            + (f" and {len(extra) - 6} more" if len(extra) > 6 else "")
        )
    missing = sorted(k for k in names if k not in state)
    if missing:
        raise ValueError(f"the fla checkpoint lacks weights its config implies: {missing[:6]}")
    out = {}
    for old, new in names.items():
        if new not in expected:  # pragma: no cover - weight_names mirrors the model
            raise ValueError(f"internal: {new} is not a deltaflow weight")
        if tuple(state[old].shape) != tuple(expected[new]):
            raise ValueError(
                f"fla weight {old} has shape {tuple(state[old].shape)}, the config implies "
                f"{tuple(expected[new])} for {new}"
            )
        out[new] = state[old]
    tied = bool(fla.get("tie_word_embeddings", False))
    left = sorted(k for k in set(expected) - set(out) if not (tied and k == "lm_head.weight"))
    if left:
        raise ValueError(f"deltaflow weights the fla checkpoint does not fill: {left[:6]}")
    return out


def read_fla_weights(src: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors`` or of the shards its index names."""
    from safetensors.torch import load_file

    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(src / shard)))
        return state
    raise FileNotFoundError(
        f"{src} has no model.safetensors (or model.safetensors.index.json): convert-fla reads "
        "safetensors checkpoints as fla's save_pretrained writes them"
    )


_TOKENIZER_FILES: Callable[[str], bool] = lambda name: name.startswith(  # noqa: E731
    ("tokenizer", "special_tokens_map", "vocab.", "merges.txt", "generation_config")
)


def convert_fla(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``out`` (a new folder): the deltaflow model equal to the fla checkpoint ``src``.
    Weights keep their stored dtype; tokenizer and generation-config files are copied."""
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(
            f"no config.json in {src}: pass the folder fla's save_pretrained wrote"
        )
    if out.exists():
        raise FileExistsError(f"--out {out} exists; give a new folder")
    fla = read_fla_config(json.loads((src / "config.json").read_text()))
    config = DeltaFlowConfig(**config_from_fla(fla))
    state = read_fla_weights(src)
    with torch.device("meta"):  # shapes only: the weights come from the checkpoint
        expected = {k: v.shape for k, v in DeltaFlowForCausalLM(config).state_dict().items()}
    weights = convert_state_dict(fla, state, expected)
    dtype = next(iter(weights.values())).dtype
    model = DeltaFlowForCausalLM(config).to(dtype)
    model.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for f in sorted(src.iterdir()):
            if f.is_file() and _TOKENIZER_FILES(f.name):
                shutil.copyfile(f, tmp / f.name)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
