"""Fast generation: a static decode cache and a one-token model step replayed as a CUDA graph.

A recurrent model decodes with a constant-size state, so each new token costs one read of the
weights and the states: about 0.25 ms for a 360M-parameter bf16 model on an H100. Launched op
by op from Python, the same step costs tens of milliseconds (hundreds of small kernels, each
with its launch overhead). Here the whole step, token choice included, is captured once and
replayed per token:

    prefill   chunked kernels over the prompt -> DeltaFlowCache -> copied into a StaticDecodeCache
    capture   h = embed(ids); per layer h += mixer.decode_step(norm(h)); h += mlp(norm(h));
              logits = head(norm(h)); next = choose(logits); buffers updated in place
    replay    graph.replay() per token: no Python per layer, no allocation, no host sync

Modes: ``eager`` runs the same static step op by op (CPU, and the reference for the graph);
``graph`` captures it in a CUDA graph; ``compile`` first compiles the model step with
``torch.compile`` (fusing the elementwise work) and captures that. ``generate`` of
:class:`~deltaflow.models.DeltaFlowForCausalLM` picks ``compile`` on CUDA (then ``graph``,
then transformers' loop, if compilation or capture fails) when the request is plain greedy or
sampling (temperature, top-k, top-p), and transformers' loop otherwise.

Measured on an H100 (360M Gated DeltaNet, bf16, batch 1, benchmarks/results/generation_*):
compile 1.70-1.80 ms/token, graph 4.9-5.0, op by op (eager or transformers' loop) 51-83,
fla's generate 72.9.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deltaflow.layers.cache import DeltaFlowCache, StaticDecodeCache

MODES = ("eager", "graph", "compile")
# Generation settings the static decoder does not implement: any of them away from
# transformers' default sends generate() down transformers' own loop.
_UNSUPPORTED_SETTINGS = (
    "num_beams",
    "num_beam_groups",
    "penalty_alpha",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "force_words_ids",
    "min_length",
    "min_new_tokens",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "min_p",
    "top_h",
    "num_return_sequences",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "guidance_scale",
    "stop_strings",
    "renormalize_logits",
    "exponential_decay_length_penalty",
    "max_time",
    "watermarking_config",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
)
_BUCKET = 256  # decoders are reused across calls whose lengths round up to the same multiple


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (transformers' order: temperature, top-k, top-p)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus filter
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.eos_token_ids and self.pad_token_id is None:
            raise ValueError("pad_token_id is needed to fill the rows that stopped at EOS")


def top_p_filter(scores: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``
    (a token stays when the mass strictly more likely than it is < top_p); others -> -inf."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def choose_next(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None):
    """Next token ids ``[B]`` from logits ``[B, V]``: argmax, or a sample of the filtered
    distribution. Static shapes and no host sync (capturable)."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    scores = top_p_filter(scores, sampling.top_p)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def decode_step(model: torch.nn.Module, input_ids: Tensor, cache: StaticDecodeCache) -> Tensor:
    """One token per row through the whole model: ids ``[B]`` -> logits ``[B, V]``.

    ``model`` is a DeltaFlowForCausalLM; ``cache`` is updated in place (see the mixers'
    ``decode_step``). Same math as ``model(ids[:, None], past_key_values=...)``."""
    backbone = model.model
    h = backbone.embed_tokens(input_ids)
    for block, state in zip(backbone.layers, cache.layers):
        h = h + block.mixer.decode_step(block.mixer_norm(h), state)
        if block.mlp is not None:
            h = h + block.mlp(block.mlp_norm(h))
    return model.lm_head(backbone.norm(h))


class StaticDecoder:
    """Prefill plus a replayable one-token step for a fixed batch size and length budget.

    ``max_length`` bounds prompt columns + new tokens (it sizes the KV caches of softmax layers
    and the output buffer). The buffers and the captured graph are reused by every call of
    :meth:`generate` with the same batch size and sampling settings.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        max_length: int,
        sampling: Sampling,
        mode: str = "graph",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = next(model.parameters()).device
        if mode != "eager" and device.type != "cuda":
            raise ValueError(f"mode {mode!r} needs a CUDA model (got {device}); use 'eager'")
        self.model = model
        self.mode = mode
        self.sampling = sampling
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        mixers = [block.mixer for block in model.model.layers]
        self.cache = StaticDecodeCache(mixers, batch_size, max_length, device)
        # Device-side loop state: the token fed to the next step, the output buffer and the
        # write position, per-row stop flags and the step at which each row emitted EOS.
        self.ids = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.out = torch.zeros(batch_size, max_length, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.finished_at = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.eos = torch.tensor(sampling.eos_token_ids, dtype=torch.long, device=device)
        self._step: Callable[[Tensor], Tensor] = lambda ids: decode_step(model, ids, self.cache)
        if mode == "compile":
            self._step = torch.compile(self._step, fullgraph=True, dynamic=False)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the last step's logits [B, V]

    def _emit(self, logits: Tensor) -> None:
        """Choose the next tokens, apply EOS stopping, append them to ``out`` (in place)."""
        nxt = choose_next(logits, self.sampling)
        if self.sampling.eos_token_ids:
            nxt = torch.where(self.finished, self.sampling.pad_token_id, nxt)
            newly = torch.isin(nxt, self.eos) & ~self.finished
            self.finished_at.copy_(torch.where(newly, self.position, self.finished_at))
            self.finished.logical_or_(newly)
        self.out.index_copy_(1, self.position, nxt[:, None])
        self.position.add_(1)
        self.ids.copy_(nxt)

    def _body(self) -> None:
        # In a captured graph this tensor is the graph's output buffer: after each replay it
        # holds that step's logits (read by the checks; generation only needs the tokens).
        self.logits = self._step(self.ids)
        self._emit(self.logits)

    def _capture(self) -> None:
        """Warm up (Triton/Inductor compilation, cuBLAS workspaces) on a side stream, then
        record one step. Warm-up writes garbage into the buffers; ``generate`` overwrites
        all of them before the first replay."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # Capture on the warm-up stream (cuBLAS keeps a workspace per stream). The plain graph
        # still failed to capture at batch 256 on an H100 (CUBLAS_STATUS_EXECUTION_FAILED);
        # the compiled step captures there. Not understood yet (benchmarks/NOTES.md).
        with torch.cuda.graph(self.graph, stream=stream):
            self._body()

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Run the prompt through the chunked kernels into the static cache; last logits."""
        if self.mode != "eager" and self.graph is None:
            self._capture()
        cache = DeltaFlowCache(len(self.cache))
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache.load(cache)
        return out.logits[:, -1]

    def step(self) -> None:
        """Decode one token for every row (graph replay, or the same ops eagerly)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        attention_mask: Tensor | None = None,
        check_every: int = 16,
    ) -> Tensor:
        """``[B, T + n]``: the prompt and n <= max_new_tokens new tokens (n < max_new_tokens
        only when every row has emitted EOS; rows that stopped earlier are padded).

        With EOS ids the host checks for "all rows stopped" every ``check_every`` tokens (one
        sync), so up to ``check_every - 1`` extra steps may run; they are cut off."""
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"input_ids has batch {B}, this decoder {self.batch_size}")
        columns = T + max_new_tokens
        if columns > self.max_length:
            raise ValueError(
                f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {columns} exceeds "
                f"max_length {self.max_length}"
            )
        if max_new_tokens <= 0:
            return input_ids
        logits = self.prefill(input_ids, attention_mask)
        self.position.zero_()
        self.finished.zero_()
        self.finished_at.fill_(max_new_tokens - 1)
        self._emit(logits)
        steps = 1
        while steps < max_new_tokens:
            self.step()
            steps += 1
            if self.sampling.eos_token_ids and steps % check_every == 0:
                if bool(self.finished.all()):
                    break
        n = steps
        if self.sampling.eos_token_ids and bool(self.finished.all()):
            n = int(self.finished_at.max()) + 1
        return torch.cat([input_ids, self.out[:, :n]], dim=1)


# ---------------------------------------------------------------------------- generate()


def _as_ids(value: int | list[int] | Tensor | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, Tensor):
        return tuple(int(x) for x in value.flatten().tolist())
    if isinstance(value, int):
        return (value,)
    return tuple(int(x) for x in value)


def _unsupported(config: Any) -> list[str]:
    from transformers import GenerationConfig

    default = GenerationConfig()
    bad = []
    for name in _UNSUPPORTED_SETTINGS:
        value, usual = getattr(config, name, None), getattr(default, name, None)
        if value != usual and (value or usual):  # None, False, 0 and [] all mean "off"
            bad.append(f"{name}={getattr(config, name)!r}")
    return bad


def default_modes(device: torch.device) -> tuple[str, ...]:
    """The static decode modes ``generate`` tries by default, in order (none: transformers)."""
    return ("compile", "graph") if device.type == "cuda" else ()


def static_generate(
    model: torch.nn.Module,
    inputs: Tensor | None,
    generation_config: Any,
    kwargs: dict[str, Any],
    mode: str | None,
) -> Tensor | None:
    """``model.generate`` through a :class:`StaticDecoder`, or None to let transformers run it.

    ``mode`` None: ``compile`` (falling back to ``graph``) on CUDA when every setting is
    supported, else None. An explicit
    mode runs the static decoder or raises a ValueError naming what it does not support.
    """
    if mode is not None and mode not in MODES + ("transformers",):
        raise ValueError(f"decode_mode must be None, 'transformers' or one of {MODES}")
    if mode == "transformers":
        return None
    device = next(model.parameters()).device
    if mode is None and not default_modes(device):
        return None  # on CPU transformers' loop with the dynamic cache stays the default
    config = copy.deepcopy(
        generation_config if generation_config is not None else model.generation_config
    )
    rest = config.update(**kwargs)
    input_ids = inputs if inputs is not None else rest.pop("input_ids", None)
    attention_mask = rest.pop("attention_mask", None)
    rest.pop("use_cache", None)
    problems = _unsupported(config)
    problems += [f"{k}=..." for k, v in rest.items() if v is not None]
    if getattr(model.config, "position_embedding", "rope") != "rope":
        # the one-token step (decode_step) adds no learned position: transformers' loop does
        problems.append(f"position_embedding={model.config.position_embedding!r}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        problems.append("input_ids must be a [B, T] tensor with T >= 1 (no inputs_embeds)")
    if problems:
        if mode is None:
            return None
        raise ValueError(f"decode_mode={mode!r} does not support: {', '.join(problems)}")
    T = input_ids.shape[1]
    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
    else:
        max_new_tokens = config.max_length - T
    eos = _as_ids(config.eos_token_id)
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # what transformers does (with a warning)
    do_sample = bool(config.do_sample)
    if not do_sample:  # greedy: the sampling knobs are ignored (as in transformers)
        config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0
    sampling = Sampling(
        do_sample=do_sample,
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=int(config.top_k or 0),
        top_p=float(config.top_p if config.top_p is not None else 1.0),
        eos_token_ids=eos,
        pad_token_id=pad,
    )
    if max_new_tokens <= 0:
        return input_ids
    B, columns = input_ids.shape[0], T + max_new_tokens
    if mode is not None:
        decoder = get_decoder(model, B, columns, sampling, mode)
        return decoder.generate(input_ids, max_new_tokens, attention_mask=attention_mask)
    # Default: the compiled step, 2.8x faster per token than the plain graph on an H100
    # (benchmarks/results/generation_*), at the price of a first call that compiles (~10-50 s,
    # cached on disk by Inductor). Where compilation or capture fails, the next path takes over:
    # the plain graph, then transformers' loop (None).
    for fallback in default_modes(device):
        try:
            decoder = get_decoder(model, B, columns, sampling, fallback)
            return decoder.generate(input_ids, max_new_tokens, attention_mask=attention_mask)
        except Exception as err:  # noqa: BLE001 - any compiler/capture failure: say why, go on
            model.__dict__["_static_decoder"] = None
            warnings.warn(
                f"deltaflow generate: decode mode {fallback!r} failed ({type(err).__name__}: "
                f"{str(err)[:300]}); trying the next one",
                stacklevel=3,
            )
    return None


def get_decoder(
    model: torch.nn.Module, batch_size: int, columns: int, sampling: Sampling, mode: str
) -> StaticDecoder:
    """The model's cached decoder when it fits (same batch, sampling, mode, enough columns),
    else a new one (the old one is dropped: one decoder's buffers and graph at a time)."""
    max_length = -(-columns // _BUCKET) * _BUCKET
    decoder: StaticDecoder | None = model.__dict__.get("_static_decoder")
    if (
        decoder is None
        or decoder.batch_size != batch_size
        or decoder.sampling != sampling
        or decoder.mode != mode
        or decoder.max_length < columns
        or decoder.device != next(model.parameters()).device
    ):
        model.__dict__["_static_decoder"] = None
        decoder = StaticDecoder(model, batch_size, max_length, sampling, mode)
        model.__dict__["_static_decoder"] = decoder
    return decoder
