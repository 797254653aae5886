"""Every GPU script (and every experiments/ script) runs whole in its CPU smoke mode: tiny shapes,
the Triton kernels on the interpreter, no fla, the report in a temporary folder. A script that
rots (a renamed flag, a rule it assumes, a poisoned int table) fails here instead of on the
next GPU run. Each script is a subprocess from the repository root, as a contributor runs it;
two run at once (the CI box has 2 cores) and each test waits for its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HAS_TRITON = importlib.util.find_spec("triton") is not None
# liger-kernel comes with [triton] (pyproject); an older environment may lack it
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
TIMEOUT_S = 300  # per script; each takes seconds to a minute on the 2-core box


@dataclass(frozen=True)
class Script:
    path: str
    args: tuple[str, ...]  # "{tmp}" is the script's own temporary folder
    success: str  # a line the script prints when it finished
    triton: bool = False  # needs Triton (the interpreter): skipped without it
    marks: tuple = field(default=())
    name: str = ""  # the test id where one script runs twice (default: the file's stem)
    runner: tuple[str, ...] = ()  # the interpreter (default: this Python)
    expect: tuple[str, ...] = ()  # more lines the output must hold
    timeout_s: int = TIMEOUT_S

    @property
    def id(self) -> str:
        return self.name or Path(self.path).stem


# A script that a schedule below (gpu_check.sh, issue32_call.sh) runs in its smoke with the same
# arguments has no entry of its own (each smoke run costs CI its minutes): check_triton.py
# --smoke --workers 2 (gpu_check.sh, whose output shows its ALL OK line), kernels.py and
# generation.py --warm-only (both schedules' *_warm steps; smoke warm-ups trace in-process, the
# worker count unused), kernel_times.py --smoke (issue32_call.sh), short_conv.py time --smoke
# (issue31_call.sh). Their exit status is a step's.
SCRIPTS = [
    Script(
        "benchmarks/bf16_floor.py", ("--smoke", "--out", "{tmp}/floor.md"), "bf16_floor: done", True
    ),
    # one --variant (its settings applied around its own measurements): 10 rows + 2 of it
    Script(
        "benchmarks/kernels.py",
        ("--smoke", "--variant", "prep:triton_backend.SAVE_FOR_BACKWARD=prepare"),
        "smoke ok: 12 measurements ran",
        True,
    ),
    # the op with triton_backend.SAVE_FOR_BACKWARD at each value, one process
    Script(
        "benchmarks/kernels.py",
        ("--smoke", "--save-for-backward"),
        "smoke ok: 4 save-for-backward measurements ran",
        True,
        name="kernels_save",
    ),
    # the op with triton_backend.SEQUENCE_PARALLEL_STATES off and on (issue 32)
    Script(
        "benchmarks/kernels.py",
        ("--smoke", "--sequence-parallel"),
        "smoke ok: 2 sequence-parallel measurements ran",
        True,
        name="kernels_seqpar",
    ),
    # the GPU truth's whole schedule (background steps, pinning, waits, summary) at toy size; its
    # warm-ups trace real launches (no interpreter): what they would compile on a GPU
    Script(
        "benchmarks/gpu_check.sh",
        ("--smoke", "{tmp}/out"),
        "0 step(s) failed",
        True,
        runner=("bash",),
        timeout_s=900,  # 95-120 s alone on the 2-core box; steps run at once, beside a script
        # summary.txt's line for each step: its exit status, seconds and start
        expect=("ALL OK: True",)  # check_triton's smoke: every case right
        + tuple(
            f"{step}: exit 0 in "
            for step in (
                "fla_warm",
                "kernels_warm",
                "generation_warm",
                "check_triton",
                "generation",
                "kernels",
                "model_training",
            )
        ),
    ),
    # issue 31's GPU call at toy size: fla's warm-up plumbing, the short conv's timing, then the
    # trainer's step and pure bf16 timed at two shapes (fla left out on the CPU; the gradient
    # check's smoke runs on its own: the check_training entry)
    Script(
        "benchmarks/issue31_call.sh",
        ("--smoke", "{tmp}/out"),
        "0 step(s) failed",
        True,
        runner=("bash",),
        expect=tuple(
            f"{step}: exit 0 in "
            for step in (
                "short_conv",  # short_conv.py time --smoke: no entry of its own
                "fla_warm_B2_T64",
                "fla_warm_B1_T128",
                "train_B2_T64",
                "train_B1_T128",
            )
        ),
    ),
    # issue 32's GPU call at toy size: the warm-up beside, then the timed kernels and times
    Script(
        "benchmarks/issue32_call.sh",
        ("--smoke", "{tmp}/out"),
        "0 step(s) failed",
        True,
        runner=("bash",),
        expect=(
            "kernels_warm: exit 0 in ",
            "kernels: exit 0 in ",
            "kernel_times: exit 0 in ",
            "ncu: exit 0 in ",  # its profiled range's driver, kernel_times.py --profile-once
        ),
    ),
    # Nsight Compute's CSV of a committed call as one row a launch, ranked stall reasons
    Script(
        "benchmarks/ncu_table.py",
        ("benchmarks/results/issue32/s22call4/ncu.csv",),
        "| chunk_grads_fused_kernel | (512, 32, 1) | 1.29e+03 |",
        expect=("- chunk_dstates_kernel: long_scoreboard 1.55, short_scoreboard 1.37, wait 1.09",),
    ),
    # the op's host time with no-op launches (no interpreter), its syncs, the model step's
    Script(
        "benchmarks/host_overhead.py",
        ("--smoke", "--json", "{tmp}/host.json"),
        "host_overhead: done",
        True,
        expect=("dense backward: ", "model training step, trainer's step: 0 syncs"),
    ),
    Script("benchmarks/conv_norm.py", ("time", "--smoke"), "conv_norm: done", True),
    # ours against liger's fused linear cross-entropy, liger on the interpreter
    Script(
        "benchmarks/lm_loss.py",
        ("--smoke",),
        "lm_loss: done",
        True,
        expect=(" liger: ", " liger-c1: ") if HAS_LIGER else (),
    ),
    # sm_90 compile of the short conv's launches on the CPU (traced at the training shape)
    Script(
        "benchmarks/short_conv.py",
        ("cost",),
        "short_conv: done",
        True,
        name="short_conv_cost",
        expect=("short_conv_bwd_kernel {'HAS_STATE': False, 'VARLEN': True}",),
    ),
    # sm_90 compile of the conv + SiLU + L2 norm op's launches (the backward must not spill)
    Script(
        "benchmarks/conv_norm.py",
        ("cost",),
        "conv_norm: done",
        True,
        name="conv_norm_cost",
        expect=("conv_silu_l2_dz_kernel {'BT': 16, 'VARLEN': True}", "conv_dx_kernel"),
    ),
    Script("benchmarks/convert_fla_check.py", ("--smoke",), "fla", True),
    Script("benchmarks/smoke_triton.py", ("--smoke",), "smoke_triton: ok", True),
    # issue 31's float16 probe: fp16 and fp32 at the failing test's shape, the wide variant
    Script(
        "benchmarks/probe_fp16.py", ("--smoke",), "probe_fp16: done", True, expect=("verdict: ",)
    ),
    # issue 32's narrow fp32 probe: one head pair, both floors, one process each
    Script(
        "benchmarks/probe_narrow_fp32.py",
        ("--smoke", "--save", "none", "--out", "{tmp}"),
        "probe: 2 cases, 0 not ok",
        True,
        expect=("20x12 unequal none: ok",),
    ),
    # issue 32's map of settings on the GPU (two variants, one process each) and the state
    # pass's two products alone at 32 value columns
    Script(
        "benchmarks/probe_settings.py",
        ("--smoke", "--jobs", "2", "--out", "{tmp}"),
        "probe_settings: 2 lines, 0 not ok",
        True,
        expect=("fbv32 T=65: ok",),
    ),
    Script(
        "benchmarks/probe_wgmma32.py",
        ("--smoke",),
        "probe_wgmma32: 2 cases, 0 not ok",
        True,
        expect=("via_trans: ok",),
    ),
    Script("benchmarks/profile_forward.py", ("--smoke",), "profile_forward: done", True),
    Script(
        "benchmarks/tune_backward.py", ("--smoke", "--profile", "--out", "{tmp}"), "wrote", True
    ),
    # two worker processes, as the GPU call runs it (--jobs): delta and softmax attention,
    # both models' loss curves (the transformer's: one unit a run), packed documents
    Script(
        "benchmarks/check_training.py",
        ("--smoke", "--jobs", "2", "--out", "{tmp}"),
        "check_training: done",
        True,
        expect=(
            "unit grads:delta:model: exit 0, 2 rows",
            "unit lm: exit 0, 1 rows",
            "unit grads:softmax:model: exit 0, 2 rows",
            *(
                f"unit lm:transformer:{run}: exit 0, 1 rows"
                for run in ("eager", "compiled", "compiled_no_graphs", "compiled_no_sac")
            ),
            "unit packed:delta: exit 0, 1 rows",
            "unit packed:longhorn: exit 0, 1 rows",
        ),
        timeout_s=600,  # ~50 s alone, ~100 s beside another script; 300 was hit under load
    ),
    Script("benchmarks/model_training.py", ("--smoke", "--llama", "--out", "{tmp}"), "wrote"),
    Script("benchmarks/generation.py", ("--smoke", "--out", "{tmp}"), "generation: done"),
    Script("benchmarks/saved_activations.py", ("--smoke", "--out", "{tmp}"), "wrote"),
    Script("benchmarks/multigpu.py", ("--smoke", "--out", "{tmp}"), "multigpu: done"),
    Script(
        "benchmarks/context_parallel.py", ("--smoke", "--out", "{tmp}"), "context_parallel: done"
    ),
    Script("benchmarks/tf32x3_error.py", ("--smoke",), "within the fp32 tolerance"),
    # sm_90 compile of one small kernel on the CPU (the plan traced, the decode kernel compiled)
    Script(
        "benchmarks/compile_cost.py",
        ("--only", "decode_kernel,Dv=64 "),
        "compile_cost: ",
        True,
    ),
    Script("benchmarks/cpu_backends.py", ("--smoke", "--out", "{tmp}/cpu.md"), "wrote"),
    Script("benchmarks/cpu_threads.py", ("--smoke", "--json", "{tmp}/threads.json"), "wrote"),
    # the op's custom ops routed to the torch backend (Triton imported, never launched)
    Script("benchmarks/half_grad_draws.py", ("--smoke",), "half_grad_draws: smoke ok", True),
    # experiments/: CPU tooling over committed results or a device call's archive
    Script("experiments/collect_device.py", ("--help",), "usage:"),  # needs an archive
    Script("experiments/pack_resume.py", ("{tmp}", "{tmp}/resume.tgz"), "resume: 0 runs"),
    Script("experiments/merge_carry.py", ("{tmp}/carry", "{tmp}/runs"), "carry: no"),
    Script("experiments/paired_claims.py", ("--out", "{tmp}"), "wrote"),
    Script("experiments/plot_lm_regimes.py", ("--out", "{tmp}"), "wrote"),
    Script("experiments/mqar_probe.py", ("--steps", "2", "--width", "16"), "steps to 0.99"),
    Script(
        "experiments/mqar_probe.py",
        ("--model", "deltaflow:transformer_zoology", "--recipe", "harness", "--steps", "2"),
        "steps to 0.99",
        name="mqar_probe_deltaflow",
    ),
]


def _run(script: Script, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)  # conftest sets it here: --smoke must set it itself
    args = [a.replace("{tmp}", str(tmp)) for a in script.args]
    cmd = [*(script.runner or (sys.executable,)), script.path, *args]
    # its own session: a script past its time is stopped with every process it started
    # (gpu_check.sh runs steps in the background; worker pools outlive a killed parent)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=script.timeout_s)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # ended in between
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, out, f"timed out after {script.timeout_s} s")


@dataclass
class Started:
    runs: dict[str, Future]
    results_before: list[Path]  # benchmarks/results/ before any script ran


@pytest.fixture(scope="module")
def started(request, tmp_path_factory) -> Started:
    """Start every selected script at once, two at a time; tests wait for their own."""
    selected = {
        item.callspec.id
        for item in request.session.items
        if item.path == Path(__file__) and hasattr(item, "callspec")
    }
    before = sorted(RESULTS.rglob("*"))
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {
        s.id: pool.submit(_run, s, tmp_path_factory.mktemp(s.id))
        for s in SCRIPTS
        if s.id in selected and (HAS_TRITON or not s.triton)
    }
    yield Started(futures, before)
    for future in futures.values():
        future.cancel()
    pool.shutdown(wait=True)


@pytest.mark.parametrize("script", [pytest.param(s, id=s.id, marks=s.marks) for s in SCRIPTS])
def test_script_runs_in_smoke_mode(script: Script, started: Started) -> None:
    if script.triton and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    proc = started.runs[script.id].result()
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script.path} exited {proc.returncode}{tail}"
    for line in (script.success, *script.expect):
        assert line in proc.stdout, f"{script.path}: no {line!r}{tail}"
    # a smoke run's report never lands among the committed GPU results
    assert sorted(RESULTS.rglob("*")) == started.results_before


def test_kernels_warm_shapes_launch_what_the_timed_shapes_launch(tmp_path: Path) -> None:
    """kernels.py compiles its warm-up at T = WARM_T instead of each shape's T: traced on CPU
    tensors (no interpreter, nothing runs), both launch the same kernel specializations, so the
    timed run finds every kernel of ours compiled. Shapes whose state passes may run in
    segments (few sequences x heads: their launches depend on T) keep their T; a shape that fills
    132 SMs takes WARM_T."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    code = (
        "import kernels as K\n"
        "shapes = [(2, 4096, 2, 32), (1, 2048, 2, 64), (64, 256, 4, 64)]\n"
        "timed = K.warm_specializations(shapes, 132)\n"
        "warm = K.warm_specializations(K.warm_shapes(shapes, 132), 132)\n"
        "assert [s[1] for s in K.warm_shapes(shapes, 132)] == [4096, 2048, K.WARM_T]\n"
        "assert timed and all(timed), timed\n"
        "assert warm == timed, (warm, timed)\n"
        "print('same', sum(map(len, timed)))\n"
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the tracer intercepts compiled kernels' launches
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_gpu_check_script_parses_and_names_every_step() -> None:
    """benchmarks/gpu_check.sh (the GPU truth in one command) is bash that parses, and it runs
    the scripts tested above, so a renamed flag there fails here too."""
    path = REPO / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    for name in ("check_triton.py", "kernels.py", "generation.py", "model_training.py"):
        assert name in text
