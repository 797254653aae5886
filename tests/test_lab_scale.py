"""The paper-scale presets (issue 11): what each grid expands to, the weight-decay sweep, the
fixed training sets of MAD and MQAR, and how parallel grid workers are spread over GPUs.

Nothing here trains a model; every test builds grids, tasks or records (fast on a CPU).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing as mp
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import deltaflow.lab.runner as runner
from deltaflow.cli import main
from deltaflow.lab import Preset, expand_grid, get_preset, select_best
from deltaflow.lab.presets import CORPUS_TRAIN_TOKENS, VARIANTS
from deltaflow.lab.report import results_table
from deltaflow.tasks import get_task
from deltaflow.tasks.mad import MAD_TASKS
from deltaflow.train import build_task

SHARED = Path(__file__).parents[2] / "shared"


def _specs(name: str, **kw):
    return expand_grid(get_preset(name), device="cpu", shared="/shared", **kw)


# ------------------------------------------------------------------------- presets
def test_state_tracking_preset_is_the_papers_table():
    specs = _specs("state_tracking")
    variants = ["deltanet", "deltanet_neg", "gated_deltanet_neg", "efla", "trapezoid"]
    # 3 tasks x 5 variants x 3 lrs x 3 seeds, best of seeds
    assert len(specs) == 3 * 5 * 3 * 3 and get_preset("state_tracking").seed_aggregate == "max"
    assert sorted({s.variant for s in specs}) == sorted(variants)
    assert VARIANTS["gated_deltanet_neg"] == {
        "rule": "delta",
        "use_decay": True,
        "negative_eigenvalues": True,
    }
    for s in specs:
        model = s.config.model
        assert (model["hidden_size"], model["num_layers"], model["num_heads"]) == (128, 2, 4)
    tasks = {s.cell: build_task(s.config) for s in specs if s.seed == 0}
    assert tasks["mod_arith"].modulus == 5 and tasks["mod_arith_brackets"].modulus == 5
    assert len(tasks["mod_arith"].op_ids) == 3 and not tasks["mod_arith_brackets"].mult
    for task in tasks.values():  # train 3-40, test 40-256
        assert (task.min_len, task.max_len) in ((3, 40), (4, 40))  # mod arith: even, >= 4
        assert (task.eval_min_len, task.eval_max_len) == (40, 256)
        assert task.eval_lengths == [40, 64, 128, 256]


def test_mqar_preset_has_every_rule_three_widths_and_zoologys_training_set():
    specs = _specs("mqar_512")
    rules = {VARIANTS[s.variant].get("rule") for s in specs if s.variant != "transformer"}
    assert rules == {
        "linear",
        "delta",
        "efla",
        "longhorn",
        "kaczmarz",
        "relaxed_kaczmarz",
        "trapezoid",
    }
    assert {"gated_deltanet", "transformer", "linear_zoology"} <= {s.variant for s in specs}
    # Zoology's linear attention: none of the short convolution, q/k norm, output gate
    zoology = next(s for s in specs if s.variant == "linear_zoology").config.model
    assert (zoology["use_short_conv"], zoology["qk_norm"], zoology["use_output_gate"]) == (
        False,
        "none",
        False,
    )
    assert {s.width for s in specs} == {64, 128, 256} and len({s.lr for s in specs}) >= 3
    kw = specs[0].config.task_kwargs
    assert (kw["seq_len"], kw["num_kv_pairs"], kw["vocab_size"]) == (512, 64, 8192)
    assert kw["num_train_examples"] == 100_000


def test_mad_preset_runs_all_six_tasks_over_lr_x_weight_decay():
    preset = get_preset("mad")
    specs = _specs("mad")
    assert set(preset.cells) == set(MAD_TASKS)
    assert preset.lrs == [1e-4, 5e-4, 1e-3] and preset.weight_decays == [0.0, 0.1]
    assert len(specs) == 6 * 5 * 3 * 2
    assert {s.variant for s in specs} == {
        "deltanet",
        "gated_deltanet",
        "efla",
        "relaxed_kaczmarz",
        "transformer",
    }
    assert {(s.lr, s.weight_decay) for s in specs} == {
        (lr, wd) for lr in preset.lrs for wd in preset.weight_decays
    }
    assert all(s.config.weight_decay == s.weight_decay for s in specs)
    for s in specs:
        assert s.config.model["hidden_size"] == 128 and s.config.model["num_layers"] == 2
        assert s.config.eval_kwargs["num_examples"] == 1280
    # MAD's training-set sizes, through the task defaults the cells use
    sizes = {s.cell: build_task(s.config).num_train_examples for s in specs if s.seed == 0}
    assert sizes == {name: (256 if name == "memorize" else 12_800) for name in MAD_TASKS}


def test_lm_50m_preset_budget_seeds_and_lengths():
    preset = get_preset("lm_corpus_50m")
    specs = _specs("lm_corpus_50m")
    cfg = specs[0].config
    seq_len = cfg.task_kwargs["seq_len"]
    assert cfg.steps * cfg.batch_size * seq_len >= 50_000_000
    assert cfg.eval_lengths == [seq_len, 2 * seq_len]
    seeds = {v: sorted(s.seed for s in specs if s.variant == v) for v in preset.variants}
    for v in ("deltanet", "efla", "gated_deltanet", "longhorn", "kaczmarz", "relaxed_kaczmarz"):
        assert seeds[v] == [0, 1]
    for v in ("efla_decay", "relaxed_kaczmarz_noqnorm", "transformer"):
        assert seeds[v] == [0]
    assert cfg.task_kwargs["data_dir"] == "/shared/corpus"


def test_lm_one_pass_preset_is_the_50m_grid_at_one_pass_over_the_corpus_with_six_seeds():
    one, full = _specs("lm_corpus_1pass"), _specs("lm_corpus_50m")
    cfg = one[0].config
    tokens = cfg.steps * cfg.batch_size * cfg.task_kwargs["seq_len"]
    assert 0.99 * CORPUS_TRAIN_TOKENS <= tokens <= CORPUS_TRAIN_TOKENS
    # the 50M grid's runs (and more seeds) but for the steps and a validation curve: new ids
    assert {(s.variant, s.seed, s.lr) for s in full} < {(s.variant, s.seed, s.lr) for s in one}
    assert sorted((s.variant, s.seed) for s in one) == sorted(
        (v, seed) for v in get_preset("lm_corpus_1pass").variants for seed in range(6)
    )
    a, b = cfg.to_dict(), full[0].config.to_dict()
    assert {k for k in a if a[k] != b[k]} == {"steps", "eval_every"}
    assert 0 < cfg.eval_every < cfg.steps
    assert not {s.run_id for s in one} & {s.run_id for s in full}
    assert get_preset("lm_corpus_1pass").contrast == ("efla", "deltanet")


@pytest.mark.skipif(not (SHARED / "corpus").is_dir(), reason="needs ../shared/corpus")
def test_corpus_train_tokens_is_the_suggested_splits_size(tmp_path):
    task = get_task(
        "lm",
        data_dir=SHARED / "corpus",
        tokenizer="bpe",
        tokenizer_path=SHARED / "tokenizers" / "gpt2.tiktoken",
        cache_dir=tmp_path,
    )
    assert len(task.stream("train")) == CORPUS_TRAIN_TOKENS


def test_presets_dry_run_from_the_command_line(capsys):
    expected = {
        "state_tracking": "135 runs of 2000 steps",
        "mqar_512": "90 runs of 2000 steps",  # 81 + linear_zoology (issue 24)
        "mad": "180 runs of 2000 steps",
        "lm_corpus_50m": "15 runs of 3052 steps",
    }
    for name, head in expected.items():
        assert main(["compare", "--preset", name, "--dry-run", "--shared", "/x"]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(head)
    # --wds replaces the sweep; --seeds gives every variant the same seeds
    argv = ["compare", "--preset", "mad", "--dry-run", "--cells", "compress", "--wds", "0"]
    assert main([*argv, "--lrs", "1e-3", "--variants", "deltanet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("deltanet-compress-lr0.001-wd0-s0-") and len(lines) == 2
    argv = ["compare", "--preset", "lm_corpus_50m", "--dry-run", "--seeds", "1", "--shared", "/x"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("9 runs")


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--wds", "0,-0.1", "--wds: every value must be >= 0.0"),
        ("--wds", "0,x", "--wds: 'x' is not a valid float"),
        ("--lrs", "0", "--lrs: learning rates must be > 0"),
        ("--widths", "64,1.5", "--widths: '1.5' is not a valid int"),
        ("--seeds", "0", "--seeds must be >= 1"),
    ],
)
def test_bad_grid_flags_are_errors_naming_the_flag(flag, value, message, capsys):
    assert main(["compare", "--preset", "mad", "--dry-run", flag, value]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------- lr x wd selection
def _record(lr, wd, seed, value):
    return {
        "variant": "a",
        "cell": "c",
        "width": None,
        "lr": lr,
        "weight_decay": wd,
        "seed": seed,
        "status": "ok",
        "eval": {"m": value},
    }


def test_select_best_picks_the_best_lr_and_weight_decay_pair():
    preset = Preset(
        "p", "", {}, {"c": {"task": "mqar"}}, ["a"], [0.1, 0.2], seeds=[0, 1], metric="m"
    )
    preset.weight_decays = [0.0, 0.1]
    records = [
        _record(0.1, 0.0, 0, 0.5),
        _record(0.1, 0.0, 1, 0.5),
        _record(0.1, 0.1, 0, 0.9),  # the best pair: mean 0.85
        _record(0.1, 0.1, 1, 0.8),
        _record(0.2, 0.0, 0, 0.7),
        _record(0.2, 0.0, 1, 0.7),
        _record(0.2, 0.1, 0, 0.2),
        _record(0.2, 0.1, 1, 0.2),
    ]
    (row,) = select_best(records, preset)
    assert (row["best_lr"], row["best_wd"]) == (0.1, 0.1) and row["value"] == pytest.approx(0.85)
    assert row["n_seeds"] == 2  # the two seeds of that pair, not all eight runs
    assert results_table([row], preset).splitlines()[2].endswith("| 0.1, 0.1 |")
    # a grid that does not sweep weight decay pools over it, as before (one lr, all seeds)
    preset.weight_decays = None
    records = [_record(0.1, 0.0, 0, 0.4), _record(0.1, 0.0, 1, 0.6), _record(0.2, 0.0, 0, 0.3)]
    (row,) = select_best(records, preset)
    assert row["best_lr"] == 0.1 and row["best_wd"] is None and row["n_seeds"] == 2


def test_run_ids_name_the_weight_decay_only_when_it_is_swept():
    mad = _specs("mad")
    assert all(f"-wd{s.weight_decay:g}-" in s.run_id for s in mad)
    assert not any("-wd" in s.run_id for s in _specs("state_tracking"))
    assert len({s.run_id for s in mad}) == len(mad)


# ------------------------------------------------------------------------- fixed training sets
def test_mad_training_set_is_fixed_deterministic_and_the_right_size():
    a, b = get_task("in_context_recall", seed=3), get_task("in_context_recall", seed=3)
    pool = a._train_pool()
    assert pool["input_ids"].shape == (12_800, 128)
    assert torch.equal(pool["input_ids"], b._train_pool()["input_ids"])
    other = get_task("in_context_recall", seed=4)._train_pool()["input_ids"]
    assert not torch.equal(pool["input_ids"], other)
    rows = {tuple(r) for r in pool["input_ids"].tolist()}
    batch = a.get_batch(64, "train", step=11)
    assert all(tuple(r) in rows for r in batch["input_ids"].tolist())
    assert torch.equal(batch["input_ids"], b.get_batch(64, "train", step=11)["input_ids"])
    assert get_task("memorize")._train_pool()["input_ids"].shape[0] == 256


def test_mqar_fixed_training_set_option():
    kw = dict(seq_len=32, num_kv_pairs=4, vocab_size=64, num_train_examples=300, seed=1)
    a, b = get_task("mqar", **kw), get_task("mqar", **kw)
    assert a._train_pool()["input_ids"].shape == (300, 32)
    assert torch.equal(a._train_pool()["labels"], b._train_pool()["labels"])
    rows = {tuple(r) for r in a._train_pool()["input_ids"].tolist()}
    assert all(tuple(r) in rows for r in a.get_batch(50, "train", 7)["input_ids"].tolist())
    fresh = get_task("mqar", **{**kw, "num_train_examples": None})
    assert fresh.num_train_examples is None  # the default: a fresh stream
    with pytest.raises(ValueError, match="num_train_examples"):
        get_task("mqar", **{**kw, "num_train_examples": 0})


# ------------------------------------------------------------------------- GPU placement
def test_workers_are_spread_round_robin_over_the_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    counter = mp.get_context("spawn").Value("i", 0)
    seen = []
    for _ in range(5):
        runner._init_worker(1, counter, num_gpus=2)
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
        del os.environ["CUDA_VISIBLE_DEVICES"]
    assert seen == ["0", "1", "0", "1", "0"]
    # a parent restricted to GPUs 2,3 hands those out, not 0,1
    counter.value = 0
    for expected in ("2", "3", "2"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
        runner._init_worker(1, counter, num_gpus=2)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
    # one GPU (or none): the environment is left alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    runner._init_worker(1, counter, num_gpus=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


def test_run_grid_on_two_gpus_hands_each_worker_the_next_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    preset = Preset("p", "", {"steps": 1}, {"c": {"task": "mqar"}}, ["linear"], [1e-3, 2e-3])
    preset.seeds = [0, 1]
    specs = expand_grid(preset, device="cuda")
    assert runner.gpus_to_spread_over(specs) == 2
    assert runner.gpus_to_spread_over(expand_grid(preset, device="cuda:1")) == 0
    assert runner.gpus_to_spread_over(expand_grid(preset, device="cpu")) == 0

    made = {}

    class InlinePool:  # stands in for ProcessPoolExecutor: every "worker" runs inline
        def __init__(self, max_workers, mp_context, initializer, initargs):
            made.update(max_workers=max_workers, initargs=initargs)
            self.initializer, self.initargs = initializer, initargs
            self.parent_env = os.environ.get("CUDA_VISIBLE_DEVICES")

        def submit(self, fn, spec):
            # a fresh worker process per run: it starts from the parent's environment
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if self.parent_env is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.parent_env
            self.initializer(*self.initargs)
            future = Future()
            future.set_result({**fake_run(spec), "gpu": os.environ["CUDA_VISIBLE_DEVICES"]})
            return future

        def shutdown(self, cancel_futures=False):
            pass

    def fake_run(spec):
        return {"id": spec.run_id, "status": "ok", "eval": {}, "seconds": 0.0}

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", InlinePool)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    records = runner.run_grid(specs, tmp_path, progress=False, jobs=4)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    assert made["max_workers"] == 4 and made["initargs"][2] == 2
    assert sorted(r["gpu"] for r in records) == ["0", "0", "1", "1"]


def test_run_ids_do_not_depend_on_where_the_shared_folder_is(tmp_path):
    """The same LM run on another machine (another checkout path) keeps its id, so --resume
    and --report-only find it; a different task argument still changes the id."""
    preset = get_preset("lm_corpus_50m")
    here = expand_grid(preset, device="cuda", shared="/work/main/shared")
    there = expand_grid(preset, device="cuda", shared=str(tmp_path / "elsewhere" / "shared"))
    assert "/work/main/shared/corpus" in json.dumps(here[0].config.to_dict())  # paths resolved
    assert [s.run_id for s in here] == [s.run_id for s in there]
    longer = expand_grid(
        preset,
        device="cuda",
        shared="/work/main/shared",
        overrides={"task_kwargs": {"seq_len": 1024}},
    )
    assert here[0].run_id != longer[0].run_id


def test_state_tracking_uniform_is_state_tracking_with_the_papers_metric():
    # issue 24: only the evaluation lengths differ; the report keeps the old per-length columns
    old, new = _specs("state_tracking"), _specs("state_tracking_uniform")
    assert [(s.variant, s.cell, s.lr, s.seed) for s in old] == [
        (s.variant, s.cell, s.lr, s.seed) for s in new
    ]
    for a, b in zip(old, new):
        assert b.config.task_kwargs == {**a.config.task_kwargs, "eval_lengths": "uniform"}
        assert a.run_id != b.run_id  # the old grid's runs keep their ids and tables
    preset = get_preset("state_tracking_uniform")
    assert preset.metric == "scaled_accuracy" and preset.seed_aggregate == "max"
    assert preset.table_metrics[1:] == [f"scaled_accuracy@{L}" for L in (40, 64, 128, 256)]
