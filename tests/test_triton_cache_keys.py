"""Every Triton kernel has one cache key in every process (deltaflow.ops.triton.pin_cache_keys).

Triton 3.6 (the GPU image's) gave a kernel another key when a kernel sharing its helpers had
been hashed first: check_triton's case processes recompiled what its compile phase had put in
the disk cache. The backend hashes every kernel at import in the stage order; these tests keep
the stage list whole and the keys independent of the order a process then touches kernels in.
(Triton 3.9, CI's, no longer depends on the order; there the second test guards the pin.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

PACKAGE = Path(__file__).resolve().parents[1] / "deltaflow" / "ops" / "triton"


def _defines_kernel(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") for node in tree.body
    )


def test_every_module_with_a_kernel_is_a_stage_pin_cache_keys_hashes():
    from deltaflow.ops.triton import STAGES

    with_kernels = {p.stem for p in PACKAGE.glob("*.py") if _defines_kernel(p)}
    assert with_kernels == set(STAGES), f"STAGES {STAGES} vs modules with kernels {with_kernels}"


_KEYS = """
import deltaflow.ops.triton_backend  # pins the keys
from deltaflow.ops.triton import gradients, prepare, states
kernels = [prepare.chunk_prepare_kernel, states.chunk_states_kernel,
           gradients.chunk_grads_k_kernel, gradients.chunk_grads_v_kernel]
for kernel in kernels if sys.argv[1] == "forward" else kernels[::-1]:
    kernel.cache_key  # hashed in this order (already pinned: a no-op)
print(" ".join(k.cache_key for k in kernels))
"""


def test_kernel_keys_do_not_depend_on_the_order_a_process_hashes_them():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JIT objects
    keys = [
        subprocess.run(
            [sys.executable, "-c", "import sys\n" + _KEYS, order],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        for order in ("forward", "backward")
    ]
    assert len(keys[0]) == 4 and keys[0] == keys[1]
