"""Load a trained language model and its tokenizer for evaluation.

``path`` may be a run folder (its latest checkpoint), a checkpoint folder (``config.yaml`` +
``model.safetensors``, with the run's tokenizer in ``tokenizer/``), or an exported Hugging Face
folder (``config.json`` + weights + tokenizer files, read with ``from_pretrained``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Pretrained:
    model: Any  # DeltaFlowForCausalLM, in eval mode on its device
    tokenizer: Any  # a deltaflow tokenizer (deltaflow.tasks.tokenizers)
    seq_len: int | None  # the training length, when the folder records it
    source: Path  # the folder the weights came from


def load_pretrained(path: str | Path, device: str = "auto", dtype: str = "auto") -> Pretrained:
    """The model (eval mode, on ``device``, in ``dtype``: auto = bf16 on CUDA, else fp32) and
    its tokenizer; raises a one-line error for a non-LM checkpoint or a tokenizer that does not
    fit the model."""
    from deltaflow.models import DeltaFlowForCausalLM
    from deltaflow.tasks.tokenizers import check_vocab_fits, load_tokenizer, run_tokenizer
    from deltaflow.train import TrainConfig, build_model, load_checkpoint, resolve_checkpoint
    from deltaflow.train.dist import DistInfo, resolve_device

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pretrained not found: {path}")
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        model = DeltaFlowForCausalLM.from_pretrained(str(path))
        tokenizer_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else path
        tokenizer = load_tokenizer(tokenizer_dir)
        seq_len, source = None, path
    else:
        source = resolve_checkpoint(path)
        config = TrainConfig.from_yaml(source / "config.yaml")
        if config.task != "lm":
            raise ValueError(
                f"{source} is a {config.task!r} checkpoint; evaluating text needs a language "
                "model (a run of task 'lm')"
            )
        tokenizer = run_tokenizer(source, config.task_kwargs)
        model = build_model(config, tokenizer.vocab_size)
        load_checkpoint(source, model=model, restore_rng=False)
        seq_len = int(config.task_kwargs.get("seq_len", 512))  # LanguageModeling's default
    check_vocab_fits(tokenizer.vocab_size, model.config.vocab_size, str(source))
    device_t = resolve_device(device, DistInfo())
    if dtype == "auto":
        dtype = "bfloat16" if device_t.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float64"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float64', got {dtype!r}")
    model = model.to(device=device_t, dtype=getattr(torch, dtype)).eval()
    return Pretrained(model=model, tokenizer=tokenizer, seq_len=seq_len, source=source)
