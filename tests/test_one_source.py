"""Facts written once: every place that used to keep its own copy now derives from one source,
and these tests fail if two places ever disagree again (issue 36)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from pathlib import Path

import pytest
import torch
from _inputs import make_inputs, reads_decay
from test_train import make, toy_config

from deltaflow import delta_rule
from deltaflow.lab.grid import RUNTIME_ONLY_FIELDS
from deltaflow.layers import DeltaAttention
from deltaflow.ops import delta_rule_step
from deltaflow.rules import RULES, eigenvalue, triton_rules
from deltaflow.train import TrainConfig, Trainer
from deltaflow.train import logging as train_logging
from deltaflow.train.config import _field, fields_left_out_of_run_ids, runtime_fields
from deltaflow.train.rundir import RUNTIME_FIELDS, training_differences


# ---------------------------------------------------------------------------- runtime fields
def test_runtime_fields_are_marked_once_and_both_users_derive_from_the_mark():
    marked = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("runtime")}
    assert RUNTIME_FIELDS == marked == runtime_fields()
    # the grid leaves out of its ids exactly the runtime fields marked in_run_id=False; the
    # list itself is pinned: committed grids' ids hash every other field (a new runtime field
    # is marked in_run_id=False, an old one may not move, test_grid_resume checks the ids)
    assert RUNTIME_ONLY_FIELDS == fields_left_out_of_run_ids()
    assert set(RUNTIME_ONLY_FIELDS) <= RUNTIME_FIELDS
    assert set(RUNTIME_ONLY_FIELDS) == {
        "ckpt_minutes",
        "compile",
        "tensorboard",
        "wandb",
        "context_parallel",
    }
    with pytest.raises(ValueError, match="runtime=True fields only"):
        _field(1.0, "a training field cannot leave the run id", in_run_id=False)


def test_resume_ignores_exactly_the_runtime_fields():
    saved = TrainConfig().to_dict()
    for name in saved:
        diffs = training_differences(saved, {**saved, name: "<changed>"})
        assert (diffs == []) == (name in RUNTIME_FIELDS), (name, diffs)


class _NullSink:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def log(self, step, scalars) -> None:
        pass

    def close(self) -> None:
        pass


def test_resuming_with_a_log_sink_added_is_not_refused(tmp_path, monkeypatch):
    # the packages need not be installed: the sinks are stand-ins, the resume check is real
    monkeypatch.setattr(train_logging, "TensorBoardSink", _NullSink)
    monkeypatch.setattr(train_logging, "WandbSink", _NullSink)
    cfg = toy_config(steps=4, ckpt_every=2, out_dir=str(tmp_path))
    model, task = make()
    Trainer(cfg, model=model, task=task).train()
    for sinks in ({"tensorboard": True}, {"wandb": True}, {"tensorboard": True, "wandb": True}):
        trainer = Trainer(cfg.replace(**sinks), model=make()[0], task=task)
        assert trainer.step == 4
        trainer.close()  # also releases the run folder's lock (issue 34)
    with pytest.raises(ValueError, match="cannot resume"):  # a training field still refuses
        Trainer(cfg.replace(lr=1e-3), model=make()[0], task=task)


# ---------------------------------------------------------------------------- gated_efla
READS_DECAY = sorted(n for n, r in RULES.items() if r.decay_coefficients is not None)


@pytest.mark.parametrize("rule", READS_DECAY)
def test_op_step_and_layer_give_a_rule_that_reads_the_decay_one_answer_without_it(rule):
    """One behaviour, from StepRule.check_decay: the op, the decode step and the layer all
    refuse such a rule without a decay (it would silently run as another rule)."""
    assert READS_DECAY == ["gated_efla"]  # the rules this fact is about, today
    x = make_inputs(1, 3, 2, 4, 4, rule=rule, decay=False)
    refused = f"rule '{rule}' reads the decay: "
    for backend in ("reference", "torch", "auto"):
        with pytest.raises(ValueError, match=refused + "give log_decay"):
            delta_rule(**x, rule=rule, backend=backend)
    state = x["initial_state"].clone()
    with pytest.raises(ValueError, match=refused + "give log_decay"):
        delta_rule_step(x["q"], x["k"], x["v"], x["beta"], state, rule=rule)
    with pytest.raises(ValueError, match=refused + "set use_decay=True"):
        DeltaAttention(16, num_heads=2, rule=rule)
    # with a decay of α = 1 it runs, as the rule it equals there (gated_efla: efla)
    x["log_decay"] = torch.zeros_like(x["beta"])
    o, _ = delta_rule(**x, rule=rule, backend="torch")
    o_efla, _ = delta_rule(**x, rule="efla", backend="torch")
    torch.testing.assert_close(o, o_efla, rtol=1e-12, atol=1e-12)


def test_a_rules_kernel_id_reads_the_decay_exactly_where_the_rule_does():
    """The Triton table's entry reads the decay where the rule does (gated_efla) and nowhere
    else: a rule given another kind's id would run other maths on the two backends, silently
    (28% apart for gated_efla with efla's kernel id), so the launch refuses it."""
    triton_backend = pytest.importorskip("deltaflow.ops.triton_backend")
    from deltaflow.ops.triton import rules as rule_table

    gated, efla = RULES["gated_efla"], RULES["efla"]
    assert gated.has_triton and "gated_efla" in triton_rules()
    assert set(rule_table.DECAY_MAPS) == {
        r.kernel_id for r in RULES.values() if reads_decay(r.name)
    }
    with pytest.raises(ValueError, match="reads the decay, but the Triton rule table's entry"):
        triton_backend.kernel_id_of(dataclasses.replace(gated, kernel_id=efla.kernel_id))
    with pytest.raises(ValueError, match="does not read the decay, but the Triton rule table"):
        triton_backend.kernel_id_of(dataclasses.replace(efla, kernel_id=gated.kernel_id))
    # the op's log α the host hands the kernels is the rule's own (step_inputs' third value)
    ld = torch.tensor([0.0, -1e-9, -0.3, -40.0], dtype=torch.float64)
    one = torch.ones_like(ld)
    _, _, op_log_decay = gated.decay_coefficients(one, one, ld, 1e-6)
    torch.testing.assert_close(rule_table.op_log_decay(gated.kernel_id, ld), op_log_decay)
    assert rule_table.op_log_decay(efla.kernel_id, ld) is ld


# ---------------------------------------------------------------------------- one name per thing
def test_gated_efla_names_the_rule_and_the_renamed_variant_stays_readable():
    from deltaflow.lab import get_preset
    from deltaflow.lab.grid import expand_grid
    from deltaflow.lab.presets import RENAMED_VARIANTS, VARIANTS, check_variants
    from deltaflow.lab.runner import load_runs

    # an old name never names a variant again; a variant named like a rule runs that rule
    assert not set(RENAMED_VARIANTS) & set(VARIANTS)
    assert set(RENAMED_VARIANTS.values()) <= set(VARIANTS)
    for name, model in VARIANTS.items():
        if name in RULES:
            assert model.get("rule", "delta") == name, name
    with pytest.raises(ValueError, match="variant 'gated_efla' is now called 'efla_decay'"):
        check_variants(["gated_efla"], "--variants")
    # the committed issue-11 grid trained the old variant: its records are read under the new
    # name with the ids today's grid computes (--resume and --report-only find every run)
    committed = Path(__file__).parents[1] / "results" / "issue11" / "lm_corpus_1pass"
    runs = load_runs(committed / "runs.jsonl")
    assert sum(r["variant"] == "efla_decay" for r in runs.values()) == 6
    # (the grid also holds issue 24's variants, trained with --variants beside the preset's)
    preset = get_preset("lm_corpus_1pass")
    trained = sorted({r["variant"] for r in runs.values()})
    specs = expand_grid(
        dataclasses.replace(preset, variants=trained), device="cuda", shared="shared"
    )
    assert set(runs) <= {s.run_id for s in specs}


# ---------------------------------------------------------------------------- rule lists
BUILT_IN = sorted(n for n, r in RULES.items() if r.source != "user")  # tests may register more
ROOT = Path(__file__).parents[1]


def _table_rules(path: Path, heading: str) -> list[str]:
    """The rule names of the first table after ``heading``: the first column's `name`s."""
    text = path.read_text()
    section = text[text.index(heading) :]
    rows, started = [], False
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cell = line.split("|")[1].strip()
            if cell.startswith("`") and cell.endswith("`"):
                rows.append(cell.strip("`"))
        elif started:
            break
    return rows


@pytest.mark.parametrize(
    ("doc", "heading"), [("README.md", "### Step rules"), ("docs/design.md", "## 2. Step rules")]
)
def test_the_docs_rule_tables_list_every_rule_once(doc, heading):
    rows = _table_rules(ROOT / doc, heading)
    assert sorted(rows) == BUILT_IN and len(rows) == len(set(rows)), rows


def test_hand_written_rule_lists_are_derived_from_the_rules():
    from _inputs import rule_variants

    from deltaflow.analysis.report import StudyConfig
    from deltaflow.cli import build_parser

    # layers, models, generation (a rule other tests registered is in RULES by now: left out)
    assert sorted({v["rule"] for v in rule_variants()} & set(BUILT_IN)) == BUILT_IN
    plain = [n for n in RULES if n != "linear" and RULES[n].decay_coefficients is None]
    assert StudyConfig().rules == plain
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    rule_help = next(a.help for a in train._actions if "--rule" in a.option_strings)
    assert all(name in rule_help for name in BUILT_IN), rule_help
    x = make_inputs(1, 2, 1, 2, 2, rule="delta")
    with pytest.raises(ValueError, match="accept beta=None") as refused:
        delta_rule(**{**x, "beta": None}, rule="delta")
    gateless = {n for n, r in RULES.items() if not r.needs_beta}
    assert gateless and all(repr(n) in str(refused.value) for n in gateless)


@pytest.mark.parametrize("rule", BUILT_IN)
def test_negative_mu_flag_matches_the_rule_and_the_ops_warning(rule):
    """StepRule.negative_mu is what the rule's maths says (μ < 0 for some β in (0, 1] and keys
    of the kind the rule expects), and the op warns about negative_eigenvalues exactly then."""
    step = RULES[rule]
    beta = torch.linspace(0.05, 1.0, 20, dtype=torch.float64)[:, None]
    top = 1.0 if step.qk_norm[1] == "l2" else 1e4  # unit keys: λ ≤ 1; raw keys: any norm
    lam = torch.logspace(-3, math.log10(top), 50, dtype=torch.float64)[None, :]
    mu = eigenvalue(rule, beta.expand(20, 50), lam.expand(20, 50))
    assert bool((mu < -1e-6).any()) == step.negative_mu, (rule, mu.min().item())  # rounding
    x = make_inputs(1, 3, 1, 3, 2, rule=rule, decay=reads_decay(rule))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        delta_rule(**x, rule=rule, negative_eigenvalues=True, backend="torch")
    warned = any("maps mu below -1" in str(w.message) for w in caught)
    assert warned == step.negative_mu


# ---------------------------------------------------------------------------- chunk, backends
def test_one_chunk_constant_and_one_default_chunk_size():
    import ast

    from deltaflow.ops.chunk import CPU_CHUNK_SIZE, TRITON_CHUNK_SIZE, default_chunk_size

    assert default_chunk_size("cpu") == CPU_CHUNK_SIZE
    assert default_chunk_size("cuda") == default_chunk_size(torch.device("meta")) == 64
    assert TRITON_CHUNK_SIZE == 64
    # the Triton common module takes its CHUNK from the one constant (read as text: no Triton
    # needed), and no module writes the number 64 as a chunk length of its own
    common = (ROOT / "deltaflow" / "ops" / "triton" / "common.py").read_text()
    assert "CHUNK = tl.constexpr(TRITON_CHUNK_SIZE)" in common
    for path in (ROOT / "deltaflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and "CHUNK" in t.id and t.id != "DEFAULT_CHUNK_SIZE"
                for t in node.targets
            ):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if path.relative_to(ROOT).as_posix() != "deltaflow/ops/chunk.py":
                    assert "64" not in ast.unparse(node.value), where


def test_the_flop_estimate_assumes_the_ops_chunk_on_the_models_device():
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM

    def flops(chunk_size):
        cfg = DeltaFlowConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2)
        cfg.chunk_size = chunk_size
        return DeltaFlowForCausalLM(cfg).estimate_flops_per_token(256)

    assert flops(None) == flops(32)  # on CPU the op runs 32-token chunks


def test_chunk_size_and_backend_are_checked_by_the_ops_functions_everywhere():
    from deltaflow.models import DeltaFlowConfig
    from deltaflow.ops.checks import BACKENDS

    x = make_inputs(1, 3, 1, 2, 2)
    for bad in (48, 0, -4, 2.0, True):
        for build in (
            lambda c: delta_rule(**x, chunk_size=c),
            lambda c: DeltaAttention(16, 2, chunk_size=c),
            lambda c: DeltaFlowConfig(chunk_size=c),
        ):
            with pytest.raises(ValueError, match="chunk_size must be a positive"):
                build(bad)
    message = "unknown backend 'cuda'; choose one of " + ", ".join(BACKENDS)
    for build in (
        lambda: delta_rule(**x, backend="cuda"),
        lambda: DeltaAttention(16, 2, backend="cuda"),
        lambda: DeltaFlowConfig(backend="cuda"),
    ):
        with pytest.raises(ValueError, match=message):
            build()
    from deltaflow.analysis.cli import OP_BACKENDS
    from deltaflow.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    backend = next(a for a in train._actions if "--backend" in a.option_strings)
    assert tuple(backend.choices) == BACKENDS and set(BACKENDS) < set(OP_BACKENDS)


def test_the_layers_arguments_are_declared_once():
    """DeltaAttention's signature is the declaration: build_mixer passes every argument by its
    config name, and DeltaFlowConfig has each one with the same default."""
    import inspect

    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
    from deltaflow.models.config import LAYER_ONLY_ARGS, delta_attention_arg_names

    layer = inspect.signature(DeltaAttention.__init__).parameters
    config = inspect.signature(DeltaFlowConfig.__init__).parameters
    for name in delta_attention_arg_names():
        assert name in config, f"DeltaAttention({name}=...) has no DeltaFlowConfig field"
        if layer[name].default is not inspect.Parameter.empty:
            assert config[name].default == layer[name].default, name
    assert set(layer) - {"self"} == set(delta_attention_arg_names()) | set(LAYER_ONLY_ARGS)
    # every non-default value reaches the layer
    given = dict(
        num_heads=2, head_dim=8, expand_v=2.0, num_v_heads=4, rule="efla", use_decay=True,
        negative_eigenvalues=True, beta_activation="softplus", qk_norm=["none", "l2"],
        use_short_conv=True, conv_size=3, use_output_gate=False, norm_eps=1e-4, eps=1e-5,
        chunk_size=8, backend="torch",
    )  # fmt: skip
    model = DeltaFlowForCausalLM(
        DeltaFlowConfig(vocab_size=8, hidden_size=16, num_layers=1, **given)
    )
    mixer = model.model.layers[0].mixer
    assert (mixer.head_dim, mixer.head_v_dim, mixer.o_norm.eps) == (8, 16, 1e-4)
    assert (mixer.q_norm, mixer.k_norm) == ("none", "l2")
    for name in ("num_heads", "num_v_heads", "rule", "use_decay", "negative_eigenvalues"):
        assert getattr(mixer, name) == given[name], name
    for name in ("beta_activation", "use_short_conv", "conv_size", "use_output_gate", "eps"):
        assert getattr(mixer, name) == given[name], name
    assert (mixer.chunk_size, mixer.backend) == (8, "torch")


def test_every_doc_the_code_cites_exists():
    """``docs/x.md`` and ``benchmarks/x.md`` cited in deltaflow's source are real files (a
    renamed doc left segments.py citing DESIGN.md)."""
    import re

    cited = set()
    for path in (ROOT / "deltaflow").rglob("*.py"):
        for match in re.finditer(
            r"\b((?:docs|benchmarks)/[\w./-]+\.md|[A-Z]+\.md)\b", path.read_text()
        ):
            cited.add((match.group(1), path.relative_to(ROOT).as_posix()))
    assert cited
    missing = [(doc, src) for doc, src in cited if not (ROOT / doc).is_file()]
    assert not missing, missing


# ---------------------------------------------------------------------------- rooms
def test_parallelism_lives_in_one_package_and_the_old_imports_still_work():
    from deltaflow.parallel import data_layout, fsdp
    from deltaflow.train import context_parallel as old_layout
    from deltaflow.train import parallel as old_fsdp

    assert old_layout.DataLayout is data_layout.DataLayout
    for name in old_fsdp.__all__:
        assert getattr(old_fsdp, name) is getattr(fsdp, name), name
    # the moved modules are shims: no code of their own
    for old in (old_layout, old_fsdp):
        text = Path(old.__file__).read_text()
        assert "def " not in text and "class " not in text, old.__file__


def test_the_split_modules_keep_their_old_imports():
    from deltaflow.analysis import report, verdicts
    from deltaflow.analysis.config import StudyConfig
    from deltaflow.analysis.op_crosscheck import op_crosscheck
    from deltaflow.models import block, modeling

    assert report.StudyConfig is StudyConfig and report.op_crosscheck is op_crosscheck
    assert report.verdict is verdicts.verdict
    assert modeling.SwiGLU is block.SwiGLU and modeling.DeltaFlowBlock is block.DeltaFlowBlock


def test_no_file_of_the_package_is_over_600_lines():
    """Rooms a newcomer can hold: every file under deltaflow/ (code, docs, data), no exceptions."""
    files = [
        p
        for p in (ROOT / "deltaflow").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")
    ]
    assert any(p.name == "trainer.py" for p in files) and any(p.parent.name == "cli" for p in files)
    sizes = {
        p.relative_to(ROOT).as_posix(): len(p.read_text(errors="replace").splitlines())
        for p in files
    }
    assert {p: n for p, n in sizes.items() if n > 600} == {}


def test_the_cut_trainer_and_cli_keep_their_old_imports():
    """Issue 36: trainer.py's building, distributed and run-folder parts moved to build.py,
    dist.py and runfolder.py, checkpoint.py's RNG to rng.py, cli.py to the cli/ package; the
    names are still found where they were."""
    import deltaflow.cli as cli
    from deltaflow.cli import COMMANDS
    from deltaflow.train import build, checkpoint, dist, rng, runfolder, trainer

    for name in ("build_model", "build_task", "model_logits", "param_groups", "task_vocab_size"):
        assert getattr(trainer, name) is getattr(build, name), name
    assert trainer.DistInfo is dist.DistInfo and trainer.resolve_device is dist.resolve_device
    assert trainer.RunPlan is runfolder.RunPlan
    for name in ("rng_state", "set_rng_state", "gather_rng_states"):
        assert getattr(checkpoint, name) is getattr(rng, name), name
    for _, where in COMMANDS.values():
        module, function = where.split(":")
        if module.startswith("deltaflow.cli."):
            assert getattr(cli, function) is getattr(importlib.import_module(module), function)
    assert cli.cmd_eval is importlib.import_module("deltaflow.cli.eval").cmd_eval
