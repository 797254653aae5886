"""Models: cached decoding, padding, generation, save/load, Auto classes, loss, init, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _inputs import rule_variants
from transformers import AutoConfig, AutoModelForCausalLM

from deltaflow.layers import DeltaFlowCache
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

TOL = 1e-4
V = 61  # odd vocabulary size


pytestmark = pytest.mark.usefixtures("seed_and_one_thread")  # conftest.py


def tiny(**kwargs) -> DeltaFlowForCausalLM:
    cfg = dict(
        vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, chunk_size=8, backend="torch"
    )
    cfg.update(kwargs)
    return DeltaFlowForCausalLM(DeltaFlowConfig(**cfg)).eval()


def step_logits(model, ids, mask=None, prefix: int = 0):
    """Logits from a prefill of ``prefix`` tokens then one token per call with a cache."""
    cache, outs = DeltaFlowCache(model.config.num_layers), []
    with torch.no_grad():
        if prefix:
            m = None if mask is None else mask[:, :prefix]
            outs.append(
                model(
                    ids[:, :prefix], attention_mask=m, past_key_values=cache, use_cache=True
                ).logits
            )
        for t in range(prefix, ids.shape[1]):
            m = None if mask is None else mask[:, : t + 1]  # transformers-style growing mask
            out = model(ids[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
            outs.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    return torch.cat(outs, 1)


MODEL_VARIANTS = [
    *rule_variants(),  # every rule of RULES
    dict(mixer_types=["attention", "attention"]),
    dict(mixer_types=["sliding_attention", "delta"], sliding_window=3, use_decay=True),
    dict(rule="efla", attn_every=2, num_v_heads=4, negative_eigenvalues=True, attn_num_kv_heads=1),
]


@pytest.mark.parametrize("kwargs", MODEL_VARIANTS, ids=lambda k: "-".join(map(str, k.values())))
def test_full_equals_cached_decoding_and_padded_batches(kwargs):
    model = tiny(**kwargs)
    T = 19
    ids = torch.randint(0, V, (2, T))
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(step_logits(model, ids), full, atol=TOL, rtol=0)
    torch.testing.assert_close(step_logits(model, ids, prefix=7), full, atol=TOL, rtol=0)

    # Row 0 left-padded by 4, row 1 right-padded by 4; pad ids are random real tokens.
    padded = torch.randint(0, V, (2, T + 4))
    padded[0, 4:], padded[1, :T] = ids[0], ids[1]
    mask = torch.ones(2, T + 4, dtype=torch.long)
    mask[0, :4], mask[1, T:] = 0, 0
    with torch.no_grad():
        out = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(out[0, 4:], full[0], atol=TOL, rtol=0)
    torch.testing.assert_close(out[1, :T], full[1], atol=TOL, rtol=0)
    # Left-padded prefill, then decoding with the growing mask (what generate() does).
    left = padded.clone()
    left[1, 4:], left[1, :4] = ids[1], padded[1, :4]
    lmask = torch.ones_like(mask)
    lmask[:, :4] = 0
    dec = step_logits(model, left, mask=lmask, prefix=9)
    torch.testing.assert_close(dec[:, 4:], full, atol=TOL, rtol=0)


def _greedy_by_full_forwards(model, ids, n):
    for _ in range(n):
        with torch.no_grad():
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


@pytest.mark.parametrize(
    "kwargs", [dict(rule="delta", use_decay=True, attn_every=2), dict(rule="kaczmarz")]
)
def test_greedy_generation_matches_full_forwards(kwargs):
    model = tiny(**kwargs)
    ids = torch.randint(0, V, (2, 6))
    ref = _greedy_by_full_forwards(model, ids, 8)
    assert torch.equal(model.generate_greedy(ids, 8), ref)

    # transformers' generate() must run prefill once, then one token per call.
    lengths = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: lengths.append(args[0].shape[1])
    )
    try:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
    assert torch.equal(out, ref)
    assert lengths == [6] + [1] * 7
    # A prompt given as embeddings: transformers then returns only the new tokens.
    embeds = model.get_input_embeddings()(ids)
    out = model.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref[:, 6:])


def test_the_cache_goes_by_either_name_and_the_output_uses_the_installed_ones(recwarn, capfd):
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: both names are accepted, the
    output carries the cache under the installed transformers' field, and nothing warns."""
    from deltaflow.models.modeling import CACHE_FIELD, output_cache

    model = tiny(rule="delta", attn_every=2)
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        by_old, by_new = DeltaFlowCache(2), DeltaFlowCache(2)
        a = model(ids[:, :5], past_key_values=by_old, use_cache=True)
        b = model(ids[:, :5], cache=by_new, use_cache=True)
        assert output_cache(a) is by_old and output_cache(b) is by_new
        assert CACHE_FIELD in a.keys()
        a = model(ids[:, 5:], past_key_values=by_old, use_cache=True).logits
        b = model(ids[:, 5:], cache=by_new, use_cache=True).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(ValueError, match="cache= or past_key_values=, not both"):
            model(ids, cache=DeltaFlowCache(2), past_key_values=DeltaFlowCache(2), use_cache=True)
        longer = torch.cat([ids, ids[:, :1]], dim=1)  # generate() appended one token
        inputs = model.prepare_inputs_for_generation(longer, **{CACHE_FIELD: by_new})
        assert inputs[CACHE_FIELD] is by_new and torch.equal(inputs["input_ids"], ids[:, :1])
    err = capfd.readouterr().err
    assert "deprecated" not in err and not [w for w in recwarn if "deprecated" in str(w.message)]


def test_hf_beam_search_and_sampling_with_cache_match_no_cache():
    """Beam search reorders the cache (DeltaFlowCache.reorder_cache); results must not change."""
    model = tiny(use_decay=True, attn_every=2)
    ids = torch.randint(0, V, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    cached = model.generate(ids, **kw)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))
    torch.manual_seed(1)
    a = model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=2)
    torch.manual_seed(1)
    b = model.generate(
        ids, max_new_tokens=5, do_sample=True, num_return_sequences=2, use_cache=False
    )
    assert a.shape == (4, 10) and torch.equal(a, b)


def test_left_padded_batch_generation_matches_single_rows():
    model = tiny(rule="longhorn", use_decay=True, mixer_types=["delta", "attention"])
    a, b = torch.randint(0, V, (1, 7)), torch.randint(0, V, (1, 4))
    batch = torch.cat([a, torch.cat([torch.full((1, 3), 5), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = model.generate_greedy(batch, 6, attention_mask=mask)
    assert torch.equal(out[0:1], model.generate_greedy(a, 6))
    assert torch.equal(out[1:2, 3:], model.generate_greedy(b, 6))
    hf = model.generate(
        batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=5
    )
    assert torch.equal(hf, out)


def test_generate_greedy_eos_and_zero_tokens():
    model = tiny()
    ids = torch.randint(0, V, (2, 5))
    assert torch.equal(model.generate_greedy(ids, 0), ids)
    first = model.generate_greedy(ids, 1)[:, -1]
    out = model.generate_greedy(ids, 5, eos_token_id=int(first[0]))
    assert (out[0, 5:] == first[0]).all()  # row 0 finished at once and is padded with eos


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_and_auto_classes(tmp_path, tie):
    model = tiny(
        rule="efla", use_decay=True, attn_every=2, tie_word_embeddings=tie, qk_norm=["l2", "l2"]
    )
    ids = torch.randint(0, V, (2, 11))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, DeltaFlowForCausalLM)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "deltaflow" and cfg.mixer_types == ["delta", "attention"]
    assert cfg.qk_norm == ["l2", "l2"] and cfg.rule == "efla" and cfg.use_decay
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    fresh = AutoModelForCausalLM.from_config(model.config)
    assert isinstance(fresh, DeltaFlowForCausalLM)


def test_gradients_reach_every_parameter():
    model = tiny(
        rule="delta", use_decay=True, attn_every=2, num_layers=4, num_v_heads=4,
        tie_word_embeddings=False, attn_qk_norm=True,
    )  # fmt: skip
    model.train()
    ids = torch.randint(0, V, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny(use_decay=True, attn_every=2).train()
    ids = torch.randint(0, V, (2, 10))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # transformers renamed it (the old name warns from 5.2x on); the GPU image's 5.17 has only it
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable()
    assert model.model.gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_lean_loss_equals_plain_loss_and_gradients(tied, packed):
    """Training mode uses the chunked linear cross-entropy; same loss and gradients."""
    model = tiny(use_decay=True, tie_word_embeddings=tied).train()
    model.loss_chunk_size = 5  # does not divide B * T
    if packed:
        ids, cu = torch.randint(0, V, (1, 14)), torch.tensor([0, 4, 4, 9, 14])
        labels = ids
    else:
        ids, cu = torch.randint(0, V, (2, 9)), None
        labels = ids.clone()
        labels[0, 2:5] = -100

    def run(fuse: bool):
        model.zero_grad()
        out = model(ids, labels=labels, cu_seqlens=cu, fuse_linear_cross_entropy=fuse)
        assert (out.logits is None) == fuse
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = run(True)
    ref_loss, ref_grads = run(False)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    assert model.lm_head.weight.grad.abs().sum() > 0  # tied: named model.embed_tokens.weight
    # Eval mode keeps the logits (the default follows model.training) unless asked otherwise.
    model.eval()
    assert model(ids, labels=labels, cu_seqlens=cu).logits is not None
    model.config.fuse_linear_cross_entropy = True
    assert model(ids, labels=labels, cu_seqlens=cu).logits is None
    all_ignored = model(ids, labels=torch.full_like(ids, -100), cu_seqlens=cu).loss
    assert all_ignored.item() == 0.0


def test_loss_conventions():
    model = tiny()
    ids = torch.randint(0, V, (3, 9))
    with torch.no_grad():
        out = model(ids, labels=ids)
        ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, ref)
        # Aligned labels (the training harness): y[t] is the target of position t.
        y = torch.full_like(ids, -100)
        y[:, :-1] = ids[:, 1:]
        torch.testing.assert_close(model(ids, labels=y, labels_are_shifted=True).loss, ref)
        model.config.labels_are_shifted = True
        torch.testing.assert_close(model(ids, labels=y).loss, ref)
        model.config.labels_are_shifted = False
        # ignore_index, and an all-ignored batch gives 0 instead of NaN.
        y[1] = -100
        keep = y[:, :-1] != -100
        ref2 = F.cross_entropy(out.logits[:, :-1][keep], y[:, :-1][keep])
        torch.testing.assert_close(model(ids, labels=y, labels_are_shifted=True).loss, ref2)
        zero = model(ids, labels=torch.full_like(ids, -100), labels_are_shifted=True).loss
        assert zero.item() == 0.0
        last = model(ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, out.logits[:, -1:])


def test_init_parameter_count_and_flops():
    model = tiny(num_layers=4, hidden_size=64, vocab_size=128, attn_every=2, use_decay=True)
    std = 0.02
    emb = model.model.embed_tokens.weight
    assert abs(emb.std().item() - std) < 0.002
    layer0 = model.model.layers[0]
    assert abs(layer0.mlp.gate_proj.weight.std().item() - std) < 0.003
    scaled = std / math.sqrt(2 * 4)
    for w in (layer0.mixer.o_proj.weight, layer0.mlp.down_proj.weight):
        assert abs(w.std().item() - scaled) < 0.002
    assert torch.equal(layer0.mixer_norm.weight, torch.ones(64))
    n = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == n
    assert model.num_parameters(exclude_embeddings=True) < n
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    f = model.estimate_flops_per_token(256, training=False)
    assert f > 2 * linear  # dense matmuls plus the mixers' sequence work
    assert model.estimate_flops_per_token(256) == pytest.approx(3 * f)
    assert model.estimate_flops_per_token(1024) > f  # attention grows with context


def test_hybrid_spec_and_config_round_trip():
    cfg = DeltaFlowConfig(num_layers=8, attn_every=4)
    assert cfg.mixer_types == ["delta"] * 3 + ["attention"] + ["delta"] * 3 + ["attention"]
    assert DeltaFlowConfig(num_layers=2, layer_types=["attention", "delta"]).mixer_types == [
        "attention",
        "delta",
    ]
    again = DeltaFlowConfig.from_dict(cfg.to_dict())
    assert again.mixer_types == cfg.mixer_types and again.attn_every == 4
    assert cfg.num_hidden_layers == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rule="newton"), "unknown rule"),
        (dict(hidden_size=30, num_heads=4), "divisible"),
        (dict(num_layers=2, mixer_types=["delta"]), "entries"),
        (dict(num_layers=2, mixer_types=["delta", "mamba"]), "mixer_types entries"),
        (dict(num_layers=4, attn_every=2, mixer_types=["delta"] * 4), "contradicts"),
        (dict(num_layers=2, mixer_types=["sliding_attention", "delta"]), "sliding_window"),
        (dict(beta_activation="tanh"), "beta_activation"),
        (dict(qk_norm="rms"), "qk_norm"),
        (dict(num_heads=2, num_v_heads=3), "num_v_heads"),
        (dict(attn_every=2, attn_num_heads=4, attn_num_kv_heads=3), "attn_num_kv_heads"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(chunk_size=24), "chunk_size"),
        (dict(backend="gpu"), "backend"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeltaFlowConfig(**kwargs)


def test_bad_forward_inputs_raise():
    model = tiny()
    ids = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(ValueError, match="input_ids must be"):
        model(ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="labels must be"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(TypeError, match="DeltaFlowCache"):
        model(ids, past_key_values=((1, 2),), use_cache=True)
    with pytest.raises(TypeError, match="unexpected"):
        model(ids, foo=1)
    with pytest.raises(ValueError, match="no tokens"):
        model(ids[:, :0])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rule="delta", use_decay=True),
        dict(rule="kaczmarz"),
        dict(rule="efla", attn_every=2, sliding_window=3, num_v_heads=4),
        dict(mixer_types=["attention", "sliding_attention"], sliding_window=3),
    ],
    ids=["gated_delta", "kaczmarz", "efla_hybrid", "attention"],
)
def test_packed_documents_equal_separate_runs(kwargs):
    """cu_seqlens: logits, loss and gradients as if each document ran alone."""
    model = tiny(chunk_size=4, **kwargs).train()
    lens = [5, 1, 0, 9, 3]  # an empty and a one-token document included
    docs = [torch.randint(0, V, (1, n)) for n in lens]
    packed = torch.cat(docs, 1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out = model(packed, cu_seqlens=cu, labels=packed)
    assert out.logits is None  # training with labels: the lean loss, no logits
    ref = torch.cat([model(d).logits for d in docs if d.shape[1]], 1)
    torch.testing.assert_close(model(packed, cu_seqlens=cu).logits, ref, atol=TOL, rtol=0)
    # Unshifted labels: mean over within-document next-token predictions only.
    total = sum(
        F.cross_entropy(model(d).logits[0, :-1], d[0, 1:], reduction="sum")
        for d in docs
        if d.shape[1] > 1
    )
    ref_loss = total / sum(max(n - 1, 0) for n in lens)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), allow_unused=True)
    for g, r in zip(grads, ref_grads):
        if r is not None:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_packed_documents_bad_inputs():
    model = tiny()
    ids = torch.randint(0, V, (1, 8))
    with pytest.raises(ValueError, match="batch size 1"):
        model(ids.expand(2, 8), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="start at 0"):
        model(ids, cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(ValueError, match="never decrease"):
        model(ids, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="integer"):
        model(ids, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="cannot be combined"):
        model(ids, cu_seqlens=torch.tensor([0, 8]), use_cache=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_hidden_layers=2),
        dict(num_hidden_layers=3, num_attention_heads=2, attn_every=3),
        dict(num_hidden_layers=2, layer_types=["attention", "delta"]),
        dict(num_hidden_layers=1, num_attention_heads=8, rms_norm_eps=1e-6, intermediate_size=40),
    ],
)
def test_conventional_names_build_save_and_reload_the_same_model(tmp_path, kwargs):
    """AutoConfig.for_model with the transformers names: everything derived from the layer
    count follows it, and the saved model reloads with identical logits."""
    cfg = AutoConfig.for_model("deltaflow", vocab_size=V, hidden_size=32, **kwargs)
    n_layers = kwargs["num_hidden_layers"]
    assert cfg.num_layers == cfg.num_hidden_layers == n_layers
    assert len(cfg.mixer_types) == n_layers
    assert cfg.num_heads == cfg.num_attention_heads == kwargs.get("num_attention_heads", 4)
    assert cfg.norm_eps == cfg.rms_norm_eps == kwargs.get("rms_norm_eps", 1e-5)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert len(model.model.layers) == n_layers
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer_types == cfg.mixer_types and loaded.config.num_layers == n_layers
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_conventional_name_contradicting_the_native_one_raises():
    with pytest.raises(ValueError, match="num_hidden_layers=2 is an alias of num_layers"):
        DeltaFlowConfig(num_layers=3, num_hidden_layers=2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        DeltaFlowConfig(num_heads=2, num_attention_heads=8)
    assert DeltaFlowConfig(num_layers=3, num_hidden_layers=3).num_layers == 3


def test_a_folder_that_does_not_match_its_config_is_one_error_naming_the_tensors(tmp_path):
    """Issue 34 item 9: a wrong-shape tensor, an edited hidden_size or no config.json raised
    transformers' "look at the above report!" instead of the ValueError naming the tensors."""
    import json

    from safetensors.torch import load_file, save_file

    model = tiny()
    folders = {name: tmp_path / name for name in ("shape", "hidden", "noconfig")}
    for folder in folders.values():
        model.save_pretrained(folder)
    weights = load_file(folders["shape"] / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, folders["shape"] / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folders["hidden"] / "config.json").read_text())
    config["hidden_size"] *= 2
    (folders["hidden"] / "config.json").write_text(json.dumps(config))
    (folders["noconfig"] / "config.json").unlink()
    for load in (DeltaFlowForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=r"wrong shape model\.norm\.weight\);"):
            load(folders["shape"])
        with pytest.raises(ValueError, match=r"wrong shape model\.embed_tokens\.weight, .* more"):
            load(folders["hidden"])
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        DeltaFlowForCausalLM.from_pretrained(folders["noconfig"])
    loaded = DeltaFlowForCausalLM.from_pretrained(folders["shape"], strict=False)
    assert loaded.model.norm.weight.shape == model.model.norm.weight.shape  # re-initialised


def test_labels_outside_the_vocabulary_are_a_value_error():
    """Issue 34 item 12: labels >= vocab_size gave a raw IndexError from the loss."""
    model = tiny()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"labels must be token ids in \[0, vocab_size={V}\)"):
        model(input_ids=ids, labels=torch.full((1, 4), V))
    model(input_ids=ids, labels=torch.tensor([[1, -100, 2, -100]]))  # -100: not scored


def test_token_ids_checked_on_the_host_batch():
    """Issue 31: the trainer checks its CPU batch's ids itself (no GPU sync) and runs the model
    inside token_ids_checked, where the model's own check (a host sync each on a GPU) is
    skipped; the errors are the model's."""
    from deltaflow.models.modeling import (
        check_batch_token_ids,
        check_token_ids,
        token_ids_checked,
    )

    model = tiny()
    ids, bad = torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), V)
    assert check_batch_token_ids(model, ids, torch.tensor([[1, -100, 2, -100]]))
    with pytest.raises(ValueError, match=rf"labels must be token ids in \[0, vocab_size={V}\)"):
        check_batch_token_ids(model, ids, bad)
    with pytest.raises(ValueError, match=r"input_ids must be token ids"):
        check_batch_token_ids(model, bad, ids)
    assert not check_batch_token_ids(torch.nn.Linear(2, 2), bad, bad)  # not ours: not checked
    with token_ids_checked():
        check_token_ids(bad, V)  # the caller vouched for them
        with pytest.raises(TypeError):  # the dtype is still checked
            check_token_ids(bad.float(), V)
    with pytest.raises(ValueError):
        check_token_ids(bad, V)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("use_decay", [False, True])
def test_cpu_bf16_autocast_forward_backward_near_fp32(T, packed, use_decay):
    """A delta model under CPU bf16 autocast (the trainer's precision='bf16' on a CPU): the
    backward failed in the op ("expected scalar type Float but found BFloat16"). Now loss and
    gradients are finite and within bf16's rounding of the fp32 run; plain and packed rows."""
    model = tiny(use_decay=use_decay).train()
    ids = torch.randint(0, V, (1, T))
    targets = torch.randint(0, V, (1, T))
    cu = torch.tensor([0, T // 3, T]) if packed else None  # T=1: an empty first document
    losses, grads = [], []
    for autocast in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids, cu_seqlens=cu).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert math.isfinite(losses[1]) and torch.isfinite(grads[1]).all()
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert (grads[1] - grads[0]).norm() <= 3e-2 * grads[0].norm()
