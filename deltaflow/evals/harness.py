"""lm-evaluation-harness model class ``deltaflow``: any lm-eval task on a deltaflow model.

    deltaflow eval runs/lm --lm-eval hellaswag,lambada_openai          # from the deltaflow CLI
    deltaflow-lm-eval --model deltaflow --model_args pretrained=runs/lm --tasks lambada_openai
    python -m deltaflow.evals --model deltaflow --model_args pretrained=runs/lm ...

``deltaflow-lm-eval`` (``python -m deltaflow.evals``) is lm-eval's own command line, every
``lm_eval`` flag (``--device``, ``--batch_size``, ``--limit``, ...), with this class
registered. lm-eval finds out-of-tree model classes only once they are imported (it has no
plugin entry point), so a plain ``lm_eval --model deltaflow`` works only in a Python process
that has imported ``deltaflow.evals.harness`` (``lm_eval.simple_evaluate(model="deltaflow")``).

Model arguments (``--model_args k=v,...``): ``pretrained`` (run folder, checkpoint folder or
exported Hugging Face folder), ``device`` (auto; lm-eval's ``--device``), ``batch_size``
(requests per forward, 8; lm-eval's ``--batch_size``),
``max_length`` (tokens of context, default the run's training length, else 2048),
``tokenizer`` (another tokenizer; it must fit the model's vocabulary), ``dtype`` (auto: bf16
on CUDA, fp32 on CPU).

Scoring packs a batch's requests into one row with ``cu_seqlens`` (each request restarts the
recurrent state: no padding, no cross-talk). Contexts are prefixed with the tokenizer's document
separator, as every training document was. Generation is greedy with the recurrent cache
(sampling when a task asks for it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "evaluation with lm-evaluation-harness needs the lm-eval package: pip install "
        "'deltaflow[eval]' (or pip install lm-eval)"
    ) from None

from deltaflow.evals.pretrained import load_pretrained

DEFAULT_MAX_LENGTH = 2048  # for exported folders, which do not record a training length


@register_model("deltaflow")
class DeltaFlowLM(TemplateLM):
    """A deltaflow language model behind lm-eval's ``LM`` interface (see the module doc)."""

    def __init__(
        self,
        pretrained: str,
        device: str | None = "auto",
        batch_size: int | str | None = 8,
        max_length: int | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_batch_size: int | None = None,  # lm-eval passes it for batch_size=auto; unused
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"unknown model_args {sorted(unknown)} for --model deltaflow; it takes "
                "pretrained, device, batch_size, max_length, tokenizer, dtype"
            )
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line defaults to cuda:0 even where there is no GPU
            warnings.warn(f"device {device!r} is not available: evaluating on cpu", stacklevel=2)
            device = "cpu"
        loaded = load_pretrained(pretrained, device=device or "auto", dtype=dtype)
        self.model = loaded.model
        self._tok = loaded.tokenizer
        if tokenizer is not None:
            from deltaflow.tasks.tokenizers import check_vocab_fits, get_tokenizer

            self._tok = get_tokenizer(str(tokenizer))
            check_vocab_fits(self._tok.vocab_size, self.model.config.vocab_size, str(tokenizer))
        self._device = next(self.model.parameters()).device
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8  # no automatic search: scoring packs requests, memory is predictable
        self._batch_size = int(batch_size)
        if self._batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._max_length = int(max_length or loaded.seq_len or DEFAULT_MAX_LENGTH)
        if self._max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")

    # ---------------------------------------------------------------- what lm-eval asks
    @property
    def eot_token_id(self) -> int:
        return self._tok.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self._tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        # documents were trained without special tokens inside; the separator comes first
        return list(self._tok.encode(string))

    def tok_decode(self, tokens: Sequence[int], **kw) -> str:
        return self._tok.decode(list(tokens))

    # ---------------------------------------------------------------- scoring
    @torch.no_grad()
    def _packed_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [len_i, V] of each sequence, all run in one packed row."""
        lengths = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], device=self.device)[None]
        cu = torch.tensor([0, *lengths], device=self.device).cumsum(0)
        logits = self.model(input_ids=ids, cu_seqlens=cu, use_cache=False).logits[0]
        return list(logits.float().split(lengths))

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        add_separator: bool = True,
        **kw,
    ) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy?)`` per request. ``add_separator``: start
        each context with the document separator, as every training document started."""
        sep = [self.eot_token_id]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # longest first: similar lengths share a forward, the slowest batch shows up early
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        bar = tqdm(total=len(requests), desc="scoring", disable=disable_tqdm)
        for lo in range(0, len(order), self.batch_size):
            batch = order[lo : lo + self.batch_size]
            inputs, targets = [], []
            for i in batch:
                _, context, continuation = requests[i]
                if add_separator and context[:1] != sep:
                    context = sep + context
                if len(continuation) > self.max_length:
                    raise ValueError(
                        f"a continuation of {len(continuation)} tokens exceeds max_length="
                        f"{self.max_length}; raise max_length in --model_args"
                    )
                whole = (context + continuation)[-(self.max_length + 1) :]
                inputs.append(whole[:-1])
                targets.append(continuation)
            for i, logits, target in zip(batch, self._packed_logits(inputs), targets):
                if not target:
                    results[i] = (0.0, True)
                    continue
                logprobs = F.log_softmax(logits[-len(target) :], dim=-1)
                want = torch.tensor(target, device=logprobs.device)
                score = float(logprobs.gather(1, want[:, None]).sum())
                greedy = bool((logprobs.argmax(-1) == want).all())
                results[i] = (score, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in windows of max_length with the separator first."""
        out = []
        for (text,) in tqdm([r.args for r in requests], desc="rolling", disable=disable_tqdm):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens(
                [(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True, add_separator=False
            )
            total = sum(s for s, _ in scores)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from deltaflow.lab.generate import sample

        out = []
        for context, gen_kwargs in tqdm(
            [r.args for r in requests], desc="generating", disable=disable_tqdm
        ):
            kw = dict(gen_kwargs)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", 256))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            do_sample = bool(kw.pop("do_sample", False)) and temperature > 0
            top_k, top_p = int(kw.pop("top_k", 0) or 0), float(kw.pop("top_p", 1.0) or 1.0)
            if kw:
                raise ValueError(f"generation arguments {sorted(kw)} are not supported")
            room = max(self.max_length - max_new, 1)
            ids = ([self.eot_token_id] + self.tok_encode(context))[-room:]
            prompt = torch.tensor([ids], device=self.device)
            if do_sample:
                tokens = sample(
                    self.model, prompt, max_new, temperature=temperature, top_k=top_k, top_p=top_p
                )
            else:
                tokens = self.model.generate_greedy(prompt, max_new, eos_token_id=self.eot_token_id)
            new = [t for t in tokens[0, len(ids) :].tolist() if t != self.eot_token_id]
            text = self.tok_decode(new)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out


# ---------------------------------------------------------------------------- running
def evaluate(
    pretrained: str,
    tasks: list[str],
    *,
    include_path: list[str] | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    device: str = "auto",
    max_length: int | None = None,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` on a deltaflow model; returns lm-eval's results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = DeltaFlowLM(
        pretrained=pretrained, device=device, batch_size=batch_size, max_length=max_length
    )
    manager = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        hint = " (add the folder of its YAML with --lm-eval-include)" if not include_path else ""
        raise ValueError(f"unknown lm-eval tasks {unknown}{hint}")
    # lm-eval prints progress lines to stdout; keep stdout for the results (--json)
    with contextlib.redirect_stdout(sys.stderr):
        results = simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=bootstrap_iters,
        )
    if results is None:  # pragma: no cover - only non-zero ranks get None
        raise RuntimeError("lm-eval returned no results")
    return results


def main() -> None:
    """``deltaflow-lm-eval``: lm-eval's command line with the ``deltaflow`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.argv[0] = "deltaflow-lm-eval"
    cli_evaluate()
