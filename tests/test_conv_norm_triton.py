"""The conv + SiLU + L2 norm Triton op (deltaflow/layers/conv_norm_triton.py, issue 31) against
the float64 torch reference (causal_conv_taps + l2_normalize on the q|k head groups), on the GPU
when there is one, else on the CPU interpreter (TRITON_INTERPRET=1, set in conftest.py); the
layer with conv.TRITON_CONV_NORM on against off. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _inputs import rel_err

from deltaflow.layers import conv

cn = pytest.importorskip("deltaflow.layers.conv_norm_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not cn.usable(torch.empty(0, device=DEVICE)):
    pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

# relative error vs float64 allowed per input dtype (half precision: the output's own rounding)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _strided(B: int, T: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [B, T, C] as the layer passes it: columns 3 .. 3+C of a wider row-major tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C + 7, generator=g).to(DEVICE, dtype)[..., 3 : 3 + C]
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
@pytest.mark.parametrize(
    "T, W, D, C, begin, end",
    [
        (37, 4, 8, 44, 0, 16),  # q and k normalized, v not, v's last group 4 channels wide
        (1, 4, 8, 24, 0, 16),  # T = 1: every tap before the sequence
        (70, 3, 8, 32, 8, 16),  # k only, W != 4, three forward tiles and five backward tiles
        (19, 4, 6, 30, 0, 12),  # head_dim not a power of two (lanes padded to 8)
        (9, 4, 8, 24, 0, 0),  # no norm at all: the plain conv + SiLU
    ],
)
def test_against_float64_reference(monkeypatch, dtype, T, W, D, C, begin, end):
    monkeypatch.setattr(cn, "FWD_BT", 32)
    monkeypatch.setattr(cn, "BWD_BT", 16)
    monkeypatch.setattr(cn, "BWD_TILES", 2)  # a program walks two row tiles, or one at the end
    monkeypatch.setattr(cn, "DX_BT", 8)  # several dx tiles and channel blocks, a partial one
    monkeypatch.setattr(cn, "DX_BC", 16)
    x = _strided(2, T, C, dtype, seed=T)
    w = torch.randn(C, W, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    args = dict(head_dim=D, norm_begin=begin, norm_end=end)
    got = _fwd_bwd(lambda x, w: cn.conv_silu_l2(x, w, **args), x, w)
    _check(got, _fwd_bwd(lambda x, w: cn.reference(x, w, **args), x.double(), w.double()), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_no_leak_across_sequences(dtype):
    # Empty and one-token sequences, a sequence of exactly one tile, a long one: the packed op
    # equals the reference, which restarts the conv at every sequence.
    lengths = [0, 1, 5, 0, 16, 1, 23]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    x = _strided(1, sum(lengths), 24, dtype, seed=3)
    w = torch.randn(24, 4, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    args = dict(head_dim=8, norm_begin=0, norm_end=16, cu_seqlens=cu)
    got = _fwd_bwd(lambda x, w: cn.conv_silu_l2(x, w, **args), x, w)
    _check(got, _fwd_bwd(lambda x, w: cn.reference(x, w, **args), x.double(), w.double()), dtype)
    # one sequence at a time gives the same rows: nothing leaks from the sequence before
    for start, stop in zip(cu.tolist(), cu.tolist()[1:]):
        if stop > start:
            alone = cn.conv_silu_l2(x[:, start:stop], w, head_dim=8, norm_begin=0, norm_end=16)
            torch.testing.assert_close(got[0][:, start:stop].detach(), alone)


def test_gradient_of_an_expanded_output_gradient():
    # y.sum().backward() hands the backward a stride-0 gradient: read through its strides.
    x = _strided(2, 9, 16, torch.float32, seed=0).requires_grad_()
    w = torch.randn(16, 4, device=DEVICE, requires_grad=True)
    args = dict(head_dim=4, norm_begin=4, norm_end=12)
    (cn.conv_silu_l2(x, w, **args) * 3).sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (cn.reference(x2, w2, **args) * 3).sum().backward()
    assert rel_err(x.grad, x2.grad) <= 1e-5 and rel_err(w.grad, w2.grad) <= 1e-5


def test_opcheck_every_variant():
    # Schema, fake (meta) shapes/strides/dtypes against the real ones, autograd registration
    # and AOT dispatch: plain, packed, a float32 weight on float16 x, no norm.
    x = _strided(1, 11, 12, torch.float32, seed=0)
    w = torch.randn(12, 4, device=DEVICE)
    cu = torch.tensor([0, 0, 4, 11], device=DEVICE)
    variants = [
        (x, w, None, 4, 0, 8, 1e-6),
        (x, w, cu, 4, 4, 8, 1e-6),
        (x.half(), w, None, 4, 0, 8, 1e-6),
        (x, w, None, 4, 0, 0, 1e-6),
    ]
    for args in variants:
        leaves = [
            a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        ]  # fmt: skip
        torch.library.opcheck(cn.conv_silu_l2_fwd_op, tuple(leaves))


def test_compiled_fullgraph_reads_the_projection_in_place(monkeypatch):
    # torch.compile(fullgraph=True) traces the op (no graph break) and hands the kernel the
    # slice of the projection's output with its strides, not a contiguous copy; the gradients
    # are eager's.
    seen: list[tuple[int, ...]] = []
    forward = cn._forward

    def spy(x, *args):
        seen.append(x.stride())
        return forward(x, *args)

    monkeypatch.setattr(cn, "_forward", spy)

    def step(h, proj, w):
        out = F.linear(h, proj)  # [B, T, 3 + 12 + 2]: the op reads columns 3 .. 15
        y = cn.conv_silu_l2(out[..., 3:15], w, head_dim=4, norm_begin=0, norm_end=8)
        return (y * out[..., 15:].sum(-1, keepdim=True)).sum()

    torch.manual_seed(0)
    inputs = [torch.randn(2, 13, 6), torch.randn(17, 6), torch.randn(12, 4)]
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.to(DEVICE).requires_grad_() for t in inputs]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    assert seen and all(s == (13 * 17, 17, 1) for s in seen), seen
    for g, g_ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, g_ref)


def test_bad_input_one_clear_line():
    x = torch.randn(1, 5, 8, device=DEVICE)
    w = torch.randn(8, 4, device=DEVICE)
    norm = dict(head_dim=4, norm_begin=0, norm_end=4)
    cases = [
        (dict(x=x, weight=w[:3], **norm), r"weight \[C, W >= 1\], got x \(1, 5, 8\)"),
        (dict(x=x, weight=w, head_dim=4, norm_begin=2, norm_end=4), r"multiples of head_dim"),
        (dict(x=x, weight=w, head_dim=4, norm_begin=0, norm_end=12), r"norm_end <= C = 8"),
        (dict(x=x, weight=w, initial_state=w, **norm), "initial_state is not supported"),
        (
            dict(x=x.expand(2, 5, 8), weight=w, cu_seqlens=torch.tensor([0, 5]), **norm),
            "cu_seqlens needs x of batch 1, got batch 2",
        ),
        (dict(x=x.double(), weight=w, **norm), "x must be a float16/bfloat16/float32 tensor"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            cn.conv_silu_l2(**kwargs)
        assert "\n" not in str(info.value)


def _spy_calls(monkeypatch) -> list[int]:
    """Counts the forward kernel's runs (each call of conv_norm_triton._forward)."""
    calls: list[int] = []
    forward = cn._forward
    monkeypatch.setattr(cn, "_forward", lambda *a: calls.append(1) or forward(*a))
    return calls


@pytest.mark.parametrize(
    "packed, qk_norm", [(False, None), (True, None), (False, ("none", "l2")), (False, "none")]
)
def test_layer_with_the_switch_on_equals_the_reference(monkeypatch, packed, qk_norm):
    # DeltaAttention's fused path: outputs and every parameter gradient with TRITON_CONV_NORM on
    # equal the compiled-path torch ops' (tap sum, SiLU, l2_normalize), for the rule's norms
    # and for k only / no norm.
    from deltaflow.layers import DeltaAttention

    calls = _spy_calls(monkeypatch)
    torch.manual_seed(0)
    layer = DeltaAttention(
        32, num_heads=2, rule="delta", use_decay=True, fused_projections=True, qk_norm=qk_norm
    ).to(DEVICE)
    x = torch.randn(1 if packed else 2, 21, 32, device=DEVICE)
    cu = torch.tensor([0, 1, 9, 21], device=DEVICE) if packed else None
    results = []
    for on in (False, True):
        monkeypatch.setattr(conv, "TRITON_CONV_NORM", on)
        layer.zero_grad()
        y, _ = layer(x, cu_seqlens=cu)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    assert len(calls) == 1  # the switch routed the fused conv, once per forward
    for got, ref in zip(results[1], results[0]):
        assert rel_err(got, ref) <= 1e-5


def test_the_switch_leaves_decoding_alone(monkeypatch):
    # Prefill with a cache and decoding take the op-by-op path (conv windows): the op never
    # runs there, and the outputs are those with the switch off.
    from deltaflow.layers import DeltaAttention

    calls = _spy_calls(monkeypatch)
    torch.manual_seed(0)
    layer = DeltaAttention(32, num_heads=2, rule="delta", fused_projections=True).to(DEVICE)
    x = torch.randn(2, 7, 32, device=DEVICE)
    outputs = []
    for on in (False, True):
        monkeypatch.setattr(conv, "TRITON_CONV_NORM", on)
        with torch.no_grad():
            y, state = layer(x[:, :6], use_cache=True)
            y2, _ = layer(x[:, 6:], state=state, use_cache=True)
        outputs.append(torch.cat([y, y2], 1))
    assert not calls
    torch.testing.assert_close(outputs[1], outputs[0])


def test_selective_checkpointing_keeps_the_op_output(monkeypatch):
    # With the switch on, a block under selective checkpointing keeps the op's output
    # (models/block.py, _saved_ops): the forward kernel runs once per step, not again in the
    # backward's recompute, and the gradients are those without checkpointing.
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    monkeypatch.setattr(conv, "TRITON_CONV_NORM", True)
    calls = _spy_calls(monkeypatch)
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
    # C++ compile): no graph break, the kernel reads the projection in place (row stride > C)
    # once (SAC keeps its output), and loss and gradients are the eager torch path's.
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.compile import compile_blocks

    strides = []
    forward = cn._forward
    monkeypatch.setattr(cn, "_forward", lambda x, *a: strides.append(x.stride()) or forward(x, *a))
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
        monkeypatch.setattr(conv, "TRITON_CONV_NORM", on)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert len(strides) == 1 and strides[0][1] > 3 * 32, strides
    for got, want in zip(*results):
        assert rel_err(got, want) <= 1e-5
