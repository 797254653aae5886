"""The L2 prefetch hints (``common.prefetch_rows``, ``prefetch_block``; issue 32, session 27).
On the interpreter (which runs no PTX, so the kernels launch with PREFETCH off there): the
hints' addresses cover exactly the 128-byte lines of the tile the kernel loads later where its
rows start on line boundaries (all but one line a row otherwise), and never leave the tensor.
On a GPU: the op's outputs and gradients with the hints are those without them, bit for bit,
at the shapes whose kernels take them (the key side split and unsplit, the fused forward),
packed sequences included."""

from __future__ import annotations

import pytest
import torch
from _inputs import make_inputs

triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
if not triton_backend.available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_grads_variants import _fwd_bwd  # noqa: E402

from deltaflow.ops.triton import common  # noqa: E402 - after the skip

GPU = torch.cuda.is_available()


@triton.jit
def _row_lines_kernel(out_ptr, t0, last_t, i_h, col0, H: tl.constexpr, D: tl.constexpr,
                      BD: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    offs = common.row_lines(t0 + tl.arange(0, ROWS), last_t, i_h, col0, H, D, BD, BITS)
    NL: tl.constexpr = (BD * BITS + 1023) // 1024
    idx = tl.arange(0, ROWS)[:, None] * NL + tl.arange(0, NL)[None, :]
    tl.store(out_ptr + idx, offs)


# (rows from, last row, head, first column, H, D, block columns, bits): a chunk inside the
# tensor, one past its end, a value block of a wider head, bf16 and fp32, a head narrower than
# its block, a head narrower than a line, a block two lines wide over a head of less than one
CASES = [
    (0, 63, 1, 0, 2, 128, 128, 16),
    (40, 70, 0, 0, 3, 128, 128, 16),
    (64, 127, 2, 64, 4, 128, 64, 16),
    (0, 63, 1, 64, 2, 200, 128, 32),
    (5, 30, 1, 0, 2, 24, 32, 16),
    (0, 63, 0, 0, 1, 1, 1, 16),
    (0, 63, 1, 0, 2, 20, 64, 32),
]


@pytest.mark.skipif(GPU, reason="the addresses' check runs on the interpreter")
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_row_lines_cover_the_loaded_tile(case):
    t0, last_t, i_h, col0, H, D, BD, bits = case
    rows, lines = 64, (BD * bits + 1023) // 1024
    out = torch.full((rows * lines,), -1, dtype=torch.int32)
    _row_lines_kernel[(1,)](out, t0, last_t, i_h, col0, H=H, D=D, BD=BD, BITS=bits, ROWS=rows)
    size = bits // 8
    got = {int(o) * size // 128 for o in out}
    want = set()  # the lines of load_rows' tile: rows t0.. up to last_t, columns within D
    for t in range(t0, min(t0 + rows, last_t + 1)):
        for col in range(col0, min(col0 + BD, D)):
            want.add(((t * H + i_h) * D + col) * size // 128)
    assert got <= want  # never a line the load does not read
    if (D * size) % 128 == 0 and (col0 * size) % 128 == 0:  # rows on line boundaries: all
        assert got == want
    else:  # an unaligned row spans one line more than its width in lines: all but its last
        assert len(want - got) <= rows
    assert int(out.min()) >= 0 and int(out.max()) < (last_t + 1) * H * D


@pytest.mark.skipif(not GPU, reason="the hints run on a GPU only")
@pytest.mark.parametrize("rule", ["delta", "kaczmarz"])  # the key side split and unsplit
@pytest.mark.parametrize("D", [64, 128, 256])
def test_prefetch_changes_no_value(D, rule, monkeypatch):
    lengths = [0, 200, 1, 333]  # packed, an empty and a one-token sequence
    x = make_inputs(1, sum(lengths), 2, D, D, rule=rule, seed=D, n_states=len(lengths),
                    dtype=torch.bfloat16)  # fmt: skip
    if rule == "kaczmarz":
        x["beta"] = None
    x = {n: None if t is None else t.cuda() for n, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    runs = []
    for on in (False, True):
        monkeypatch.setattr(common, "PREFETCH", on)
        runs.append(_fwd_bwd(x, "triton", cu_seqlens=cu, rule=rule))
    for a, b in zip(*runs):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
