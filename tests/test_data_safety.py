"""Nothing a user types destroys data (issue 34), in real CLI processes: export never deletes
or replaces what it did not write, a run folder is locked by its run, what a killed command
left is cleaned or put back, and a checkpoint is only read once its manifest verifies.

The processes are forked from tests/_fork_server.py (see tests/test_runs.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _fork_server import ForkServer

pytestmark = pytest.mark.multiprocess

TINY = [
    *("--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"),
    *("--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"),
    *("--device", "cpu", "--no-progress", "--batch-size", "8", "--log-every", "1"),
    *("--set", "eval_kwargs={num_examples: 16, batch_size: 16}"),
]
KEY = "test-data-safety-key"
ENV = {"OMP_NUM_THREADS": "1", "DELTAFLOW_CHECKPOINT_KEY": KEY}


@pytest.fixture(scope="module")
def cli() -> ForkServer:
    server = ForkServer({**os.environ, **ENV})
    yield server
    server.close()


def train(cli: ForkServer, cwd: Path, *args: str) -> tuple[int, str]:
    return cli.run(["train", *TINY, *args], cwd=cwd)


def error_line(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for folders), the CLI's logs aside."""
    out: dict[str, bytes | None] = {}
    for path in sorted(folder.rglob("*")):
        if path.name.startswith(".cli-"):
            continue
        out[str(path.relative_to(folder))] = path.read_bytes() if path.is_file() else None
    return out


def dead_pid() -> int:
    """The PID of a process that has ended (for planted leftovers of a 'killed' process)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def finished_run(cli, tmp_path_factory) -> Path:
    """A finished 4-step run with two checkpoints (copied by the tests that change it)."""
    base = tmp_path_factory.mktemp("finished")
    run = base / "run"
    code, out = train(cli, base, "--steps", "4", "--ckpt-every", "2", "--out", str(run))
    assert code == 0, out
    return run


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(".deltaflow-run.lock"))
    return dest


# ---------------------------------------------------------------------------- export
def test_export_refuses_every_folder_it_did_not_write(cli, tmp_path, finished_run):
    """Item 1: --out runs (the folder of the source and of other runs) deleted everything.
    Item 2: --out FILE replaced the file. Neither may change a byte; nor may a folder inside a
    run or checkpoint, a folder of other files, or an earlier export with a file added."""
    runs = tmp_path / "runs"
    a = copy_run(finished_run, runs / "a")
    copy_run(finished_run, runs / "b")
    (runs / "notes.txt").write_text("mine\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("1,2\n")
    ckpt = a / "checkpoints" / "step_0000004"
    before = snapshot(tmp_path)
    refused = {
        runs: "is a folder with other files",
        a: "is a run folder",
        a / "final": "is inside a run folder",
        a / "new": "is inside a run folder",
        ckpt: "is inside a run folder",
        runs / "notes.txt": "is a file",
        runs / "notes.txt" / "x": "which is a file",
        tmp_path / "other": "is a folder with other files",
    }
    for out, reason in refused.items():
        code, output = cli.run(["export", str(a), "--out", str(out)], cwd=tmp_path)
        assert code == 2 and reason in error_line(output), (out, output)
        code, output = cli.run(["export", str(ckpt), "--out", str(out)], cwd=tmp_path)
        assert code == 2 and reason in error_line(output), (out, output)
        assert snapshot(tmp_path) == before, out

    # A new folder, an empty one, and an earlier export (replaced) are fine.
    hf, empty = tmp_path / "hf", tmp_path / "empty"
    empty.mkdir()
    for out in (hf, empty, hf):
        code, output = cli.run(["export", str(a), "--out", str(out)], cwd=tmp_path)
        assert code == 0 and f"to {out}" in output, output
    assert (hf / "config.json").is_file() and (empty / "model.safetensors").is_file()
    # ... but not an export holding a file the export does not write: left as it was
    (hf / "README.md").write_text("my notes\n")
    kept = snapshot(hf)
    code, output = cli.run(["export", str(a), "--out", str(hf)], cwd=tmp_path)
    assert code == 2 and "README.md" in error_line(output)
    assert snapshot(hf) == kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []


def test_export_cleans_and_puts_back_what_a_killed_export_left(cli, tmp_path, finished_run):
    """Item 5: a kill between the two renames of a replace hid the destination as
    .DEST.old-PID, and later exports never cleaned .tmp/.old leftovers."""
    run = copy_run(finished_run, tmp_path / "run")
    hf = tmp_path / "hf"
    assert cli.run(["export", str(run), "--out", str(hf)], cwd=tmp_path)[0] == 0
    pid = dead_pid()
    os.replace(hf, tmp_path / f".hf.old-{pid}")  # the state such a kill leaves
    (tmp_path / f".hf.tmp-{pid}").mkdir()
    (tmp_path / f".hf.tmp-{pid}" / "model.safetensors").write_bytes(b"\0" * 10)
    live = tmp_path / f".hf.tmp-{os.getppid()}"  # a live process's export in progress
    live.mkdir()
    code, output = cli.run(["export", str(run), "--out", str(hf)], cwd=tmp_path)
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == [live.name]
    assert (hf / "model.safetensors").is_file()


# ---------------------------------------------------------------------------- the run lock
def test_a_second_run_in_a_folder_is_refused_and_a_killed_runs_lock_is_taken_over(cli, tmp_path):
    """Item 3: two runs in one --out both ran to exit 0, the second overwriting the first."""
    run = tmp_path / "run"
    a_args = ["train", *TINY, "--steps", "3000", "--ckpt-every", "200", "--out", str(run)]
    pid = cli.start(a_args, cwd=tmp_path, log=tmp_path / "a.txt")
    deadline = time.time() + 60
    while not (run / "log.jsonl").is_file() and time.time() < deadline:
        time.sleep(0.02)
    a_config = (run / "run_config.yaml").read_bytes()
    code, out = train(cli, tmp_path, "--steps", "5", "--lr", "0.003", "--out", str(run))
    line = error_line(out)
    assert code == 2 and f"in use by another deltaflow run (PID {pid})" in line, line
    assert (run / "run_config.yaml").read_bytes() == a_config
    os.kill(pid, signal.SIGKILL)
    assert cli.wait(pid).get("signal") == signal.SIGKILL
    # the kernel dropped the dead run's flock: the next run takes the folder over
    code, out = train(cli, tmp_path, "--steps", "2", "--no-resume", "--out", str(run))
    assert code == 0, out
    assert (run / ".deltaflow-run.lock").read_text().strip() != str(pid)


# ---------------------------------------------------------------------------- leftovers of kills
def test_a_start_cleans_what_killed_runs_left_and_undoes_a_half_archive(
    cli, tmp_path, finished_run
):
    """Item 5: .run_config.yaml.tmp-PID / .final.json.tmp-PID were never removed; a kill in the
    final prune left keep+1 checkpoints for good; a kill during --no-resume's archiving split
    the old run over two archive folders."""
    run = copy_run(finished_run, tmp_path / "run")
    ckpts = run / "checkpoints"
    (run / ".run_config.yaml.tmp-4242").write_text("steps: 1")
    (run / ".final.json.tmp-4242").write_text("{")
    shutil.copytree(ckpts / "step_0000004", ckpts / "step_0000001")  # an unpruned old one
    code, out = train(cli, tmp_path, "--steps", "4", "--ckpt-every", "2", "--out", str(run))
    assert code == 0 and "already finished" in out, out
    assert "removed 2 temporary file(s) left by a killed run" in out
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [
        ".deltaflow-run.lock"
    ]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000002", "step_0000004"]

    # --no-resume killed half-way through its archive: the next start moves the run back
    old = snapshot(run)
    half = run / "archive" / "20260101-000000"
    half.mkdir(parents=True)
    (run / ".archiving").write_text("archive/20260101-000000\n")
    for name in ("log.jsonl", "train.csv", "final"):
        os.replace(run / name, half / name)
    code, out = train(cli, tmp_path, "--steps", "4", "--ckpt-every", "2", "--out", str(run))
    assert code == 0 and "moved back the run that a killed --no-resume" in out, out
    assert "already finished" in out
    now = snapshot(run)
    assert {k: v for k, v in now.items() if k != ".deltaflow-run.lock"} == {
        k: v for k, v in old.items() if k != ".deltaflow-run.lock"
    }
    code, out = train(cli, tmp_path, *"--steps 2 --no-resume --out".split(), str(run))
    assert code == 0, out
    (archived,) = (run / "archive").iterdir()
    assert {"log.jsonl", "final", "checkpoints", "run_config.yaml"} <= {
        p.name for p in archived.iterdir()
    }


def test_no_resume_archives_the_tensorboard_events(cli, tmp_path):
    """Item 4: --no-resume --tensorboard deleted the old run's event files."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    args = ["--steps", "2", "--tensorboard", "--out", str(run)]
    assert train(cli, tmp_path, *args)[0] == 0
    events = {p.name: p.read_bytes() for p in (run / "tensorboard").iterdir()}
    assert events
    code, out = train(cli, tmp_path, *args, "--no-resume")
    assert code == 0, out
    (archived,) = (run / "archive").iterdir()
    assert {p.name: p.read_bytes() for p in (archived / "tensorboard").iterdir()} == events
    assert not set(events) & {p.name for p in (run / "tensorboard").iterdir()}


# ---------------------------------------------------------------------------- checkpoint trust
def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_without_its_manifest_is_refused_unless_trusted(cli, tmp_path, finished_run):
    """Item 6: deleting manifest.json turned verification off: flipped weights then loaded
    silently in eval and export, and resume diverged."""
    run = copy_run(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_0000004"
    (ckpt / "manifest.json").unlink()
    flip_a_byte(ckpt / "model.safetensors")
    commands = {
        "eval": ["eval", str(run), "--device", "cpu"],
        "export": ["export", str(run), "--out", str(tmp_path / "hf")],
        "generate": ["generate", str(ckpt), "--device", "cpu"],
    }
    for name, argv in commands.items():
        code, out = cli.run(argv, cwd=tmp_path)
        assert code == 2 and "has no manifest.json" in error_line(out), (name, out)
        assert "--trust-checkpoint" in out
    code, out = train(cli, tmp_path, "--steps", "6", "--ckpt-every", "2", "--out", str(run))
    assert code == 2 and "has no manifest.json" in error_line(out), out
    assert not (tmp_path / "hf").exists()
    # the user's word: load it unchecked
    code, out = cli.run([*commands["eval"], "--trust-checkpoint"], cwd=tmp_path)
    assert code == 0, out


def test_damaged_checkpoint_files_are_one_line_naming_the_file(cli, tmp_path, finished_run):
    """Item 7: a pickle in trainer_state.pt (hash updated), an invalid config.yaml and a
    corrupt state.json gave tracebacks or a JSON message without the file's name."""
    from deltaflow.train.manifest import write_manifest

    os.environ.setdefault("DELTAFLOW_CHECKPOINT_KEY", KEY)
    cases = {
        "trainer_state.pt": lambda f: torch.save({"step": 4, "code": Path("x")}, f),
        "config.yaml": lambda f: f.write_text("task: [mqar\nsteps: 4\n"),
        "state.json": lambda f: f.write_text("{'step': 4}"),
    }
    for name, damage in cases.items():
        run = copy_run(finished_run, tmp_path / f"run-{name}")
        ckpt = run / "checkpoints" / "step_0000004"
        damage(ckpt / name)
        write_manifest(ckpt)  # the hashes match: a planted file, not a flipped byte
        argvs = {
            "export": ["export", str(run), "--out", str(tmp_path / f"hf-{name}")],
            "eval": ["eval", str(run), "--device", "cpu"],
            "train": ["train", *TINY, "--steps", "6", "--ckpt-every", "2", "--out", str(run)],
        }
        # the commands that read the file (a resume reads run_config.yaml, not config.yaml)
        readers = {
            "trainer_state.pt": ("export", "eval", "train"),
            "config.yaml": ("export", "eval"),
            "state.json": ("train",),
        }
        argvs = [argvs[command] for command in readers[name]]
        for argv in argvs:
            code, out = cli.run(argv, cwd=tmp_path)
            assert code == 2 and f"{ckpt / name}" in error_line(out), (name, argv[0], out)


# ---------------------------------------------------------------------------- a full disk
def test_a_full_disk_inside_torch_save_is_reported_as_disk_full(tmp_path, monkeypatch):
    """Item 10: torch.save given a path reports ENOSPC as "RuntimeError: [enforce fail at
    inline_container.cc:672] unexpected pos". Here trainer_state.pt goes to /dev/full, a real
    device that fails every write with ENOSPC."""
    import types

    from deltaflow.train import checkpoint

    def save_to_full_device(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):  # torch.save(obj, path): torch's own file
            return torch.save(obj, "/dev/full", *args, **kwargs)
        with open("/dev/full", "wb") as full:  # torch.save(obj, file): a Python file
            return torch.save(obj, full, *args, **kwargs)

    class TorchWithAFullDisk(types.ModuleType):
        save = staticmethod(save_to_full_device)

        def __getattr__(self, name):
            return getattr(torch, name)

    monkeypatch.setattr(checkpoint, "torch", TorchWithAFullDisk("torch"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"\(disk full\); its partial"):
        checkpoint.save_checkpoint(tmp_path, model=model, optimizer=None, step=1, config={})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


# ---------------------------------------------------------------------------- Ctrl-C at start
def test_ctrl_c_at_any_moment_of_the_start_is_one_line_and_exit_130(tmp_path):
    """Item 8: Ctrl-C in the first seconds of a command (building the parser imports torch and
    transformers) printed a 14-78-line traceback. SIGINT at several moments after main() is
    entered: one line ('interrupted', or the saved step once training runs), no traceback."""
    # SIGINT's handler set as a terminal's Python has it: a background job (`cmd &` in a script,
    # CI's or a person's) inherits SIGINT ignored, and a signal landing before main() installs
    # its own handler (the load of a busy machine) was then lost: the run trained on
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import sys, deltaflow.cli as c; print('ready', flush=True); sys.exit(c.main())"
    )
    argv = [sys.executable, "-c", code, "train", *TINY, "--steps", "100000"]
    env = {**os.environ, **ENV}
    for i, delay in enumerate((0.0, 0.3, 1.0, 2.5)):
        proc = subprocess.Popen(
            [*argv, "--out", str(tmp_path / f"run{i}")],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline() == "ready\n"
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=120)
        finally:  # a run that missed its SIGINT trains 100000 steps: not on for the rest of CI
            proc.kill()
        assert "Traceback" not in stderr, (delay, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()]
        if proc.returncode == 130:
            assert len(lines) == 1 and "interrupted" in lines[0], (delay, stderr)
        else:  # training had begun: it saved the step and said how to resume
            assert proc.returncode == 0 and "resume with" in lines[-1], (delay, stderr)
