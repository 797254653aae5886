"""Zoology's MQAR attention as a DeltaFlow model (issue 33): learned absolute positions
instead of RoPE (``position_embedding='learned'``), blocks without the MLP (``use_mlp=False``),
and the preset that trains it under Zoology's protocol (``mqar_512_zoology``).

Learned positions must count real tokens as RoPE does (left padding, packed documents, a cache
continued with transformers' whole mask) and refuse what they cannot express; every new field
is refused when misspelled or mistyped. CPU, float64, tiny models.
"""

from __future__ import annotations

import pytest
import torch

from deltaflow.lab import expand_grid, get_preset
from deltaflow.lab.presets import VARIANTS
from deltaflow.layers import DeltaFlowCache
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.train import TrainConfig, build_model, build_task

V = 37
pytestmark = pytest.mark.usefixtures("seed_and_one_thread")  # conftest.py


def tiny(**kwargs) -> DeltaFlowForCausalLM:
    cfg = dict(vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, attn_every=1)
    cfg.update(kwargs)
    return DeltaFlowForCausalLM(DeltaFlowConfig(**cfg)).double().eval()


def zoology(**kwargs) -> DeltaFlowForCausalLM:
    model = VARIANTS["transformer_zoology"]
    return tiny(**{**model, "max_position_embeddings": 24, **kwargs})


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(position_embedding="rotary"), "position_embedding must be one of"),
        (dict(position_embedding="learned"), "max_position_embeddings must be a positive"),
        (dict(position_embedding="learned", max_position_embeddings=0), "positive int"),
        (dict(max_position_embeddings=64), "give it with position_embedding='learned' only"),
        (dict(use_mlp="no"), "use_mlp"),
        (dict(use_mlpp=False), "use_mlpp"),  # a misspelt field never builds the default model
        (dict(max_positions=64), "max_positions"),
    ],
)
def test_bad_values_and_misspelt_fields_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DeltaFlowConfig(vocab_size=V, hidden_size=16, num_layers=1, **kwargs)


def test_odd_head_dim_is_allowed_without_rope_only():
    DeltaFlowConfig(
        vocab_size=V,
        hidden_size=15,
        num_heads=1,
        attn_every=1,
        num_layers=1,
        position_embedding="learned",
        max_position_embeddings=8,
    )
    with pytest.raises(ValueError, match="even"):
        DeltaFlowConfig(vocab_size=V, hidden_size=15, num_heads=1, attn_every=1, num_layers=1)


# ------------------------------------------------------------------------------ model
def test_zoology_attention_has_learned_positions_one_head_no_rope_and_no_mlp():
    model = zoology()
    assert model.model.embed_positions.weight.shape == (24, 16)
    for block in model.model.layers:
        assert block.mlp is None and block.mlp_norm is None
        assert block.mixer.num_heads == 1 and not block.mixer.use_rope
    with_mlp = zoology(use_mlp=True)
    mlp = sum(p.numel() for b in with_mlp.model.layers for p in b.mlp.parameters())
    norms = sum(b.mlp_norm.weight.numel() for b in with_mlp.model.layers)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(with_mlp) - count(model) == mlp + norms


@torch.no_grad()
def test_positions_are_used_and_trained():
    model = zoology()
    ids = torch.randint(0, V, (2, 10))
    before = model(ids).logits
    model.model.embed_positions.weight[3].add_(1.0)  # only position 3 moves
    after = model(ids).logits
    torch.testing.assert_close(after[:, :3], before[:, :3])  # causal: earlier tokens unchanged
    assert not torch.allclose(after[:, 3:], before[:, 3:])
    with torch.enable_grad():
        model.train()
        model(ids, labels=ids).loss.backward()
    grad = model.model.embed_positions.weight.grad  # position 9 predicts nothing (shifted)
    assert grad[:9].abs().sum(1).gt(0).all() and grad[9:].abs().sum() == 0


@torch.no_grad()
def test_left_padding_and_packing_see_the_unpadded_positions():
    model = zoology()
    a, b = torch.randint(0, V, (1, 7)), torch.randint(0, V, (1, 5))
    alone_a, alone_b = model(a).logits, model(b).logits
    # left-padded b: its real tokens sit at positions 0..4, as alone
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), b], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    out = model(torch.cat([a, padded]), attention_mask=torch.cat([torch.ones_like(mask), mask]))
    torch.testing.assert_close(out.logits[0], alone_a[0])
    torch.testing.assert_close(out.logits[1, 2:], alone_b[0])
    # packed: positions restart in the second document
    packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 7, 12])).logits
    torch.testing.assert_close(packed[0, 7:], alone_b[0])


@torch.no_grad()
def test_a_cache_continues_the_positions_and_generate_agrees():
    model = zoology()
    ids = torch.randint(0, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    full = model(ids, attention_mask=mask).logits
    cache = DeltaFlowCache(model.config.num_layers)
    model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
    for t in range(6, 9):  # transformers' way: the mask of every token so far
        step = model(
            ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, 0]
        torch.testing.assert_close(step, full[:, t])
    # a [B, 1] mask after a padded prefix cannot say where the row's positions are
    with pytest.raises(ValueError, match="need the attention mask of all"):
        model(ids[:, :1], attention_mask=mask[:, :1], past_key_values=cache, use_cache=True)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    out = model.generate(ids, decode_mode="transformers", **kw)
    assert out.shape == (2, 14)
    # the static one-token step adds no learned position: refused, not silently wrong
    with pytest.raises(ValueError, match="position_embedding='learned'"):
        model.generate(ids, decode_mode="eager", **kw)


def test_positions_past_the_table_are_refused():
    model = zoology()
    with pytest.raises(ValueError, match="past the 24 learned positions"):
        model(torch.randint(0, V, (1, 25)))


@torch.no_grad()
def test_blocks_without_mlp_decode_like_the_full_forward():
    from deltaflow.models.generation import Sampling, StaticDecoder

    model = tiny(use_mlp=False, attn_every=2)  # delta layer then attention, no MLP, RoPE
    ids = torch.randint(0, V, (2, 6))
    decoder = StaticDecoder(model, 2, 16, Sampling(), mode="eager")
    got = decoder.generate(ids, 4)
    want = model.generate(ids, max_new_tokens=4, do_sample=False, decode_mode="transformers")
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------ preset
def test_zoology_preset_is_zoologys_data_and_recipe():
    specs = expand_grid(get_preset("mqar_512_zoology"), device="cpu")
    assert {s.variant for s in specs} == {
        "transformer_zoology",
        "transformer_zoology_mlp",
        "transformer",
        "linear_zoology",
        "deltanet",
    }
    assert sorted({s.lr for s in specs}) == [1e-4, 4.6e-4, 2.2e-3, 1e-2]
    cfg = specs[0].config
    assert (cfg.batch_size, cfg.warmup_steps, cfg.min_lr_ratio) == (128, 0, 0.0)
    assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.grad_clip) == (0.1, 0.9, 0.999, 0.0)
    kw = cfg.task_kwargs
    assert (kw["seq_len"], kw["num_kv_pairs"], kw["vocab_size"]) == (512, 64, 8192)
    assert kw["random_non_queries"] is False and kw["num_train_examples"] == 100_000
    # the query region's filler is token 0: only the keys asked for are non-zero there
    task = build_task(TrainConfig(task="mqar", task_kwargs={**kw, "num_train_examples": None}))
    batch = task.get_batch(4, "train", 0)
    region = batch["input_ids"][:, 128:]
    asked = batch["labels"][:, 128:] != -100
    assert (region[~asked] == 0).all() and (region[asked] > 0).all()
    # the variant builds Zoology's attention at the preset's length
    spec = next(s for s in specs if s.variant == "transformer_zoology" and s.width == 64)
    model = build_model(spec.config, 8192)
    assert model.config.max_position_embeddings == 512 and not model.config.use_mlp
    assert model.model.layers[0].mixer.num_heads == 1
    # with the MLP the figure's runs had: the same attention plus a block MLP of ~8 x width^2
    spec = next(s for s in specs if s.variant == "transformer_zoology_mlp" and s.width == 64)
    with_mlp = build_model(spec.config, 8192)
    assert with_mlp.config.use_mlp and with_mlp.model.layers[0].mixer.num_heads == 1
    extra = sum(p.numel() for p in with_mlp.parameters()) - sum(
        p.numel() for p in model.parameters()
    )
    assert extra == 2 * (3 * 64 * with_mlp.config.mlp_hidden_size + 64), extra  # SwiGLU + norm


@torch.no_grad()
def test_an_all_ones_step_mask_after_padding_is_refused_not_misread():
    model = zoology()
    ids = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    cache = DeltaFlowCache(model.config.num_layers)
    model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="need the attention mask of all 6 tokens"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1), past_key_values=cache, use_cache=True)
