"""Run folders through the CLI, in real processes: one config per folder, forks, extension,
--no-resume archives, recovery from killed saves, a full disk, the user's config file,
Ctrl-C and SIGTERM, and export to a transformers folder.

The processes are forked from tests/_fork_server.py (real processes without ~5 s of imports
each); the Ctrl-C test runs `python -m deltaflow.cli train` itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _fork_server import ForkServer
from safetensors.torch import load_file

from deltaflow.train import read_log

pytestmark = pytest.mark.multiprocess

TINY = [
    *("--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"),
    *("--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"),
    *("--device", "cpu", "--no-progress", "--batch-size", "8", "--log-every", "1"),
    *("--set", "eval_kwargs={num_examples: 16, batch_size: 16}"),
]
ENV = {"OMP_NUM_THREADS": "1", "DELTAFLOW_CHECKPOINT_KEY": "test-runs-key"}


@pytest.fixture(scope="module")
def cli() -> ForkServer:
    server = ForkServer({**os.environ, **ENV})
    yield server
    server.close()


def train(cli: ForkServer, cwd: Path, *args: str, inject: str | None = None) -> tuple[int, str]:
    return cli.run(["train", *TINY, *args], cwd=cwd, inject=inject)


def error_line(output: str) -> str:
    """The CLI's error: one line, then the hint about DELTAFLOW_DEBUG, and no traceback."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1, output
    return lines[0]


def train_curve(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_log(run) if r["kind"] == "train"]


def latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def start_until_checkpoint(cli: ForkServer, cwd: Path, args: list[str]) -> None:
    """Start a long run and SIGKILL it once it has a checkpoint: an unfinished run."""
    run = Path(args[-1])
    pid = cli.start(["train", *TINY, *args], cwd=cwd, log=cwd / "killed.txt")
    deadline = time.time() + 60
    while not (run / "checkpoints" / "latest").is_file() and time.time() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    assert cli.wait(pid).get("signal") == signal.SIGKILL, (cwd / "killed.txt").read_text()


# ---------------------------------------------------------------------------- one config
def test_a_run_folder_belongs_to_one_config(cli, tmp_path):
    run = tmp_path / "run"
    code, out = train(cli, tmp_path, "--steps", "6", "--ckpt-every", "2", "--out", str(run))
    assert code == 0, out
    stored = {p: p.read_bytes() for p in [run / "run_config.yaml", *run.glob("checkpoints/*/*")]}

    # Other training settings: refused, naming each difference and the ways out.
    other = "--steps 6 --lr 3e-3 --seed 1 --batch-size 4 --set model.rule=longhorn".split()
    code, out = train(cli, tmp_path, *other, "--out", str(run))
    line = error_line(out)
    assert code == 2
    for diff in ("lr 0.001 -> 0.003", "seed 0 -> 1", "batch_size 8 -> 4", "model.rule"):
        assert diff in line, line
    assert "--fork NEWDIR" in line and "--no-resume" in line and "run_config.yaml" in line
    assert {p: p.read_bytes() for p in stored} == stored  # nothing rewritten

    # Evaluation, logging and checkpoint settings may change: the finished run stays finished.
    runtime = "--steps 6 --log-every 3 --eval-every 2 --ckpt-every 1".split()
    code, out = train(cli, tmp_path, *runtime, "--out", str(run))
    assert code == 0 and "already finished at step 6" in out, out

    # Fewer steps: refused. More steps of a finished run: an extension, logged as one.
    code, out = train(cli, tmp_path, "--steps", "4", "--out", str(run))
    assert code == 2 and "steps 6 -> 4" in error_line(out)
    code, out = train(cli, tmp_path, "--steps", "8", "--out", str(run))
    assert code == 0 and "extending the finished run" in out and "from 6 to 8 steps" in out
    assert [r["step"] for r in read_log(run) if r["kind"] == "train"] == list(range(1, 9))
    assert [r["event"] for r in read_log(run) if r["kind"] == "event"] == ["start", "extend"]
    assert json.loads((run / "final.json").read_text())["step"] == 8
    assert yaml.safe_load((run / "run_config.yaml").read_text())["steps"] == 8

    # An unfinished run may not change its steps either (the schedule would bend mid-run).
    long = tmp_path / "long"
    start_until_checkpoint(cli, tmp_path, [*"--steps 3000 --ckpt-every 2 --out".split(), str(long)])
    code, out = train(cli, tmp_path, "--steps", "4000", "--out", str(long))
    assert code == 2 and "steps 3000 -> 4000" in error_line(out) and "finished" in out


def test_fork_continues_a_checkpoint_with_new_settings_in_a_new_folder(cli, tmp_path):
    src, fork = tmp_path / "src", tmp_path / "fork"
    assert train(cli, tmp_path, "--steps", "4", "--out", str(src))[0] == 0
    before = load_file(src / "checkpoints" / "step_0000004" / "model.safetensors")
    fork_args = [*"--steps 7 --lr 3e-3 --out".split(), str(src), "--fork", str(fork)]
    code, out = train(cli, tmp_path, *fork_args)
    assert code == 0 and f"forking {src}/checkpoints/step_0000004 into {fork}" in out, out
    log = read_log(fork)
    assert [r["step"] for r in log if r["kind"] == "train"] == list(range(1, 8))
    assert train_curve(fork)[:4] == train_curve(src)  # the source's records, then the fork's
    assert [r["event"] for r in log if r["kind"] == "event"] == ["start", "fork"]
    assert yaml.safe_load((fork / "run_config.yaml").read_text())["lr"] == 3e-3
    after = load_file(src / "checkpoints" / "step_0000004" / "model.safetensors")
    assert all(before[k].equal(after[k]) for k in before)  # the source is untouched
    # The same command again resumes the fork; a fork into another model is refused.
    code, out = train(cli, tmp_path, *fork_args)
    assert code == 0 and "already finished at step 7" in out
    other = [*"--steps 7 --hidden-size 32 --out".split(), str(src), "--fork", str(tmp_path / "x")]
    code, out = train(cli, tmp_path, *other)
    assert code == 2 and "a fork keeps model and task" in error_line(out)


# ---------------------------------------------------------------------------- --no-resume
def test_no_resume_archives_the_old_run_and_prunes_only_the_new_one(cli, tmp_path):
    """The issue's case: 12 steps, then --no-resume for 4 in the same folder. The old run is
    archived whole; the new one keeps its own newest checkpoints; eval reads the new run."""
    run = tmp_path / "runB"
    assert train(cli, tmp_path, "--steps", "12", "--ckpt-every", "3", "--out", str(run))[0] == 0
    old_curve = train_curve(run)
    code, out = train(
        cli, tmp_path, *"--steps 4 --ckpt-every 1 --no-resume --out".split(), str(run)
    )
    assert code == 0, out
    (archived,) = (run / "archive").iterdir()
    assert f"moved the previous run of {run} to {archived}" in out
    assert names(archived / "checkpoints") == ["latest", "step_0000009", "step_0000012"]
    assert train_curve(archived) == old_curve and (archived / "final" / "config.json").is_file()
    assert names(run / "checkpoints") == ["latest", "step_0000003", "step_0000004"]
    assert latest(run) == "step_0000004"
    assert [r[0] for r in train_curve(run)] == [1, 2, 3, 4]
    # (stdout and stderr in one log here: no progress bar before the table)
    code, out = cli.run(["eval", str(run), "--device", "cpu", "--no-progress"], cwd=tmp_path)
    assert code == 0 and out.startswith(f"{run}/checkpoints/step_0000004"), out


# ---------------------------------------------------------------------------- killed saves
def test_start_recovers_what_a_killed_save_left(cli, tmp_path):
    """keep_checkpoints=1 and a kill between the two renames of a re-save: only
    .old-step_N-PID holds the checkpoint. Also planted: a half-written .tmp-*, a
    .latest.tmp-*, and a checkpoint renamed into place whose save was killed before it
    committed (newer than `latest`). The next start puts back, cleans and resumes."""
    run = tmp_path / "run"
    args = ["--steps", "6", "--ckpt-every", "2", "--set", "keep_checkpoints=1"]
    assert train(cli, tmp_path, *args, "--out", str(run))[0] == 0
    ckpts = run / "checkpoints"
    assert latest(run) == "step_0000006" and len(list(ckpts.glob("step_*"))) == 1
    shutil.copytree(ckpts / "step_0000006", ckpts / "step_0000008")  # uncommitted
    os.replace(ckpts / "step_0000006", ckpts / ".old-step_0000006-4242")
    (ckpts / ".tmp-step_0000006-4242").mkdir()
    (ckpts / ".tmp-step_0000006-4242" / "model.safetensors").write_bytes(b"\0" * 100)
    (ckpts / ".latest.tmp-4242").write_text("step_00")
    (run / "final.json").unlink()  # as if the kill came before the run's last files
    shutil.rmtree(run / "final")
    curve = train_curve(run)

    code, out = train(cli, tmp_path, *args, "--out", str(run))
    assert code == 0, out
    assert "recovered checkpoint step_0000006" in out
    assert "removed 2 temporary file(s)" in out and "removed step_0000008" in out
    assert f"resuming {run} from step 6" in out
    assert names(ckpts) == ["latest", "step_0000006"]
    assert train_curve(run) == curve  # nothing retrained, nothing logged twice
    assert json.loads((run / "final.json").read_text())["step"] == 6
    assert (run / "final" / "model.safetensors").is_file()


def test_full_disk_during_a_save_keeps_the_last_checkpoint_and_says_so(cli, tmp_path):
    run = tmp_path / "run"
    args = ["--steps", "6", "--ckpt-every", "2", "--out", str(run)]
    code, out = train(cli, tmp_path, *args, inject="enospc")  # the save of step 4 fails
    line = error_line(out)
    assert code == 2 and "could not save checkpoint step 4" in line and "disk full" in line
    assert "last good checkpoint (step_0000002) is kept" in line
    assert names(run / "checkpoints") == ["latest", "step_0000002"]
    code, out = train(cli, tmp_path, *args)  # space freed: the same command resumes
    assert code == 0 and f"resuming {run} from step 2" in out, out
    assert [r[0] for r in train_curve(run)] == list(range(1, 7))


def test_the_users_config_file_in_the_run_folder_is_never_overwritten(cli, tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    text = "# my experiment\nsteps: 3  # short\nlr: 2.0e-3\n"
    (exp / "config.yaml").write_text(text)
    code, out = train(cli, tmp_path, "--config", str(exp / "config.yaml"), "--out", str(exp))
    assert code == 0, out
    assert (exp / "config.yaml").read_text() == text
    assert yaml.safe_load((exp / "run_config.yaml").read_text())["lr"] == 2e-3
    code, out = cli.run(["eval", str(exp), "--device", "cpu", "--json"], cwd=tmp_path)
    assert code == 0 and "accuracy" in json.loads(out[out.index("{") :]), out


# ---------------------------------------------------------------------------- signals
def test_ctrl_c_and_sigterm_save_the_current_step_and_exit_0(cli, tmp_path):
    """SIGINT to a real `python -m deltaflow.cli train`, then SIGTERM to the resumed run, then
    the printed command to the end: the same losses and weights as an uninterrupted run."""
    steps = ["--steps", "80", "--ckpt-every", "50"]  # no step checkpoint before the signals
    straight = tmp_path / "straight"
    assert train(cli, tmp_path, *steps, "--out", str(straight))[0] == 0
    run = tmp_path / "run"
    argv = ["train", *TINY, *steps, "--out", str(run)]
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaflow.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_train_records(run, 3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and not stdout
    match = re.search(r"saved step (\d+), resume with: (.+)", stderr)
    assert match, stderr
    n = int(match.group(1))
    assert 3 <= n < 80 and latest(run) == f"step_{n:07d}"
    assert train_curve(run)[-1][0] == n  # logged up to the saved step, not a step more
    command = shlex.split(match.group(2))
    assert command[:2] == ["deltaflow", "train"] and command[2:] == argv[1:]

    pid = cli.start(command[1:], cwd=tmp_path, log=tmp_path / "term.txt")
    wait_for_train_records(run, n + 2)
    os.kill(pid, signal.SIGTERM)
    assert cli.wait(pid) == {"exit": 0}
    out = (tmp_path / "term.txt").read_text()
    assert f"resuming {run} from step {n}" in out
    m = int(re.search(r"saved step (\d+), resume with", out).group(1))
    assert n < m < 80 and latest(run) == f"step_{m:07d}"

    code, out = cli.run(command[1:], cwd=tmp_path)
    assert code == 0 and f"resuming {run} from step {m}" in out, out
    assert train_curve(run) == train_curve(straight)
    final = "checkpoints/step_0000080/model.safetensors"
    a, b = load_file(straight / final), load_file(run / final)
    assert all(a[k].equal(b[k]) for k in a)


def wait_for_train_records(run: Path, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = run / "log.jsonl"
        if log.is_file() and log.read_text().count('"kind": "train"') >= count:
            return
        time.sleep(0.005)
    raise TimeoutError(f"{run} did not log {count} training records")


# ---------------------------------------------------------------------------- export
def test_export_opens_with_auto_model_with_identical_logits(cli, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"doc{i}.txt").write_text(f"Text {i}: " + "the quick brown fox " * 40)
    run = tmp_path / "lm"
    args = [
        *("train", "--task", "lm", "--data-dir", str(corpus), "--tokenizer", "byte"),
        *("--seq-len", "16", "--task-arg", f"cache_dir={tmp_path / 'cache'}"),
        *"--hidden-size 16 --num-layers 1 --num-heads 2 --backend torch --device cpu".split(),
        *"--no-progress --batch-size 4 --steps 3".split(),
        *("--set", "eval_kwargs={num_examples: 4, batch_size: 4}", "--out", str(run)),
    ]
    assert cli.run(args, cwd=tmp_path)[0] == 0
    code, out = cli.run(["export", str(run), "--out", str(tmp_path / "hf")], cwd=tmp_path)
    assert code == 0, out

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import deltaflow.models  # noqa: F401 -- registers model_type "deltaflow"
    from deltaflow.tasks.language import get_tokenizer
    from deltaflow.train import TrainConfig, build_model, load_checkpoint

    config = TrainConfig.from_yaml(run / "run_config.yaml")
    ours = build_model(config, 257)
    load_checkpoint(run, model=ours, restore_rng=False)
    ids = torch.tensor([get_tokenizer("byte").encode("the quick brown fox")])
    for folder in (tmp_path / "hf", run / "final"):  # exported, and written at the end
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in folder.iterdir()
        }
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ours.eval()(input_ids=ids).logits)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer("the quick brown fox")["input_ids"] == ids[0].tolist()
        assert tokenizer.eos_token_id == 256
        # Hub-ready: the end of text for generate, the model code beside the weights, 0644
        config = json.loads((folder / "config.json").read_text())
        assert config["eos_token_id"] == 256 and "AutoModelForCausalLM" in config["auto_map"]
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation["eos_token_id"] == 256
        assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {"0o644"}
    # A fresh process where deltaflow cannot be imported: the bundled source serves
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_DELTAFLOW, str(tmp_path / "hf"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["from-bundle", "equal"], done.stdout
    code, out = cli.run(["export", str(run), "--out", str(run)], cwd=tmp_path)
    assert code == 2 and "is a run folder" in error_line(out)


# deltaflow hidden: any top-level `deltaflow` found outside an unpacked bundle is refused
_LOAD_WITHOUT_DELTAFLOW = """
import importlib.machinery, sys, torch
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name != "deltaflow":
            return None
        paths = [p for p in sys.path if "deltaflow_src_" in p]
        spec = importlib.machinery.PathFinder.find_spec(name, paths) if paths else None
        if spec is None:
            raise ImportError("deltaflow is hidden in this test")
        return spec
sys.meta_path.insert(0, Hide())
try:
    import deltaflow
    raise SystemExit("deltaflow importable")
except ImportError:
    pass
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
import deltaflow
where = "from-bundle" if "deltaflow_src_" in deltaflow.__file__ else deltaflow.__file__
want = torch.load(sys.argv[2] + "/expected.pt")
with torch.no_grad():
    logits = model(input_ids=want["ids"]).logits
print(where, "equal" if torch.equal(logits, want["logits"]) else "different")
"""


def test_a_bpe_tokenizer_exports_to_an_equal_transformers_tokenizer(tmp_path):
    """A small .tiktoken file (the 256 bytes and a few merges) through hf_tokenizer: the same
    ids as deltaflow's BPETokenizer, <|endoftext|> as the last id."""
    import base64

    from transformers import AutoTokenizer

    from deltaflow.tasks.language import get_tokenizer
    from deltaflow.train.export import hf_tokenizer

    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" t", b" the", b"en"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    ours = get_tokenizer("bpe", path)
    hf_tokenizer("lm", {"tokenizer": "bpe", "tokenizer_path": str(path)}).save_pretrained(
        tmp_path / "tok"
    )
    theirs = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for text in ("the then hethe", "  the end\n\nthe", "ünïcödé the ☃"):
        assert theirs(text)["input_ids"] == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    assert theirs.eos_token_id == ours.eot_id == len(tokens)
