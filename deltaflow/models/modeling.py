"""DeltaFlow language models: pre-norm blocks of (delta-rule or softmax) mixer + SwiGLU MLP.

    h = h + Mixer(RMSNorm(h));  h = h + MLP(RMSNorm(h));  logits = W_out RMSNorm(h)

``DeltaFlowForCausalLM`` is a transformers ``PreTrainedModel``: ``save_pretrained`` /
``from_pretrained`` (safetensors), ``AutoModelForCausalLM`` (after ``import deltaflow.models``)
and ``generate()`` with a recurrent :class:`~deltaflow.layers.DeltaFlowCache`. A greedy decoder
that does not depend on transformers' generation code is :meth:`generate_greedy`. One block
(mixer, MLP, selective checkpointing) is :mod:`deltaflow.models.block`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from deltaflow.layers.cache import DeltaFlowCache
from deltaflow.layers.conv import ShortConvolution
from deltaflow.layers.delta_attention import DeltaAttention
from deltaflow.layers.mask import prepare_cu_seqlens, prepare_padding_mask
from deltaflow.layers.norm import RMSNorm
from deltaflow.layers.positions import LearnedPositions
from deltaflow.layers.softmax_attention import SoftmaxAttention
from deltaflow.models.block import (  # noqa: F401 (SwiGLU, build_mixer: their old home)
    DeltaFlowBlock,
    SwiGLU,
    build_mixer,
)
from deltaflow.models.config import DeltaFlowConfig
from deltaflow.models.loss import DEFAULT_CHUNK_SIZE, IGNORE_INDEX, linear_cross_entropy
from deltaflow.models.token_ids import (  # noqa: F401 (token_ids_checked: callers import it here)
    check_token_ids,
    token_ids_checked,
)
from deltaflow.ops.chunk import default_chunk_size

# transformers 5.24 renamed the cache argument and output field ``past_key_values`` -> ``cache``
# (the old names still work there, with a warning on every use). deltaflow accepts both names and
# writes the one the installed transformers reads, so generate() finds its cache in either.
_RENAMED = "cache" in BaseModelOutputWithPast.__dataclass_fields__
CACHE_FIELD = "cache" if _RENAMED else "past_key_values"


def _one_cache(past_key_values: Any, cache: Any) -> Any:
    """The cache passed under either name (both at once is an error)."""
    if past_key_values is not None and cache is not None:
        raise ValueError("pass the cache as cache= or past_key_values=, not both")
    return cache if cache is not None else past_key_values


def output_cache(output: Any) -> Any:
    """The cache a model output carries, read without transformers' renaming warning."""
    return getattr(output, CACHE_FIELD)


_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


class DeltaFlowPreTrainedModel(PreTrainedModel):
    config_class = DeltaFlowConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaFlowBlock"]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a transformers DynamicCache: forward creates a DeltaFlowCache.
        return False

    @classmethod
    def from_pretrained(cls, *args: Any, strict: bool = True, **kwargs: Any) -> Any:
        """transformers' ``from_pretrained``, refusing a folder whose weights do not match its
        config: a missing tensor would otherwise be randomly initialised (and an unexpected
        one dropped) with only a load report to say so. ``strict=False`` loads anyway (e.g.
        to fine-tune a new head); ``output_loading_info=True`` also returns the report."""
        want_info = kwargs.pop("output_loading_info", False)
        # transformers would raise "look at the above report!" itself; the check below names
        # the tensors (and strict=False loads anyway, as it says)
        kwargs.setdefault("ignore_mismatched_sizes", True)
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path", "")
        if where and Path(str(where)).is_dir() and not (Path(str(where)) / "config.json").is_file():
            raise FileNotFoundError(
                f"{where} has no config.json: not a save_pretrained folder (deltaflow export "
                "writes one)"
            )
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if strict:
            problems = _weight_problems(cls, info)
            if problems:
                raise ValueError(
                    f"{where}: the weights do not match config.json ({'; '.join(problems)}); "
                    "refusing to load a partly random model (pass strict=False to load anyway)"
                )
        return (model, info) if want_info else model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """normal(0, initializer_range); residual out-projections / sqrt(2·num_layers); norms 1;
        short convs keep nn.Conv1d's default; decay parameters use the Mamba2 init."""
        cfg = self.config
        std = cfg.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "_is_residual_out", False) and cfg.rescale_residual:
                std = std / math.sqrt(2 * cfg.num_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            module.reset_parameters()
        elif isinstance(module, DeltaAttention):
            module.reset_decay_parameters()


def _weight_problems(cls: type, info: dict[str, Any]) -> list[str]:
    """What a loading report says is wrong, one short phrase per kind (a few names each)."""

    def names(keys: Any) -> str:
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    unexpected = list(info.get("unexpected_keys") or [])
    if cls is DeltaFlowModel:  # the base model of a causal-LM checkpoint: its head is not ours
        unexpected = [k for k in unexpected if not str(k).startswith("lm_head.")]
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing {names(info['missing_keys'])}")
    if unexpected:
        problems.append(f"unexpected {names(unexpected)}")
    if info.get("mismatched_keys"):
        problems.append(f"wrong shape {names(info['mismatched_keys'])}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(m) for m in info["error_msgs"]))
    return problems


def check_batch_token_ids(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> bool:
    """What ``model``'s forward would check of ``input_ids`` and ``labels`` (its embedding rows;
    the vocabulary, -100 aside), checked here on CPU tensors (no GPU sync). Returns whether it
    checked: True for a DeltaFlowForCausalLM and CPU tensors, which the caller can then run
    inside :func:`token_ids_checked`; False (nothing checked) otherwise."""
    if not isinstance(model, DeltaFlowForCausalLM) or input_ids.is_cuda or labels.is_cuda:
        return False
    check_token_ids(input_ids, model.get_input_embeddings().num_embeddings)
    check_token_ids(labels, model.config.vocab_size, name="labels", ignore=IGNORE_INDEX)
    return True


class DeltaFlowModel(DeltaFlowPreTrainedModel):
    """Embedding, blocks and final norm; returns hidden states (no LM head)."""

    def __init__(self, config: DeltaFlowConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = LearnedPositions.of(config)  # None unless 'learned'
        self.layers = nn.ModuleList(DeltaFlowBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DeltaFlowCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        cache: DeltaFlowCache | None = None,
    ) -> BaseModelOutputWithPast:
        """``cu_seqlens``: int offsets ``[N + 1]`` of N documents packed in ``[1, T]`` input
        (no padding, no cross-document state, attention or conv; not with a cache).
        ``cache`` is another name for ``past_key_values`` (transformers >= 5.24 uses it)."""
        past_key_values = _one_cache(past_key_values, cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(
                "pass exactly one of input_ids [B, T] and inputs_embeds [B, T, hidden]"
            )
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
            check_token_ids(input_ids, self.embed_tokens.num_embeddings)
            inputs_embeds = self.embed_tokens(input_ids)
        elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"inputs_embeds must be [B, T, {self.config.hidden_size}], "
                f"got {tuple(inputs_embeds.shape)}"
            )
        B, T = inputs_embeds.shape[:2]
        if T == 0:
            raise ValueError("the input has no tokens (sequence length 0)")
        if past_key_values is not None and not isinstance(past_key_values, DeltaFlowCache):
            raise TypeError(
                "past_key_values must be a deltaflow.layers.DeltaFlowCache (or None), "
                f"got {type(past_key_values).__name__}"
            )
        if use_cache and past_key_values is None:
            past_key_values = DeltaFlowCache(self.config.num_layers)
        past = past_key_values.seen_tokens if past_key_values is not None else 0
        whole_mask = attention_mask  # [B, past + T] while decoding (learned positions)
        if attention_mask is not None:
            # transformers passes the mask of past + current tokens while decoding.
            if attention_mask.dim() == 2 and attention_mask.shape[1] == past + T and past > 0:
                attention_mask = attention_mask[:, past:]
            if attention_mask.shape != (B, T):
                raise ValueError(
                    f"attention_mask must be [B, T] = [{B}, {T}] (or [B, past + T] = "
                    f"[{B}, {past + T}] with a cache), got {tuple(attention_mask.shape)}"
                )
        # Validate once (and drop an all-ones mask) instead of once per layer.
        attention_mask = prepare_padding_mask(attention_mask, B, T, inputs_embeds.device)
        if cu_seqlens is not None:
            cu_seqlens = prepare_cu_seqlens(cu_seqlens, B, T, inputs_embeds.device)
            if attention_mask is not None or use_cache or past_key_values is not None:
                raise ValueError(
                    "cu_seqlens (packed sequences) cannot be combined with attention_mask or "
                    "a cache"
                )

        if getattr(self, "cuda_graph_blocks", False) and not torch.is_grad_enabled():
            # Blocks replayed from CUDA graphs (compile.CUDA_GRAPHS): a forward without grad
            # (evaluation) leaves no backward pending, so it starts a cudagraph-trees step of
            # its own; without it a second evaluation batch fails on the first's outputs. The
            # trainer marks its training steps itself.
            torch.compiler.cudagraph_mark_step_begin()
        h = inputs_embeds
        if self.embed_positions is not None:
            h = self.embed_positions.add_to(h, past, attention_mask, whole_mask, cu_seqlens)
        all_hidden: list[torch.Tensor] = []
        for i, block in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(h)
            state = past_key_values[i] if past_key_values is not None else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h, _ = checkpoint(
                    block, h, attention_mask, state, use_cache, cu_seqlens, use_reentrant=False
                )
            else:
                h, _ = block(h, attention_mask, state, use_cache, cu_seqlens)
        h = self.norm(h)
        if output_hidden_states:
            all_hidden.append(h)
        if past_key_values is not None and use_cache:
            past_key_values.seen_tokens += T
        return BaseModelOutputWithPast(
            last_hidden_state=h,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            **{CACHE_FIELD: past_key_values if use_cache else None},
        )


class DeltaFlowForCausalLM(DeltaFlowPreTrainedModel, GenerationMixin):
    """Causal LM: :class:`DeltaFlowModel` + linear head (tied to the embedding by default).

    ``model(input_ids, labels=labels)`` returns ``.loss`` (mean token cross-entropy over labels
    != -100, in float32) and ``.logits``; in training mode (or with
    ``fuse_linear_cross_entropy=True``, argument or config attribute) the loss is computed by the
    chunked :func:`~deltaflow.models.loss.linear_cross_entropy` and ``.logits`` is None.
    With ``labels_are_shifted=False`` (default, the transformers convention) labels are the
    input ids and the model predicts ``labels[t+1]`` at position ``t``; with
    ``labels_are_shifted=True`` (argument or config), ``labels[t]`` is the target of position
    ``t``.
    """

    if _TRANSFORMERS_5:
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        _tied_weights_keys = ["lm_head.weight"]

    # Rows per chunk of the lean loss (4096 x vocab 32000 fp32 logits = 0.5 GB at a time).
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE

    def __init__(self, config: DeltaFlowConfig) -> None:
        super().__init__(config)
        self.model = DeltaFlowModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DeltaFlowCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        labels_are_shifted: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        fuse_linear_cross_entropy: bool | None = None,
        cache: DeltaFlowCache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Returns ``CausalLMOutputWithPast(loss, logits, past_key_values, hidden_states)``.

        ``use_cache`` defaults to False (training and scoring need no cache); ``generate``
        and :meth:`generate_greedy` turn it on. ``logits_to_keep=n`` computes logits for the
        last n positions only (0 = all). Positions for RoPE come from ``attention_mask``, so
        ``position_ids`` is not an argument. ``cu_seqlens`` [N + 1] packs N documents in a
        ``[1, T]`` batch; with unshifted labels no document predicts the next one's first token.
        ``fuse_linear_cross_entropy``: with labels, compute the loss chunk by chunk without the
        [B, T, V] logits (``.logits`` is then None); None = the config attribute of that name if
        set, else ``self.training``.
        """
        # transformers' generation code may add these; they carry no information for us.
        for key in ("position_ids", "cache_position", "output_attentions"):
            value = kwargs.pop(key, None)
            if key == "output_attentions" and value:
                raise ValueError("output_attentions is not supported by DeltaFlow models")
        unknown = [k for k, v in kwargs.items() if v is not None]
        if unknown:
            raise TypeError(f"DeltaFlowForCausalLM.forward got unexpected arguments {unknown}")
        if return_dict is False:
            raise ValueError("return_dict=False is not supported; outputs are always a ModelOutput")

        if labels is not None:
            # Before the blocks: its host sync then waits for no forward work (the trainer's
            # step takes its loss from here; issue 31).
            check_token_ids(labels, self.config.vocab_size, name="labels", ignore=IGNORE_INDEX)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=_one_cache(past_key_values, cache),
            inputs_embeds=inputs_embeds,
            use_cache=bool(use_cache),
            output_hidden_states=bool(output_hidden_states),
            cu_seqlens=cu_seqlens,
        )
        h = out.last_hidden_state
        if labels is not None and logits_to_keep:
            raise ValueError("labels and logits_to_keep cannot be used together")
        if labels is not None and labels.shape != h.shape[:2]:
            raise ValueError(
                f"labels must be [B, T] = {list(h.shape[:2])}, got {list(labels.shape)}"
            )
        if fuse_linear_cross_entropy is None:
            fuse_linear_cross_entropy = getattr(self.config, "fuse_linear_cross_entropy", None)
        if fuse_linear_cross_entropy is None:  # default: lean loss while training
            fuse_linear_cross_entropy = self.training
        if labels is not None and fuse_linear_cross_entropy:
            # The logits are never materialized (see deltaflow.models.loss): .logits is None.
            targets = self.aligned_targets(
                labels, self._labels_shifted(labels_are_shifted), cu_seqlens
            )
            loss = linear_cross_entropy(
                h, self.lm_head.weight, targets.to(h.device), chunk_size=self.loss_chunk_size
            )
            return CausalLMOutputWithPast(
                loss=loss,
                logits=None,
                hidden_states=out.hidden_states,
                **{CACHE_FIELD: output_cache(out)},
            )

        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            targets = self.aligned_targets(
                labels, self._labels_shifted(labels_are_shifted), cu_seqlens
            )
            loss = self.lm_loss(logits, targets, labels_are_shifted=True)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
            **{CACHE_FIELD: output_cache(out)},
        )

    def _labels_shifted(self, labels_are_shifted: bool | None) -> bool:
        if labels_are_shifted is None:
            return bool(self.config.labels_are_shifted)
        return labels_are_shifted

    @staticmethod
    def aligned_targets(
        labels: torch.Tensor, labels_are_shifted: bool, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``targets[b, t]``: the label position ``t`` is scored against (-100 = not scored).

        Unshifted labels (transformers convention) move left by one, the last position gets
        -100, and with ``cu_seqlens`` so does every document's last token (its next label is
        the first token of the next document). No host sync: safe inside a training step.
        """
        if labels_are_shifted:
            return labels
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        if cu_seqlens is not None:
            T = labels.shape[1]
            # last tokens (offsets on the CPU: copied without waiting for the GPU)
            ends = (
                cu_seqlens[1:-1].to(device=labels.device, dtype=torch.long, non_blocking=True) - 1
            )
            # A boolean [T + 1] marker (index T catches empty documents at the end, -1 at the
            # start) instead of indexing with a data-dependent mask, which would sync.
            last = torch.zeros(T + 1, dtype=torch.bool, device=labels.device)
            last[ends.clamp(-1, T - 1) % (T + 1)] = True
            targets = targets.masked_fill(last[:T], -100)
        return targets

    @staticmethod
    def lm_loss(
        logits: torch.Tensor, labels: torch.Tensor, labels_are_shifted: bool
    ) -> torch.Tensor:
        """Mean float32 cross-entropy over labels != -100 (0 if every label is ignored)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(
                f"labels must be [B, T] = {list(logits.shape[:2])}, got {list(labels.shape)}"
            )
        if not labels_are_shifted:
            logits, labels = logits[:, :-1], labels[:, 1:]
        labels = labels.to(logits.device)
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        return total / (labels != -100).sum().clamp_min(1)

    # ---------------------------------------------------------------- generation

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: DeltaFlowCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = True,
        cache: DeltaFlowCache | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Feed only the tokens the cache has not seen (robust across transformers versions:
        the cache arrives as ``past_key_values`` before 5.24 and as ``cache`` from 5.24)."""
        past_key_values = _one_cache(past_key_values, cache)
        seen = past_key_values.seen_tokens if isinstance(past_key_values, DeltaFlowCache) else 0
        inputs: dict[str, Any] = {
            CACHE_FIELD: past_key_values,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
        }
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        elif seen:
            # The mask spans past + new tokens. input_ids is the full sequence, except after
            # an inputs_embeds prompt, where it holds only the generated tokens.
            total = attention_mask.shape[1] if attention_mask is not None else input_ids.shape[1]
            n_new = total - seen
            if attention_mask is None and n_new <= 0:
                n_new = 1
            if not 1 <= n_new <= input_ids.shape[1]:
                raise ValueError(
                    f"cannot tell the new tokens: the cache has seen {seen} tokens, the mask "
                    f"spans {total} and input_ids has {input_ids.shape[1]}"
                )
            inputs["input_ids"] = input_ids[:, -n_new:]
        else:
            inputs["input_ids"] = input_ids
        if use_cache:
            inputs["logits_to_keep"] = 1  # generation only reads the last position's logits
        return inputs

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: Any = None,
        decode_mode: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``generate``, decoded by a CUDA graph where it can be.

        ``decode_mode``: None (default) replays a captured one-token step on CUDA
        (:mod:`deltaflow.models.generation`) for greedy and sampling with temperature / top-k /
        top-p, EOS stopping and left-padded batches: the step compiled with torch.compile
        (first call compiles; on a compile or capture failure ``graph``, then transformers'
        loop); transformers' loop otherwise (beam search, logits processors, streamers,
        ``return_dict_in_generate``, CPU, ...).
        ``'compile'``, ``'graph'`` (captured without compiling: no compile time, ~3x slower
        per token) or ``'eager'`` (the static step op by op, also on CPU) force the static
        decoder and raise on an unsupported setting; ``'transformers'`` forces transformers'
        loop. Sampling draws from the global RNG (``torch.manual_seed``). Returns ``[B, T + n]``.
        """
        from deltaflow.models.generation import static_generate

        out = static_generate(self, inputs, generation_config, kwargs, decode_mode)
        if out is not None:
            return out
        return super().generate(inputs, generation_config, **kwargs)

    @torch.no_grad()
    def generate_greedy(
        self,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
    ) -> torch.LongTensor:
        """Greedy decoding with a recurrent cache, independent of transformers' generate().

        Prompts in a batch must be left-padded (``attention_mask`` 0 on the left). Returns
        ``[B, T + n]`` with n <= max_new_tokens; finished rows are padded with eos_token_id.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError("attention_mask must have the shape of input_ids")
        if max_new_tokens == 0:
            return input_ids
        B = input_ids.shape[0]
        cache = DeltaFlowCache(self.config.num_layers)
        out = self(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens = [input_ids]
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1)
            if eos_token_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                finished |= nxt == eos_token_id
            tokens.append(nxt[:, None])
            if i == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
                break
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
            out = self(
                nxt[:, None], attention_mask=attention_mask, past_key_values=cache, use_cache=True
            )
        return torch.cat(tokens, dim=1)

    # ---------------------------------------------------------------- accounting

    def estimate_flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Matmul FLOPs per token at context ``seq_len`` (x3 for forward + backward).

        Counts every linear layer (LM head included, embedding lookup excluded), the short
        convs, the chunked delta rule per head (``6·Dk·Dv + 3·C·Dk + 2·C·Dv + C²/3`` with
        chunk C: intra-chunk products, the triangular solve and the state read/update) and
        softmax attention (``4·D·L`` per head with L the mean attended length). Elementwise
        work (norms, activations, gates) is ignored.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        flops = 0.0
        for m in self.modules():
            if isinstance(m, nn.Linear):
                flops += 2 * m.in_features * m.out_features
            elif isinstance(m, ShortConvolution):
                flops += 2 * m.channels * m.kernel_size
            elif isinstance(m, DeltaAttention):
                chunk = m.chunk_size or default_chunk_size(m.q_proj.weight.device)  # the op's
                C = min(chunk, seq_len)
                Dk, Dv = m.head_dim, m.head_v_dim
                flops += m.num_v_heads * (6 * Dk * Dv + 3 * C * Dk + 2 * C * Dv + C * C / 3)
            elif isinstance(m, SoftmaxAttention):
                w = m.window_size or seq_len
                mean_len = sum(min(t + 1, w) for t in range(seq_len)) / seq_len
                flops += m.num_heads * 4 * m.head_dim * mean_len
        return 3 * flops if training else flops
