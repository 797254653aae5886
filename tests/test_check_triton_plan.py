"""check_triton.py's plan is the whole matrix of issue 30 (every Triton rule in bf16 and fp32,
every shape, decode, causality, torch.compile), and ``--plan`` lists the kernel specializations
each case launches without a GPU (its launches traced on CPU tensors), every case at least one:
the compile phase compiles exactly those, so a case that launched none through the trace would
compile inside its own run, on the GPU, again."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from _scripts import REPO, load_script

from deltaflow.rules import triton_rules

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)


def test_the_plan_covers_every_rule_dtype_shape_and_check() -> None:
    ct = load_script("benchmarks/check_triton.py")
    cases = ct.plan(["bf16", "fp32"], False, "cuda")
    ops = [args for kind, args in cases if kind == "op"]
    labels = {shape[0] for shape in ct.SHAPES}
    for dt in ("bf16", "fp32"):
        mine = [a for a in ops if a[8] == dt]
        assert {a[6] for a in mine} == set(triton_rules()), dt
        assert {a[0] for a in mine} == labels, dt  # varlen, D=256, T=1 ... all of them
        assert {a[7] for a in mine} == {False, True}, dt  # negative eigenvalues both ways
    for kind in ("decode", "causal"):
        assert {args[0] for k, args in cases if k == kind} == set(triton_rules()), kind
    assert [k for k, _ in cases].count("compile") == 1
    assert [k for k, _ in cases].count("decode_graph") == 1


def test_plan_flag_prints_each_cases_specializations_on_a_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, as in CI
    proc = subprocess.run(
        [sys.executable, "benchmarks/check_triton.py", "--plan", "--only", "T=65,compile,decode"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    blocks = re.split(r"^case \d+: ", proc.stdout, flags=re.M)[1:]
    names = [b.splitlines()[0] for b in blocks]
    for name in ("compile", "decode kaczmarz", "decode_graph"):
        assert name in names, names
    # negative eigenvalues alternate with the head sizes: which one T=65's fp32 case gets moves
    # as shapes are added
    assert any(re.fullmatch(r"op T=65 delta ne=(True|False) fp32", n) for n in names), names
    for block in blocks:  # every case launches kernels, first listed where first launched
        assert re.search(r"^  [+=] \w+_kernel\[", block, flags=re.M), block
    out = proc.stdout
    assert "PREC=tf32x3" in out and "PREC=tf32 " in out  # fp32 operands vs bf16 ones
    first = re.findall(r"^  \+ (.*)$", out, flags=re.M)
    assert len(first) == len(set(first))  # each specialization is first launched once
    summary = re.search(r"^plan: (\d+) cases, (\d+) specializations", out, flags=re.M)
    assert summary and int(summary[1]) == len(blocks) and int(summary[2]) == len(first)


def _check_triton(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "benchmarks/check_triton.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_set_reaches_the_traced_launches_and_bad_flags_are_refused() -> None:
    # --set checks a variant's kernels (issue 32): the plan's reverse pass takes its value block
    proc = _check_triton("--plan", "--only", "T=65 delta", "--set", "dstates.DSTATES_BV=32")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    dstates = re.findall(r"chunk_dstates_kernel\[.*", proc.stdout)
    assert dstates and all(" BV=32 " in line for line in dstates), dstates
    proc = _check_triton("--plan", "--set", "states.NO_SUCH=1")
    assert proc.returncode == 2 and "has no setting 'NO_SUCH'" in proc.stderr, proc.stderr
    proc = _check_triton("--plan", "--only", "no such case")  # not "ALL OK (0/0 cases)"
    assert proc.returncode == 2 and "matches no case" in proc.stderr, proc.stderr


def test_bwd_states_is_that_setting_by_name() -> None:
    # --bwd-states fp32: the backward's fp32 states narrow the key-side gradient kernel's value
    # block in the traced launches; against --set's value of the same setting it is refused
    proc = _check_triton("--plan", "--only", "T=65 delta", "--bwd-states", "fp32")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    grads_k = re.findall(r"chunk_grads_k_lean_kernel\[.*bfloat16.*", proc.stdout)
    assert grads_k and all(" BV=32 " in line for line in grads_k), grads_k
    proc = _check_triton(
        "--plan", "--bwd-states", "fp32", "--set", "triton_backend.BACKWARD_STATES_FP32=0"
    )
    assert proc.returncode == 2 and "contradicts" in proc.stderr, proc.stderr
