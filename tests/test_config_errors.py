"""Configs say no, and the CLI says why in one line: unknown keys with a did-you-mean in every
section, booleans only from booleans, model folders that do not match their config refused,
and every user error a one-line ``deltaflow CMD: error: ...`` with exit code 2, no traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from deltaflow.cli import build_parser, main
from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM
from deltaflow.train import TrainConfig, apply_overrides

TINY = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--backend", "torch"]
TINY_MQAR = ["--task", "mqar", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "24"]
FAST = ["--device", "cpu", "--no-progress", "--batch-size", "8", "--threads", "1"]
SMALL_EVAL = ["--set", "eval_kwargs={num_examples: 16, batch_size: 16}"]
ROOT = Path(__file__).parents[1]


def one_line_error(capsys, argv: list[str], *fragments: str, command: str = "train") -> str:
    """Run the CLI in-process: exit code 2 and a single 'deltaflow CMD: error:' line holding
    every fragment, with no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"deltaflow {command}: error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------- config sections
@pytest.mark.parametrize(
    "argv",
    [
        ["--set", "model.hiden_size=64"],
        ["--set", "model.hiden_size=64", "--rule", "efla"],
    ],
)
def test_set_with_a_typo_in_the_model_section_is_refused(capsys, argv):
    one_line_error(
        capsys,
        ["train", *argv, "--print-config"],
        "model: unknown key 'hiden_size'",
        "did you mean 'hidden_size'",
    )


def test_unknown_model_key_lists_the_valid_ones(capsys):
    line = one_line_error(
        capsys, ["train", "--set", "model.nonexistent=1", "--print-config"], "'nonexistent'"
    )
    assert "valid keys:" in line and "hidden_size" in line


def test_yaml_model_section_typo_and_string_booleans_are_refused(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: mqar\nmodel: {hiden_size: 64}\n")
    one_line_error(
        capsys,
        ["train", "--config", str(cfg), "--print-config"],
        str(cfg),
        "unknown key 'hiden_size'",
        "did you mean 'hidden_size'",
    )
    for text, name in [
        ('model: {use_decay: "false"}\n', "use_decay"),
        ("model: {negative_eigenvalues: 'no'}\n", "negative_eigenvalues"),
        ('resume: "false"\n', "resume"),
        ("task: parity\ntask_kwargs: {label_every_token: 'false'}\n", "label_every_token"),
    ]:
        cfg.write_text(text)
        one_line_error(
            capsys,
            ["train", "--config", str(cfg), "--print-config"],
            name,
            "must be true or false",
            "the string",
        )
    # Real YAML booleans (also YAML 1.1's unquoted yes/no) are booleans and accepted.
    cfg.write_text("model: {use_decay: no, negative_eigenvalues: true}\nprogress: false\n")
    assert main(["train", "--config", str(cfg), "--print-config"]) == 0
    assert "use_decay: false" in capsys.readouterr().out


def test_every_section_reports_unknown_keys_with_a_suggestion():
    cases = [
        ({"stepz": 3}, "config: unknown key 'stepz' (did you mean 'steps'?)"),
        ({"task_kwargs": {"seq_lenn": 8}}, "unknown key 'seq_lenn' (did you mean 'seq_len'?)"),
        ({"task": "parity", "task_kwargs": {"max_lenn": 8}}, "did you mean 'max_len'"),
        ({"eval_kwargs": {"num_example": 8}}, "did you mean 'num_examples'"),
        ({"model": {"num_layer": 2}}, "did you mean 'num_layers'"),
        ({"task": "mqr"}, None),  # unknown task names are refused when the task is built
    ]
    for data, message in cases:
        if message is None:
            TrainConfig.from_dict(data)
            continue
        with pytest.raises(ValueError) as info:
            TrainConfig.from_dict(data)
        assert message in str(info.value)
        assert "\n" not in str(info.value)
    from deltaflow.tasks import get_task

    with pytest.raises(ValueError, match=r"unknown task 'mqr' \(did you mean 'mqar'\?\)"):
        get_task("mqr")


def test_types_and_cross_field_checks():
    for data, match in [
        ({"steps": "3"}, "steps must be an integer"),
        ({"steps": 2.5}, "steps must be an integer"),
        ({"lr": "fast"}, "lr must be a number"),
        ({"lr": True}, "lr must be a number"),
        ({"device": "bogus"}, "device 'bogus' is not a device"),
        ({"eval_lengths": [8, "16"]}, r"eval_lengths\[1\] must be an integer"),
        ({"eval_split": "dev"}, "eval_split must be one of"),
        ({"batch_size": 10, "grad_accum": 3}, "multiple of grad_accum"),
        ({"model": {"hidden_size": 30, "num_heads": 4}}, "divisible by num_heads"),
        ({"model": {"rule": 3}}, "rule must be a string"),
        # YAML's bare off is False: the error says how to quote it (session 31: --set compile=off)
        (
            {"compile": False},
            r"compile must be a string, got False .*quote the word, compile='off'",
        ),
        ({"task_kwargs": []}, "task_kwargs must be a mapping"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            TrainConfig.from_dict(data)
    # YAML 1.1 reads "3e-4" as a string: numeric strings are still numbers for float fields.
    assert TrainConfig(lr="3e-4").lr == 3e-4
    assert TrainConfig(model={"norm_eps": "1e-6"}).model == {"norm_eps": "1e-6"}


def test_lm_without_data_dir_names_the_missing_argument(capsys):
    one_line_error(
        capsys, ["train", "--task", "lm", "--device", "cpu"], "task 'lm' needs", "--data-dir"
    )


# ---------------------------------------------------------------------------- DeltaFlowConfig
def test_deltaflow_config_refuses_unknown_keys_but_accepts_transformers_own(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'hiden_size' \(did you mean 'hidden_size'"):
        DeltaFlowConfig(hiden_size=32)
    with pytest.raises(TypeError, match="use_decay must be true or false"):
        DeltaFlowConfig(use_decay="false")
    with pytest.raises(TypeError, match="tie_word_embeddings must be true or false"):
        DeltaFlowConfig(tie_word_embeddings="no")
    # What transformers itself passes (saved, loaded, for_model, pipeline bookkeeping) is fine.
    cfg = DeltaFlowConfig(
        vocab_size=11,
        hidden_size=16,
        num_heads=2,
        name_or_path="x",
        architectures=["DeltaFlowForCausalLM"],
        torch_dtype="float32",
        transformers_version="5.0.0",
        id2label={0: "a"},
        auto_map={},
        output_attentions=False,
    )
    alias = AutoConfig.for_model("deltaflow", num_hidden_layers=2, hidden_size=16, num_heads=2)
    assert alias.num_layers == 2
    cfg.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).hidden_size == 16


def _saved_model(path: Path, tie: bool = True) -> DeltaFlowForCausalLM:
    torch.manual_seed(0)
    cfg = DeltaFlowConfig(
        vocab_size=11, hidden_size=16, num_layers=1, num_heads=2, tie_word_embeddings=tie
    )
    model = DeltaFlowForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def test_model_folder_with_a_typo_or_wrong_weights_refuses_to_load(tmp_path):
    model = _saved_model(tmp_path)
    config_path, weights_path = tmp_path / "config.json", tmp_path / "model.safetensors"
    weights = load_file(weights_path)
    good_config = json.loads(config_path.read_text())

    config_path.write_text(json.dumps({**good_config, "hiden_size": 32}))
    with pytest.raises(ValueError, match=r"unknown key 'hiden_size' \(did you mean"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    config_path.write_text(json.dumps(good_config))

    missing = {k: v for k, v in weights.items() if "q_proj" not in k}
    save_file(missing, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing model.layers.0.mixer.q_proj.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="refusing to load a partly random model"):
        DeltaFlowForCausalLM.from_pretrained(tmp_path)
    # strict=False is the way to load it anyway (and the report is still available).
    loaded, info = DeltaFlowForCausalLM.from_pretrained(
        tmp_path, strict=False, output_loading_info=True
    )
    assert info["missing_keys"]

    save_file({**weights, "extra.weight": torch.zeros(2)}, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected extra.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)

    save_file(weights, weights_path, metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 11, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_token_ids_outside_the_vocabulary_are_a_value_error():
    cfg = DeltaFlowConfig(vocab_size=11, hidden_size=16, num_layers=1, num_heads=2)
    model = DeltaFlowForCausalLM(cfg).eval()
    for bad in (11, 40, -1):
        ids = torch.tensor([[1, 2, bad]])
        with pytest.raises(ValueError, match=r"input_ids .*vocab_size=11"):
            model(ids)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        model(torch.zeros(1, 3))


# ---------------------------------------------------------------------------- CLI: one line, exit 2
def test_cli_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("task: mqar\nmodel:\n  rule: delta\n hidden_size: 3\n")
    one_line_error(
        capsys, ["train", "--config", str(bad_yaml)], str(bad_yaml), "invalid YAML", "line 4"
    )
    one_line_error(
        capsys, ["train", "--config", str(tmp_path / "none.yaml")], "none.yaml does not exist"
    )
    one_line_error(capsys, ["train", "--config", str(tmp_path)], "is a directory")
    one_line_error(capsys, ["train", "--device", "bogus"], "--device", "'bogus' is not a device")
    if not torch.cuda.is_available():
        one_line_error(
            capsys, ["train", *TINY_MQAR, *TINY, "--device", "cuda"], "no CUDA GPU", "--device cpu"
        )
        # compare: one line up front, not a grid of failed runs
        argv = ["compare", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "cmp")]
        one_line_error(capsys, argv, "no CUDA GPU", command="compare")
    one_line_error(
        capsys,
        ["train", "--task", "lm", "--data-dir", str(tmp_path), "--tokenizer", "bpe"],
        "--tokenizer-path",
    )
    a_file = tmp_path / "file"
    a_file.write_text("x")
    one_line_error(capsys, ["train", *TINY_MQAR, *TINY, *FAST, "--out", str(a_file)], "is a file")
    one_line_error(
        capsys, ["train", *TINY_MQAR, *TINY, *FAST, "--out", str(a_file / "run")], "which is a file"
    )
    one_line_error(capsys, ["train", "--set", "lr=[1,"], "lr=[1,", "invalid value")
    one_line_error(capsys, ["train", "--eval-lengths", "8,x"], "--eval-lengths")
    one_line_error(capsys, ["train", "--threads", "0"], "--threads")
    one_line_error(
        capsys,
        ["eval", str(tmp_path / "nothing")],
        "does not exist",
        command="eval",
    )


def test_compare_report_only_on_a_fresh_clone(tmp_path, monkeypatch, capsys):
    """The README's `deltaflow compare --preset mqar_512 --report-only` before any run: no
    missing-folder error; the report says that nothing has been trained yet."""
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--preset", "mqar_512", "--report-only", "--no-progress"]) == 0
    assert "not trained yet" in capsys.readouterr().out
    assert (tmp_path / "runs" / "compare" / "mqar_512" / "results.md").is_file()


def test_unknown_flag_is_one_line_with_a_suggestion(capsys):
    """No 34 lines of usage above the error: the error line alone, with its did-you-mean."""
    line = one_line_error(capsys, ["train", "--hiden-size", "64"], "--hiden-size")
    assert "did you mean --hidden-size?" in line
    with pytest.raises(SystemExit):
        main(["train", "--bogus-flag"])
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "deltaflow train: error: unrecognized argument: --bogus-flag (see deltaflow train -h)"
    ]
    with pytest.raises(SystemExit):  # argparse's other errors: one line too
        main(["train", "--steps", "many"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "argument --steps: invalid int value: 'many'" in err[0]
    with pytest.raises(SystemExit):
        main(["trian", "--steps", "3"])
    assert "(did you mean 'train'?)" in capsys.readouterr().err


def test_every_typo_of_a_config_in_one_message(tmp_path, capsys):
    path = tmp_path / "typos.yaml"
    path.write_text("stepz: 10\ntask_kwargs: {seq_lenn: 64}\nmodel: {hiden_size: 64}\n")
    one_line_error(
        capsys,
        ["train", "--config", str(path), "--print-config"],
        "unknown key 'stepz' (did you mean 'steps'?)",
        "model: unknown key 'hiden_size' (did you mean 'hidden_size'?)",
        "unknown key 'seq_lenn' (did you mean 'seq_len'?)",
    )
    with pytest.raises(ValueError, match="'lrr'.*'eval_kwargz'.*model: unknown key 'rul'"):
        TrainConfig.from_dict({"lrr": 1, "eval_kwargz": {}, "model": {"rul": "efla"}})


def test_help_starts_without_torch_or_transformers():
    """`deltaflow --help` imports neither (measured: 0.19 s of CPU, ~1 s wall on the loaded
    2-core box; it took 6.9 s when the trainer and transformers came first)."""
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from deltaflow.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seconds, torch_loaded, transformers_loaded = out.stdout.split()[-3:]
    assert (torch_loaded, transformers_loaded) == ("False", "False")
    assert float(seconds) < 3.0


def test_binary_corpus_file_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DELTAFLOW_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(10):
        (data / f"doc{i}.txt").write_text(f"document number {i}\n")
    (data / "blob.txt").write_bytes(bytes(range(128, 256)) * 4)
    argv = ["train", "--task", "lm", "--data-dir", str(data), "--seq-len", "8", *TINY, *FAST]
    one_line_error(capsys, [*argv, "--steps", "1"], "blob.txt", "not UTF-8")


def test_eval_of_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY_MQAR, *TINY, *FAST, *SMALL_EVAL, "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    (ckpt,) = (out / "checkpoints").glob("step_*")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    # the manifest catches it before the file is read (issue 34 item 6) ...
    one_line_error(
        capsys,
        ["eval", str(out), "--device", "cpu"],
        "model.safetensors does not match its SHA-256 in manifest.json (changed or truncated)",
        command="eval",
    )
    # ... and unchecked (--trust-checkpoint) reading it fails with one line too
    one_line_error(
        capsys,
        ["eval", str(out), "--device", "cpu", "--trust-checkpoint"],
        "model.safetensors cannot be read",
        "truncated or corrupt",
        command="eval",
    )
    weights.write_bytes(data[:50])
    one_line_error(
        capsys, ["eval", str(out), "--trust-checkpoint"], "model.safetensors", command="eval"
    )
    # generate on a checkpoint that is not a language model: one line too.
    weights.write_bytes(data)
    one_line_error(capsys, ["generate", str(out)], "language-model", command="generate")


def test_debug_switches_show_the_traceback(monkeypatch, capsys):
    with pytest.raises(ValueError, match="unknown key 'hiden_size'"):
        main(["train", "--set", "model.hiden_size=1", "--print-config", "--traceback"])
    monkeypatch.setenv("DELTAFLOW_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown key 'hiden_size'"):
        main(["train", "--set", "model.hiden_size=1", "--print-config"])


def test_a_real_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("DELTAFLOW_DEBUG", None)
    run = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "train", "--device", "cuda:99", *TINY_MQAR],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("deltaflow train: error: device")


# ---------------------------------------------------------------------------- flags and help
def test_train_flags_come_from_train_config_fields():
    from deltaflow.cli.train import _config_flags

    flags = {f.name: flag for flag, f, _ in _config_flags()}
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"TrainConfig.{f.name} has no help text"
        if f.metadata.get("cli", True):
            assert f.name in flags, f.name
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    options = train._option_string_actions
    assert {"--out", "--no-resume", "--no-progress", "--beta2", "--keep-checkpoints"} <= set(
        options
    )
    # A flag sets its field; --set still overrides it (precedence unchanged).
    args = train.parse_args(["--beta2", "0.9", "--keep-checkpoints", "3", "--set", "beta2=0.8"])
    from deltaflow.cli.train import resolve_train_config

    cfg = resolve_train_config(args)
    assert cfg.beta2 == 0.8 and cfg.keep_checkpoints == 3


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    sub = next(
        a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0]))
    )
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.option_strings:
                assert action.help, f"deltaflow {name} {action.option_strings[0]} has no help"


def test_apply_overrides_keeps_sections_separate():
    data = apply_overrides({"model": {"rule": "efla"}}, ["model.use_decay=true", "steps=3"])
    assert data == {"model": {"rule": "efla", "use_decay": True}, "steps": 3}


# ---------------------------------------------------------------------------- CPU
def test_threads_flag_and_cpu_default(capsys):
    from deltaflow.train.cpu import DEFAULT_CPU_THREADS, set_threads

    before = torch.get_num_threads()
    try:
        assert set_threads(None, "cpu") == DEFAULT_CPU_THREADS == torch.get_num_threads()
        assert set_threads(2, "cpu") == 2 and torch.get_num_threads() == 2
        argv = ["train", *TINY_MQAR, *TINY, *FAST[:-2], "--threads", "1", "--steps", "1"]
        assert main([*argv, *SMALL_EVAL]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_gpu_sized_model_on_cpu_is_said_with_the_expected_time(capsys, monkeypatch):
    from deltaflow.train import cpu

    config = TrainConfig(task="mqar", steps=3000, model={"rule": "efla", "use_decay": True})
    vocab = 8192
    params = cpu.count_parameters(config, vocab)
    assert params > cpu.GPU_SIZED_PARAMS  # the documented default model is GPU-sized
    assert cpu.warn_if_gpu_sized(config, vocab, params)
    err = capsys.readouterr().err
    assert "GPU-sized" in err and "--hidden-size 128 --num-layers 2" in err
    small = config.replace(model={"hidden_size": 64, "num_layers": 1, "num_heads": 2})
    assert not cpu.warn_if_gpu_sized(small, 32, cpu.count_parameters(small, 32))

    clock = iter([100.0, 130.0])  # end of step 1, end of step 2: 30 s per step
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: next(clock))
    check = cpu.CpuTimeCheck(config, vocab, params, gpu_sized=True)
    check(None, 1)
    check(None, 2)
    err = capsys.readouterr().err
    assert "30 s/step" in err and "3000 steps take ~25.0 h" in err
    check(None, 3)  # said once
    assert capsys.readouterr().err == ""
    # A model already CPU-sized is not told to grow into the "smaller" setting.
    assert cpu.smaller_setting(small, 32, cpu.count_parameters(small, 32)) is None


def test_ctrl_c_reaching_the_command_line_is_one_line(monkeypatch, capsys):
    import deltaflow.cli as cli
    import deltaflow.cli.eval as cli_eval

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_eval, "cmd_eval", interrupted)
    assert cli.main(["eval", "anything"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "deltaflow eval: interrupted"


def test_configs_that_built_something_else_or_raised_raw_errors_are_one_line(tmp_path, capsys):
    """Issue 34 item 13: attn_every past num_layers built a model with no attention;
    num_layers 2.5 did not name the key; a YAML key given twice silently took the last;
    --print-config took an unknown --task; a huge hidden_size was a traceback."""
    with pytest.raises(ValueError, match="attn_every=5 with num_layers=2 makes no layer"):
        DeltaFlowConfig(vocab_size=8, hidden_size=16, num_heads=2, num_layers=2, attn_every=5)
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 2.5"):
        DeltaFlowConfig(vocab_size=8, hidden_size=16, num_heads=2, num_layers=2.5)
    with pytest.raises(ValueError, match="eps must be > 0, got 0"):
        DeltaFlowConfig(vocab_size=8, hidden_size=16, num_heads=2, eps=0)
    config = tmp_path / "twice.yaml"
    config.write_text("steps: 3\nlr: 1.0e-3\nsteps: 5\n")
    one_line_error(
        capsys,
        ["train", "--config", str(config), "--print-config"],
        "line 3, column 1: key 'steps' is given twice",
    )
    one_line_error(
        capsys, ["train", "--task", "mqarr", "--print-config"], "unknown task 'mqarr'", "'mqar'"
    )
    one_line_error(
        capsys,
        ["train", *TINY_MQAR, *FAST, "--set", "model.hidden_size=1000000000", "--steps", "1"],
        "is too large to create here",
    )
