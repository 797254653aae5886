import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, run the Triton kernels on the CPU interpreter. It must be set before any
# kernel is decorated, i.e. before deltaflow.ops.triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _conv_norm_op_off_on_the_interpreter(monkeypatch):
    """conv.TRITON_CONV_NORM is on wherever its kernels run, which the interpreter (on above,
    without a GPU) makes the CPU too: every model test would run the conv interpreted. Off here
    on the CPU; the tests of the op turn it on themselves (tests/test_conv_norm_triton.py)."""
    if not torch.cuda.is_available():
        from deltaflow.layers import conv

        monkeypatch.setattr(conv, "TRITON_CONV_NORM", False)


@pytest.fixture
def seed_and_one_thread():
    """Seed 0 and one torch thread for the test (tiny tensors: one thread is faster, and
    immune to oversubscribed CI machines); the thread count is restored afterwards."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def narrow_half_kernels(monkeypatch):
    """bf16/fp16 inputs on the half-precision kernels at every head size: the op runs heads
    narrower than ``triton_ops.HALF_MIN_HEAD`` (64) on the fp32 kernels, and 0 turns that off,
    for the tests of the half-precision kernels themselves at heads small enough for the
    interpreter. Their blocks keep the 64-column floor (``common.HALF_MIN_BLOCK``), as the
    GPU validated them."""
    from deltaflow.ops import triton_ops

    monkeypatch.setattr(triton_ops, "HALF_MIN_HEAD", 0)
