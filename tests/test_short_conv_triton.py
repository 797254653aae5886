"""The Triton short conv (deltaflow/layers/short_conv_triton.py, issue 31 item 4) against the
float64 torch reference (causal_conv_taps, and cat + conv1d for an initial state), on the GPU
when there is one, else on the CPU interpreter (TRITON_INTERPRET=1, set in conftest.py).
float32 and float16 inputs, and bfloat16 for the main comparison (the interpreter's bfloat16
dots are wrong, but the conv has no dot: its bf16 loads, float32 sums and bf16 stores are
right there). Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _inputs import rel_err

from deltaflow.layers import conv
from deltaflow.layers.conv import causal_conv_taps

sct = pytest.importorskip("deltaflow.layers.short_conv_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not sct.usable(torch.empty(0, device=DEVICE)):
    pytest.skip("the Triton short conv needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

# relative error vs float64 allowed per input dtype (float16: the output's own rounding)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _strided(B: int, T: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [B, T, C] as the layer passes it: columns 3 .. 3+C of a wider row-major tensor."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, C + 7, generator=g).to(DEVICE, dtype)
    x = wide[..., 3 : 3 + C]
    assert not x.is_contiguous()
    return x


def _fwd_bwd(fn, *tensors: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """[y, grads of every input] of ``fn(*tensors)`` under a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device, y.dtype)
    y.backward(g)
    return [y, *(t.grad for t in leaves)]


def _check(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> None:
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == dtype and a.shape == b.shape, i
        assert rel_err(a, b) <= TOL[dtype], (i, rel_err(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T, W, activation", [(37, 4, "silu"), (1, 4, "silu"), (70, 3, None)])
def test_against_float64_reference(monkeypatch, dtype, T, W, activation):
    # Odd lengths and T = 1 (every tap before the sequence), a strided input, W != 4, no
    # activation; outputs and gradients of x and the weight. T = 70 spans three forward tiles
    # of 32 rows and five backward tiles of 16, here two per program: three dw partials, the
    # last program with one tile past the end.
    monkeypatch.setattr(sct, "FWD_BT", 32)
    monkeypatch.setattr(sct, "BWD_BT", 16)
    monkeypatch.setattr(sct, "BWD_TILES", 2)
    x = _strided(2, T, 20, dtype, seed=T)
    w = torch.randn(20, W, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)

    def fast(x, w):
        return sct.short_conv(x, w, activation=activation)

    def ref(x, w):
        return causal_conv_taps(x, w, activation=activation)

    _check(_fwd_bwd(fast, x, w), _fwd_bwd(ref, x.double(), w.double()), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_no_leak_across_sequences(dtype):
    # Empty and one-token sequences, a sequence of exactly one tile, a long one: the packed conv
    # equals the reference, which restarts at every sequence.
    lengths = [0, 1, 5, 0, 32, 1, 40]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    x = _strided(1, sum(lengths), 12, dtype, seed=3)
    w = torch.randn(12, 4, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got = _fwd_bwd(lambda x, w: sct.short_conv(x, w, cu_seqlens=cu), x, w)
    ref = _fwd_bwd(lambda x, w: causal_conv_taps(x, w, cu), x.double(), w.double())
    _check(got, ref, dtype)
    # one sequence at a time gives the same rows: nothing leaks from the sequence before
    for start, end in zip(cu.tolist(), cu.tolist()[1:]):
        if end > start:
            alone = sct.short_conv(x[:, start:end], w)
            torch.testing.assert_close(got[0][:, start:end].detach(), alone)


@pytest.mark.parametrize("T", [1, 2, 37])
def test_initial_state_and_its_gradient(T):
    # The decoding window [B, C, W-1] instead of zeros, against cat + conv1d in float64 (what
    # ShortConvolution.forward computes with a state); the state gets its gradient too.
    B, C, W = 2, 9, 4
    x = _strided(B, T, C, torch.float32, seed=T)
    w = torch.randn(C, W, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    s = torch.randn(B, C, W - 1, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def ref(x, w, s):
        full = torch.cat([s, x.transpose(1, 2)], dim=-1)
        return F.silu(F.conv1d(full, w[:, None], groups=C)).transpose(1, 2)

    got = _fwd_bwd(lambda x, w, s: sct.short_conv(x, w, initial_state=s), x, w, s)
    _check(got, _fwd_bwd(ref, x.double(), w.double(), s.double()), torch.float32)


def test_gradient_of_an_expanded_output_gradient():
    # y.sum().backward() hands the backward a stride-0 gradient: read through its strides.
    x = _strided(2, 9, 6, torch.float32, seed=0).requires_grad_()
    w = torch.randn(6, 4, device=DEVICE, requires_grad=True)
    sct.short_conv(x, w).sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    causal_conv_taps(x2, w2).sum().backward()
    assert rel_err(x.grad, x2.grad) <= 1e-5 and rel_err(w.grad, w2.grad) <= 1e-5


def test_opcheck_every_variant():
    # Schema, fake (meta) shapes/strides/dtypes against the real ones, autograd registration
    # and AOT dispatch: plain, packed, with a state, with a float32 weight on float16 x.
    x = _strided(1, 11, 5, torch.float32, seed=0)
    w = torch.randn(5, 4, device=DEVICE)
    cu = torch.tensor([0, 0, 4, 11], device=DEVICE)
    s = torch.randn(1, 5, 3, device=DEVICE)
    variants = [
        (x, w, None, None, True),
        (x, w, None, cu, False),
        (x, w, s, None, True),
        (x.half(), w, None, None, True),
    ]
    for args in variants:
        leaves = [
            a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        ]  # fmt: skip
        torch.library.opcheck(sct.short_conv_fwd_op, tuple(leaves))


def test_compiled_fullgraph_reads_the_projection_in_place(monkeypatch):
    # torch.compile(fullgraph=True) traces the op (no graph break) and hands the kernel the
    # slice of the projection's output with its strides, not a contiguous copy; the gradients
    # are eager's.
    seen: list[tuple[int, ...]] = []
    forward = sct._forward

    def spy(x, *args):
        seen.append(x.stride())
        return forward(x, *args)

    monkeypatch.setattr(sct, "_forward", spy)

    def step(h, proj, w):
        out = F.linear(h, proj)  # [B, T, 3 + 8 + 2]: the conv reads columns 3 .. 11
        return (sct.short_conv(out[..., 3:11], w) * out[..., 11:].sum(-1, keepdim=True)).sum()

    torch.manual_seed(0)
    inputs = [torch.randn(2, 13, 6), torch.randn(13, 6), torch.randn(8, 4)]
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.to(DEVICE).requires_grad_() for t in inputs]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    assert seen and all(s == (13 * 13, 13, 1) for s in seen), seen
    for g, g_ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, g_ref)


def test_bad_input_one_clear_line():
    x = torch.randn(1, 5, 4, device=DEVICE)
    w = torch.randn(4, 4, device=DEVICE)
    cases = [
        (dict(x=x, weight=w[:3]), r"weight \[C, W >= 1\], got x \(1, 5, 4\) and weight \(3, 4\)"),
        (dict(x=x, weight=w, activation="gelu"), "activation must be 'silu' or None, got 'gelu'"),
        (dict(x=x, weight=w, initial_state=w), r"initial_state must be \[1, 4, 3\], got \(4, 4\)"),
        (
            dict(x=x.expand(2, 5, 4), weight=w, cu_seqlens=torch.tensor([0, 5])),
            "cu_seqlens needs x of batch 1 and no initial_state, got batch 2",
        ),
        (dict(x=x.double(), weight=w), "x must be a float16/bfloat16/float32 tensor"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            sct.short_conv(**kwargs)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("packed", [False, True])
def test_layer_with_the_switch_on_equals_the_reference(monkeypatch, packed):
    # DeltaAttention's fused path (one conv over the q|k|v columns of the fused projection):
    # outputs and every parameter gradient with TRITON_SHORT_CONV on equal the tap sum's.
    from deltaflow.layers import DeltaAttention

    calls = []
    fast = sct.short_conv
    monkeypatch.setattr(sct, "short_conv", lambda *a, **k: calls.append(1) or fast(*a, **k))
    torch.manual_seed(0)
    layer = DeltaAttention(32, num_heads=2, rule="delta", use_decay=True, fused_projections=True)
    layer = layer.to(DEVICE)
    x = torch.randn(1 if packed else 2, 21, 32, device=DEVICE)
    cu = torch.tensor([0, 1, 9, 21], device=DEVICE) if packed else None
    results = []
    for on in (False, True):
        monkeypatch.setattr(conv, "TRITON_SHORT_CONV", on)
        layer.zero_grad()
        y, _ = layer(x, cu_seqlens=cu)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    assert len(calls) == 1  # the switch routed the fused conv, once per forward
    for got, ref in zip(results[1], results[0]):
        assert rel_err(got, ref) <= 1e-5


def test_decoding_with_the_switch_on_equals_the_reference(monkeypatch):
    # ShortConvolution with its window (prefill with a cache, then token by token): the kernel
    # reads the window as its initial state; same outputs and windows as conv1d.
    from deltaflow.layers import DeltaAttention

    calls = []
    fast = sct.short_conv
    monkeypatch.setattr(sct, "short_conv", lambda *a, **k: calls.append(1) or fast(*a, **k))
    torch.manual_seed(0)
    layer = DeltaAttention(32, num_heads=2, rule="delta", use_decay=True).to(DEVICE).eval()
    x = torch.randn(2, 9, 32, device=DEVICE)
    outputs = []
    for on in (False, True):
        monkeypatch.setattr(conv, "TRITON_SHORT_CONV", on)
        with torch.no_grad():
            y, state = layer(x[:, :6], use_cache=True)
            ys = [y] + [layer(x[:, t : t + 1], state=state, use_cache=True)[0] for t in (6, 7, 8)]
        outputs.append([torch.cat(ys, 1), state["conv_q"], state["conv_v"]])
    assert len(calls) == 3 * 4  # q, k, v convs of the prefill and of each of 3 decoding steps
    for got, ref in zip(outputs[1], outputs[0]):
        assert rel_err(got, ref) <= 1e-5


def test_selective_checkpointing_keeps_the_conv_output(monkeypatch):
    # With the switch on, a block under selective checkpointing keeps the Triton conv's output
    # (models/block.py, _saved_ops): the forward kernel runs once per step, not again in the
    # backward's recompute, and the gradients are those without checkpointing.
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    monkeypatch.setattr(conv, "TRITON_SHORT_CONV", True)
    calls = []
    forward = sct._forward
    monkeypatch.setattr(sct, "_forward", lambda *a: calls.append(1) or forward(*a))
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, rule="delta", use_decay=True
    )
    model = DeltaFlowForCausalLM(cfg).to(DEVICE).train()
    for m in model.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = True
    ids = torch.randint(0, 61, (2, 19), device=DEVICE)
    grads = []
    for parts in ((), ("mixer",)):
        for block in model.model.layers:
            block.selective_checkpointing = parts
        model.zero_grad()
        calls.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == 1, (parts, len(calls))
        grads.append([p.grad.clone() for p in model.parameters()])
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref)


def test_compiled_blocks_with_the_switch_on(monkeypatch):
    # The GPU training path (compile_blocks: fullgraph, selective checkpointing, fused
    # projections) traced with the switch on ("aot_eager": the same graphs without inductor's
    # C++ compile): no graph break, the kernel reads the projection in place (row stride > C),
    # and loss and gradients are the eager tap sum's. (Packed sequences: the CPU's torch
    # backend of the op does not trace with cu_seqlens; the conv's packed path is traced in
    # test_compiled_fullgraph_reads_the_projection_in_place's op and run in the layer test.)
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks

    strides = []
    forward = sct._forward
    monkeypatch.setattr(sct, "_forward", lambda x, *a: strides.append(x.stride()) or forward(x, *a))
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, rule="delta", use_decay=True
    )
    ref = DeltaFlowForCausalLM(cfg).to(DEVICE).train()
    fast = DeltaFlowForCausalLM(cfg).to(DEVICE).train()
    fast.load_state_dict(ref.state_dict())
    for m in fast.modules():
        if hasattr(m, "fused_projections"):
            m.fused_projections = True
    compile_blocks(fast, backend="aot_eager")
    ids = torch.randint(0, 61, (2, 23), device=DEVICE)
    results = []
    for model, on in ((ref, False), (fast, True)):
        monkeypatch.setattr(conv, "TRITON_SHORT_CONV", on)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert len(strides) == 1 and strides[0][1] > 3 * 32, strides  # once: SAC keeps the output
    for got, want in zip(*results):
        assert rel_err(got, want) <= 1e-5
