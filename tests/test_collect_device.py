"""experiments/collect_device.py merges a device call's runs into the committed ones by run id: a
fresh machine's runs.jsonl holds only its own runs, so copying it over would lose results."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from _scripts import load_script

from deltaflow.cli import main as deltaflow_cli


def collect_device():
    return load_script("experiments/collect_device.py")


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_merge_keeps_old_runs_adds_new_ones_and_the_device_copy_wins(tmp_path):
    merge_runs = collect_device().merge_runs
    committed, device = tmp_path / "results" / "runs.jsonl", tmp_path / "device.jsonl"
    committed.parent.mkdir()
    write(committed, [{"id": "a", "v": 1}, {"id": "b", "v": 1}])
    write(device, [{"id": "b", "v": 2}, {"id": "c", "v": 2}])
    assert merge_runs(device, committed) == (2, 3)
    merged = {r["id"]: r["v"] for r in map(json.loads, committed.read_text().splitlines())}
    assert merged == {"a": 1, "b": 2, "c": 2}
    assert merge_runs(device, tmp_path / "new" / "runs.jsonl") == (0, 2)  # folder created


def test_side_folders_get_their_grids_finished_runs_for_the_next_fresh_machine(tmp_path):
    """mad_b trains beside mad; carried to a fresh machine it must already list mad's finished
    runs, or its --resume would train them again."""
    script = collect_device()
    results, unpacked = tmp_path / "results", tmp_path / "runs"
    (results / "mad").mkdir(parents=True)
    write(results / "mad" / "runs.jsonl", [{"id": "a", "v": 1}, {"id": "b", "v": 1}])
    (unpacked / "mad").mkdir(parents=True)
    write(unpacked / "mad" / "runs.jsonl", [{"id": "c", "v": 2}])  # a run not collected yet
    script.prepare_carry(results, unpacked)
    for folder, ids in (("mad", {"a", "b", "c"}), ("mad_b", {"a", "b"})):
        lines = (unpacked / folder / "runs.jsonl").read_text().splitlines()
        assert {json.loads(line)["id"] for line in lines} == ids


def test_prepare_carry_builds_runs_from_the_committed_results_alone(tmp_path, monkeypatch):
    """A fresh checkout has no runs/: --prepare-carry gives every device folder its grid's
    finished runs, so the first call's carry skips them (session 8 did this by hand)."""
    script = collect_device()
    results = tmp_path / "results"
    (results / "mqar_512").mkdir(parents=True)
    write(results / "mqar_512" / "runs.jsonl", [{"id": "a", "status": "ok"}])
    monkeypatch.chdir(tmp_path)
    argv = ["collect_device.py", "--prepare-carry", "--results", str(results)]
    monkeypatch.setattr("sys.argv", argv)
    assert script.main() == 0
    for folder in ("mqar_512", "mqar_512_w128", "mqar_512_w256"):  # the grid and its side folders
        lines = (tmp_path / "runs" / "issue11" / folder / "runs.jsonl").read_text().splitlines()
        assert [json.loads(line)["id"] for line in lines] == ["a"]
    assert not (tmp_path / "runs" / "issue11" / "mad" / "runs.jsonl").exists()  # nothing to give


def tree(root: Path, skip: str = "") -> dict[str, bytes]:
    """Every file under ``root`` (the top-level folder ``skip`` left out) and its bytes."""
    files = (p for p in root.rglob("*") if p.is_file())
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in files
        if not skip or p.relative_to(root).parts[0] != skip
    }


def test_prepare_carry_and_a_collect_rewrite_the_carry_as_runs_issue11_without_logs(
    tmp_path, monkeypatch
):
    """Calls carry runs/carry, never runs/issue11 (a carried path replaces the machine's: session
    31's call 2 wiped a warm machine's checkpoints that way); both ways of building the local
    state leave its copy there, rewritten (a run directory deleted since must not travel)."""
    script = collect_device()
    results, runs = tmp_path / "results", tmp_path / "runs"
    (results / "mqar_512").mkdir(parents=True)
    write(results / "mqar_512" / "runs.jsonl", [{"id": "a", "status": "ok"}])
    (runs / "issue11" / "logs").mkdir(parents=True)
    (runs / "issue11" / "logs" / "cmd1.log").write_text("an old call's log\n")
    (runs / "issue11" / "mad" / "runs" / "r1").mkdir(parents=True)  # an unfinished run
    (runs / "issue11" / "mad" / "runs" / "r1" / "state.json").write_text("{}")
    (runs / "carry" / "issue11" / "gone").mkdir(parents=True)
    (runs / "carry" / "issue11" / "gone" / "stale.txt").write_text("from an older carry")
    monkeypatch.chdir(tmp_path)
    argv = ["collect_device.py", "--prepare-carry", "--results", str(results)]
    monkeypatch.setattr("sys.argv", argv)
    assert script.main() == 0
    carried = tree(runs / "carry" / "issue11")
    assert carried == tree(runs / "issue11", skip="logs")
    assert "mqar_512/runs.jsonl" in carried and "mad/runs/r1/state.json" in carried
    assert "gone/stale.txt" not in carried

    # a collect: the archive's logs and a new run of mad land in runs/issue11, then the carry
    (tmp_path / "device").mkdir()
    write(tmp_path / "device" / "runs.jsonl", [{"id": "m", "status": "ok"}])
    (tmp_path / "device" / "cmd1.log").write_text("this call's log\n")
    archive = tmp_path / "device" / "issue11.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "device" / "runs.jsonl", "issue11/mad/runs.jsonl")
        tar.add(tmp_path / "device" / "cmd1.log", "issue11/logs/cmd1.log")
    argv = ["collect_device.py", str(archive), "--call", "t1", "--results", str(results)]
    monkeypatch.setattr("sys.argv", [*argv, "--no-report"])
    assert script.main() == 0
    carried = tree(runs / "carry" / "issue11")
    assert carried == tree(runs / "issue11", skip="logs")
    assert "mad/runs.jsonl" in carried and "logs/cmd1.log" not in carried
    assert (results / "logs" / "t1_cmd1.log").read_text() == "this call's log\n"


RESULTS = Path(__file__).resolve().parents[1] / "results"
NEXT = RESULTS / "issue11" / "next"
# the queued command files: issue 11's next session and issue 24's (and 33's) device calls
QUEUED = sorted([*NEXT.glob("*.txt"), *(RESULTS / "issue24").glob("call_*.txt")])


def command_lines(path: Path) -> list[list[str]]:
    """Each line's `compare` arguments (a chained line's leading `then` is device_batch's)."""
    lines = path.read_text().splitlines()
    argvs = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return [argv[1:] if argv[0] == "then" else argv for argv in argvs]


@pytest.mark.parametrize("path", QUEUED, ids=lambda p: p.name)
def test_next_sessions_command_files_parse_and_land_where_collect_device_looks(
    path, tmp_path, monkeypatch, capsys
):
    """Each line of a queued device call is a valid `compare` argument list (checked here, at
    no device time), lines of one file never share an --out, and every --out is a folder that
    collect_device.py merges (a folder it does not know would be trained and never collected)."""
    known = {folder for folder, _ in collect_device().folders()}
    monkeypatch.chdir(tmp_path)  # --dry-run reads nothing of this checkout's runs/
    outs = []
    for argv in command_lines(path):
        assert deltaflow_cli(["compare", *argv, "--dry-run"]) == 0, argv
        out = Path(argv[argv.index("--out") + 1])
        assert out.parent == Path("runs/issue11") and out.name in known, out
        outs.append(out)
    assert outs and len(outs) == len(set(outs))
    assert "runs of" in capsys.readouterr().out
