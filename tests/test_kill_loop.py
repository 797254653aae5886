"""kill -9 at random moments, 30 times, then let the run finish: it must end bit-identical to an
uninterrupted run, final weights and every logged loss and evaluation alike.

The runs are `deltaflow.cli.main` processes forked by tests/_fork_server.py (a process
start without ~5 s of imports; see there), killed with SIGKILL at a random time after they
start: during start-up, training steps, evaluations, and saves, which
DELTAFLOW_TEST_SAVE_PAUSE widens (a short sleep between the steps of every save) so that
many kills land inside one. ``keep_checkpoints=1``, ``ckpt_every`` not a multiple of
``log_every``, and timed checkpoints make the cases the issue found. Knobs:
DELTAFLOW_KILL_LOOP_KILLS (default 30), DELTAFLOW_KILL_LOOP_SEED (default 0).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from _fork_server import ForkServer
from safetensors.torch import load_file

from deltaflow.train import read_log

pytestmark = pytest.mark.multiprocess

STEPS = 240
ARGS = [
    "train",
    *("--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"),
    *("--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"),
    *("--device", "cpu", "--no-progress", "--batch-size", "8", "--steps", str(STEPS)),
    *("--log-every", "2", "--ckpt-every", "3", "--ckpt-minutes", "0.003", "--eval-every", "50"),
    *("--set", "keep_checkpoints=1", "--set", "eval_kwargs={num_examples: 16, batch_size: 16}"),
]


def records(run: Path) -> tuple[list, list]:
    """(train records, eval records) without wall-clock fields."""
    log = read_log(run)
    train = [
        (r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"])
        for r in log
        if r["kind"] == "train"
    ]
    evals = [r for r in log if r["kind"] == "eval"]
    return train, evals


def first_step_seconds(run: Path, t0: float) -> float:
    """Seconds from ``t0`` until the run logs its first training record."""
    while time.perf_counter() - t0 < 60:
        log = run / "log.jsonl"
        if log.is_file() and '"train"' in log.read_text():
            break
        time.sleep(0.01)
    return time.perf_counter() - t0


def save_leftovers(run: Path) -> list[str]:
    """What a kill inside a save leaves (before the next start cleans it up)."""
    ckpts = run / "checkpoints"
    if not ckpts.is_dir():
        return []
    return [p.name for p in ckpts.iterdir() if p.name.startswith((".tmp-", ".old-", ".latest"))]


def test_thirty_random_kills_then_the_run_equals_an_uninterrupted_one(tmp_path):
    kills = int(os.environ.get("DELTAFLOW_KILL_LOOP_KILLS", "30"))
    rng = random.Random(int(os.environ.get("DELTAFLOW_KILL_LOOP_SEED", "0")))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DELTAFLOW_TEST_SAVE_PAUSE": "0.01",
        "DELTAFLOW_CHECKPOINT_KEY": "kill-loop-test",
    }
    server = ForkServer(env)
    try:
        t0 = time.perf_counter()
        ref = tmp_path / "straight"
        pid = server.start([*ARGS, "--out", str(ref)], cwd=tmp_path, log=tmp_path / "ref.txt")
        startup = first_step_seconds(ref, t0)  # ~0.6 s here, more on a loaded machine
        assert server.wait(pid) == {"exit": 0}
        straight_seconds = time.perf_counter() - t0

        run, log = tmp_path / "killed", tmp_path / "killed.txt"
        landed, in_save, finished_early = 0, 0, 0
        # a fifth of the kills land in the start-up, the rest during training, a few dozen
        # steps apart (so that the run is still training when the last kill comes)
        for _ in range(20 * kills):
            if landed == kills:
                break
            pid = server.start([*ARGS, "--out", str(run)], cwd=tmp_path, log=log)
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0.0, startup))
            else:
                time.sleep(startup + rng.uniform(0.0, 0.8))
            os.kill(pid, signal.SIGKILL)  # an exited child is a zombie until waited for
            status = server.wait(pid)
            if status.get("signal") == signal.SIGKILL:
                landed += 1
                in_save += bool(save_leftovers(run))
            else:
                assert status == {"exit": 0}, log.read_text()[-3000:]
                finished_early += 1
        assert landed == kills
        pid = server.start([*ARGS, "--out", str(run)], cwd=tmp_path, log=log)
        assert server.wait(pid) == {"exit": 0}, log.read_text()[-3000:]
    finally:
        server.close()
    print(
        f"{kills} kills ({in_save} inside a save, {finished_early} starts found the run "
        f"finished); straight run {straight_seconds:.1f}s"
    )
    assert in_save > 0 or kills < 10  # the save windows were hit

    final = f"checkpoints/step_{STEPS:07d}/model.safetensors"
    for name in (final, "final/model.safetensors"):
        a, b = load_file(ref / name), load_file(run / name)
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert value.equal(b[key]), (name, key)
    train_ref, eval_ref = records(ref)
    train_run, eval_run = records(run)
    assert [r[0] for r in train_ref] == list(range(2, STEPS + 1, 2))
    assert train_run == train_ref  # every logged loss, bit for bit, none missing or doubled
    assert eval_run == eval_ref
    last_eval = {k: v for k, v in eval_ref[-1].items() if k not in ("kind", "step", "split")}
    assert json.loads((run / "final.json").read_text())["eval"] == last_eval
