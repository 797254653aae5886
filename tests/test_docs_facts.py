"""Issue 35, point 8: what the README, the configs and the packaging say is what the code does
(each fact is checked against its source, so the next change that makes one untrue fails)."""

from __future__ import annotations

import re
from pathlib import Path

from deltaflow.cli import build_parser
from deltaflow.lab import expand_grid, get_preset

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_grid_sizes_are_the_dry_run_counts():
    claims = re.findall(r"--preset (\w+)[^\n]*\((\d+) runs\)", README)
    assert claims, "the README names no grid size any more: drop this test"
    for preset, runs in claims:
        specs = expand_grid(get_preset(preset), device="cpu", shared="/shared")
        assert len(specs) == int(runs), f"README: {preset} has {runs} runs, --dry-run {len(specs)}"


def test_mqar_cpu_config_and_readme_promise_the_same_accuracy():
    comment = (ROOT / "configs" / "mqar_cpu.yaml").read_text()
    readme = re.search(r"configs/mqar_cpu.yaml --rule efla --decay[^\n]*accuracy ~([\d.]+)", README)
    config = re.search(r"~([\d.]+) for gated EFLA \(--rule efla --decay\)", comment)
    assert readme and config and readme.group(1) == config.group(1)


def test_default_outputs_of_the_readme_commands_are_git_ignored():
    ignored = (ROOT / ".gitignore").read_text().split()
    stability = build_parser(["stability"])._subparsers._group_actions[0].choices["stability"]
    out = stability.get_default("out")
    assert f"/{out}/" in ignored
    exports = re.findall(r"deltaflow export \S+ --out (\w+)/", README)
    assert exports and all(f"/{folder}/" in ignored for folder in exports)


def test_the_test_extra_leaves_triton_out_and_ci_keeps_its_tests():
    pyproject = (ROOT / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)^\]", pyproject, re.S | re.M)
    assert test_extra and "triton" not in test_extra.group(1)  # 1 GB a CPU machine never uses
    assert re.search(r'^triton = \["triton', pyproject, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[test,triton]"' in ci  # the interpreter tests still run
    assert 'pip install -e ".[test,triton]" && python -m pytest -q' in README  # same as CI
