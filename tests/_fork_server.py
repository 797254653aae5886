"""A fork server for kill tests: starts `deltaflow.cli.main` processes without paying the
import time (~5 s on a 2-core CI machine: torch, transformers) for each one.

    server = ForkServer(env)              # in a test: python tests/_fork_server.py
    code, output = server.run(["train", ...], cwd=tmp_path)
    pid = server.start(["train", ...], cwd=tmp_path, log=tmp_path / "log.txt")
    os.kill(pid, signal.SIGKILL); server.wait(pid)   # -> {"signal": 9} or {"exit": 0}

Protocol on the server's stdin/stdout, one JSON object per line:
    {"argv": [...], "cwd": "...", "log": "...", "inject": null}  -> forks; replies {"pid": N}
    {"wait": N}                                  -> reaps child N; replies {"exit": c} etc.
``inject: "enospc"`` makes the child's second checkpoint save fail as a full disk would
(after writing part of the weights), for the disk-full test.

Each child is a real process (its own memory and files) running ``deltaflow.cli.main(argv)``
exactly as ``python -m deltaflow.cli`` would, after the imports: the server imports the
modules and never runs a torch operation, so nothing in it is shared state a child could
inherit half-done (no thread pools yet). The test kills children with SIGKILL at random
moments; a child that has exited stays a zombie until the test asks to reap it, so its pid
cannot be reused by another process before the kill.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import deltaflow.cli  # noqa: F401 -- the imports a CLI process pays for, done once here
import deltaflow.models  # noqa: F401
import deltaflow.tasks  # noqa: F401
import deltaflow.train  # noqa: F401
import deltaflow.train.export  # noqa: F401


def child(request: dict) -> None:
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # the server's stdout is the protocol pipe: keep the child off it
    os.dup2(fd, 2)
    os.chdir(request["cwd"])
    import torch

    from deltaflow.cli import main

    torch.set_num_threads(1)
    if request.get("inject") == "enospc":
        inject_full_disk()
    code = 1
    try:
        code = main(list(request["argv"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def inject_full_disk() -> None:
    """The second checkpoint's weights get half written, then the disk is 'full'."""
    import deltaflow.train.checkpoint as checkpoint

    real_save_model, calls = checkpoint.save_model, []

    def save_model(model, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real_save_model(model, filename, *args, **kwargs)

    checkpoint.save_model = save_model


def serve() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(int(request["wait"]), 0)
            reply = {"exit": os.WEXITSTATUS(status)} if os.WIFEXITED(status) else {}
            if os.WIFSIGNALED(status):
                reply["signal"] = os.WTERMSIG(status)
            print(json.dumps(reply), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    serve()


class ForkServer:
    """The test side: start the server, fork CLI processes, wait for them."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._ask(None) == {"ready": True}

    def _ask(self, request: dict | None) -> dict:
        if request is not None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, argv: list[str], *, cwd: Path, log: Path, inject: str | None = None) -> int:
        request = {"argv": argv, "cwd": str(cwd), "log": str(log), "inject": inject}
        return self._ask(request)["pid"]

    def wait(self, pid: int) -> dict:
        return self._ask({"wait": pid})

    def run(self, argv: list[str], *, cwd: Path, inject: str | None = None) -> tuple[int, str]:
        """Run a CLI command to its end: (exit code, its stdout and stderr)."""
        log = Path(cwd) / f".cli-{len(os.listdir(cwd))}.txt"
        status = self.wait(self.start(argv, cwd=cwd, log=log, inject=inject))
        output = log.read_text()
        log.unlink()
        assert "exit" in status, (status, output)
        return status["exit"], output

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
