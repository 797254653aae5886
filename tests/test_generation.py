"""Static decode cache and the graph-ready decoder, on CPU (eager mode).

The static step must give the logits of the dynamic-cache step and of the full forward, for
every rule, hybrids with (sliding) attention and left-padded batches; ``generate`` through it
must give transformers' tokens. The CUDA-graph replay of the same step is checked on the GPU by
``benchmarks/generation.py --check``.
"""

from __future__ import annotations

import pytest
import torch
from _inputs import rule_variants
from transformers.generation.logits_process import TopPLogitsWarper

from deltaflow.layers import DeltaFlowCache
from deltaflow.layers.cache import StaticDecodeCache
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.models.generation import (
    Sampling,
    StaticDecoder,
    choose_next,
    decode_step,
    top_p_filter,
)

V = 53

VARIANTS = [
    *rule_variants(),  # every rule of RULES
    dict(rule="delta", negative_eigenvalues=True, use_decay=True),
    dict(rule="delta", use_short_conv=False, use_output_gate=False),
    dict(mixer_types=["delta", "attention", "sliding_attention"], sliding_window=4),
    dict(rule="efla", attn_every=2, num_v_heads=4, attn_num_kv_heads=1, num_layers=4),
]


pytestmark = pytest.mark.usefixtures("seed_and_one_thread")  # conftest.py


def tiny(**kwargs) -> DeltaFlowForCausalLM:
    cfg = dict(vocab_size=V, hidden_size=32, num_heads=2, chunk_size=8, backend="torch")
    cfg.update(kwargs)
    cfg.setdefault("num_layers", len(cfg.get("mixer_types") or "abc"))
    return DeltaFlowForCausalLM(DeltaFlowConfig(**cfg)).double().eval()


def padded_prompt(B: int = 3, T: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding of different lengths
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
@torch.no_grad()
def test_static_step_matches_dynamic_step_and_full_forward(variant):
    model = tiny(**variant)
    ids, mask = padded_prompt()
    B, T = ids.shape
    new = torch.randint(0, V, (B, 6))
    dynamic = DeltaFlowCache(model.config.num_layers)
    model(ids, attention_mask=mask, past_key_values=dynamic, use_cache=True)
    static = StaticDecodeCache([b.mixer for b in model.model.layers], B, T + 8, ids.device)
    static.load(dynamic)
    full_ids = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    full = model(full_ids, attention_mask=full_mask).logits
    for t in range(new.shape[1]):
        got = decode_step(model, new[:, t], static)
        step_mask = full_mask[:, : T + t + 1]
        want = model(
            new[:, t : t + 1], attention_mask=step_mask, past_key_values=dynamic, use_cache=True
        ).logits[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got, full[:, T + t], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("variant", [VARIANTS[1], VARIANTS[-2], VARIANTS[-1]])
def test_generate_eager_equals_transformers_greedy(variant):
    model = tiny(**variant)
    ids, mask = padded_prompt()
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    want = model.generate(ids, decode_mode="transformers", **kw)
    got = model.generate(ids, decode_mode="eager", **kw)
    assert got.shape == want.shape == (3, ids.shape[1] + 20)
    assert torch.equal(got, want)


def test_generate_eos_per_row_and_early_stop():
    model = tiny(rule="delta", use_decay=True)
    ids, mask = padded_prompt()
    T = ids.shape[1]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=40, decode_mode="eager")
    # EOS ids = tokens each row emits somewhere after the check interval (16), so rows stop at
    # different steps and the host sees "all stopped" only at a later check.
    eos = [int(free[0, T + 17]), int(free[1, T + 3]), int(free[2, T + 20])]
    kw = dict(attention_mask=mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=V - 1)
    want = model.generate(ids, decode_mode="transformers", do_sample=False, **kw)
    got = model.generate(ids, decode_mode="eager", **kw)
    assert got.shape == want.shape
    assert got.shape[1] < T + 40  # stopped before the budget: every row emitted an EOS id
    assert torch.equal(got, want)


def test_sampling_top_k_one_is_greedy_and_seeded_sampling_repeats():
    model = tiny(rule="efla")
    ids, mask = padded_prompt()
    kw = dict(attention_mask=mask, max_new_tokens=12, decode_mode="eager")
    greedy = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, do_sample=True, top_k=1, **kw), greedy)
    torch.manual_seed(3)
    a = model.generate(ids, do_sample=True, temperature=1.5, top_k=0, top_p=0.9, **kw)
    torch.manual_seed(3)
    b = model.generate(ids, do_sample=True, temperature=1.5, top_k=0, top_p=0.9, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, greedy)  # a hot temperature leaves the greedy path


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_filter_matches_transformers(top_p):
    scores = torch.randn(4, 97) * 3
    ours = top_p_filter(scores, top_p)
    theirs = TopPLogitsWarper(top_p)(None, scores.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_choose_next_samples_inside_top_k():
    logits = torch.randn(64, 40)
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(5):
        nxt = choose_next(logits, Sampling(do_sample=True, top_k=5))
        assert (allowed == nxt[:, None]).any(-1).all()


def test_errors_name_the_problem():
    model = tiny()
    ids, _ = padded_prompt()
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(ids, max_new_tokens=3, num_beams=2, decode_mode="eager")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        model.generate(ids, max_new_tokens=3, decode_mode="graph")
    with pytest.raises(ValueError, match="decode_mode"):
        model.generate(ids, max_new_tokens=3, decode_mode="fast")
    decoder = StaticDecoder(model, 3, 16, Sampling(), mode="eager")
    with pytest.raises(ValueError, match="exceeds max_length 16"):
        decoder.generate(ids, max_new_tokens=6)
    with pytest.raises(ValueError, match="pad_token_id"):
        Sampling(eos_token_ids=(1,))
    # On CPU the default stays transformers' loop, beam search included.
    assert model.generate(ids, max_new_tokens=3, num_beams=2).shape == (3, ids.shape[1] + 3)


def test_static_cache_load_checks_batch():
    model = tiny(mixer_types=["delta", "attention"])
    ids, mask = padded_prompt()
    dynamic = DeltaFlowCache(2)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=dynamic, use_cache=True)
    static = StaticDecodeCache([b.mixer for b in model.model.layers], 2, 32, ids.device)
    with pytest.raises(ValueError, match="batch"):
        static.load(dynamic)


def test_default_mode_falls_back_when_a_mode_fails(monkeypatch):
    """On CUDA a failing compile (or capture) hands over to the next mode, then to transformers'
    loop, with a warning; simulated on CPU with 'eager' standing in for the graph modes."""
    import deltaflow.models.generation as generation

    model = tiny(rule="delta", use_decay=True)
    ids, mask = padded_prompt()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, decode_mode="transformers")
    real_get_decoder = generation.get_decoder

    def flaky(model, batch_size, columns, sampling, mode):
        if mode == "broken":
            raise RuntimeError("simulated compiler failure")
        return real_get_decoder(model, batch_size, columns, sampling, mode)

    monkeypatch.setattr(generation, "get_decoder", flaky)
    monkeypatch.setattr(generation, "default_modes", lambda device: ("broken", "eager"))
    with pytest.warns(UserWarning, match="'broken' failed"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(got, want)
    monkeypatch.setattr(generation, "default_modes", lambda device: ("broken",))
    with pytest.warns(UserWarning, match="simulated compiler failure"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5)  # transformers' loop
    assert torch.equal(got, want)
