"""Small-MQAR probe on CPU (issue 33): how many steps an attention model needs to solve MQAR,
for the harness's Transformer and for a reference written after Zoology's attention model.

    python experiments/mqar_probe.py --model deltaflow:transformer --recipe harness
    python experiments/mqar_probe.py --model zoology --recipe zoology

``--model zoology``: a re-implementation (not Zoology's code) of Zoology's figure-2 attention
model as its configs build it: token + learned absolute position embeddings (dropout 0.1),
pre-LayerNorm blocks of one-head softmax attention with biases (attention dropout 0.1), no MLP
(Zoology's Identity state mixer, whose block still adds LayerNorm(residual) back into the
residual: kept), a final LayerNorm, the head tied to the embedding, normal(0, 0.02) init with
out-projections / sqrt(2 layers). ``--rope`` swaps the learned positions for RoPE;
``--prev-token`` adds a linear map of the previous token's embedding to every position (what a
short convolution gives the recurrent models: the first half of the induction circuit).
``--model deltaflow:VARIANT``: ``DeltaFlowForCausalLM`` with ``deltaflow.lab.presets.VARIANTS``
[VARIANT], 2 layers, ``--heads`` heads, ``--set key=json`` overrides.

Recipes: ``harness`` is mqar_512's TrainConfig (AdamW betas 0.9/0.95, weight decay 0.1 on
matrices only, clipping 1.0, 5% warmup, cosine to 0.1 lr: deltaflow's own param_groups and
lr_at); ``zoology`` is zoology/train.py's (weight decay 0.1 on every parameter, betas 0.9/0.999,
no clipping, no warmup, cosine to 0). Data: deltaflow's MQAR task, a fresh batch per step,
query-region filler 0 as Zoology's figure 2 (``--random-fill``: mqar_512's random tokens).
Prints the accuracy every ``--eval-every`` steps (512 validation examples) and the first step
at >= 0.99, where it stops.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaflow.layers.softmax_attention import apply_rope
from deltaflow.tasks.mqar import MQAR
from deltaflow.train.build import param_groups
from deltaflow.train.schedule import lr_at


class _Attention(nn.Module):
    """Causal softmax attention with biases and attention dropout (optionally RoPE)."""

    def __init__(self, width: int, heads: int, rope: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.rope, self.dropout = heads, rope, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        if self.rope:
            pos = torch.arange(T)[None]
            q, k = apply_rope(q, pos, 10000.0), apply_rope(k, pos, 10000.0)
        p = self.dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, dropout_p=p
        )
        return self.out_proj(o.transpose(1, 2).reshape(B, T, D))


class ZoologyAttentionLM(nn.Module):
    """The reference model (module docstring): returns logits [B, T, vocab]."""

    def __init__(
        self,
        vocab: int,
        seq_len: int,
        width: int,
        layers: int = 2,
        heads: int = 1,
        rope: bool = False,
        prev_token: bool = False,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.positions = None if rope else nn.Embedding(seq_len, width)
        self.prev = nn.Linear(width, width, bias=False) if prev_token else None
        self.drop = nn.Dropout(dropout)
        self.attn = nn.ModuleList(_Attention(width, heads, rope, dropout) for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.norm_f = nn.LayerNorm(width)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for a in self.attn:
            nn.init.normal_(a.out_proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.prev is not None:
            h = h + self.prev(F.pad(h, (0, 0, 1, 0))[:, :-1])  # token t-1's embedding at t
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1]))[None]
        h = self.drop(h)
        for attn, n1, n2 in zip(self.attn, self.norm1, self.norm2):
            h = h + attn(n1(h))
            h = h + n2(h)  # Zoology's block with an Identity state mixer adds LN(residual)
        return self.norm_f(h) @ self.embed.weight.T


def build(args: argparse.Namespace, vocab: int) -> nn.Module:
    if args.model == "zoology":
        return ZoologyAttentionLM(
            vocab,
            args.seq,
            args.width,
            heads=args.heads,
            rope=args.rope,
            prev_token=args.prev_token,
        )
    from deltaflow.lab.presets import VARIANTS, check_variants
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    variant = args.model.removeprefix("deltaflow:")
    check_variants([variant], "--model")
    model = {"hidden_size": args.width, "num_layers": 2, "num_heads": args.heads}
    model.update(VARIANTS[variant])
    if model.get("position_embedding") == "learned":
        model["max_position_embeddings"] = args.seq
    for item in args.set:
        key, _, value = item.partition("=")
        model[key] = json.loads(value)
    return DeltaFlowForCausalLM(DeltaFlowConfig(vocab_size=vocab, **model))


def optimizer(model: nn.Module, recipe: str) -> torch.optim.AdamW:
    if recipe == "zoology":  # torch AdamW on model.parameters(): every parameter decays
        return torch.optim.AdamW(model.parameters(), weight_decay=0.1, betas=(0.9, 0.999))
    return torch.optim.AdamW(param_groups(model, 0.1), betas=(0.9, 0.95))


@torch.no_grad()
def accuracy(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    out = model(batch["input_ids"])
    logits = out.logits if hasattr(out, "logits") else out
    scored = batch["labels"] != -100
    right = (logits.argmax(-1) == batch["labels"]) & scored
    model.train()
    return right.sum().item() / scored.sum().item()


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoology", help="zoology | deltaflow:VARIANT")
    ap.add_argument("--recipe", default="zoology", choices=["zoology", "harness"])
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--random-fill", action="store_true", help="mqar_512's filler tokens")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--rope", action="store_true", help="zoology model: RoPE, no positions")
    ap.add_argument("--prev-token", action="store_true", help="zoology model: t-1's embedding")
    ap.add_argument("--set", action="append", default=[], help="deltaflow model key=json")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = MQAR(
        args.seq,
        args.pairs,
        vocab_size=args.vocab,
        random_non_queries=args.random_fill,
        seed=args.seed,
    )
    model = build(args, args.vocab)
    opt = optimizer(model, args.recipe)
    harness = args.recipe == "harness"
    warmup = max(1, args.steps // 20) if harness else 0
    valid = task.eval_set("valid", 512)
    curve: list[tuple[int, float]] = []
    solved = None
    start = time.time()
    for step in range(args.steps):
        lr = lr_at(
            step,
            base_lr=args.lr,
            total_steps=args.steps,
            warmup_steps=warmup,
            min_lr_ratio=0.1 if harness else 0.0,
        )
        for group in opt.param_groups:
            group["lr"] = lr
        batch = task.get_batch(args.batch, "train", step)
        out = model(batch["input_ids"])
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if harness:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = accuracy(model, valid)
            curve.append((step + 1, round(acc, 3)))
            print(f"step {step + 1} loss {loss.item():.3f} accuracy {acc:.3f}", flush=True)
            if acc >= 0.99:
                solved = step + 1
                break
    result = {"args": vars(args), "curve": curve, "solved_at": solved}
    print(f"steps to 0.99: {solved} ({time.time() - start:.0f} s) {json.dumps(result)}")
    return result


if __name__ == "__main__":
    main()
