"""lm-evaluation-harness path (issue 25): the ``deltaflow`` model class scores exactly what a
direct forward scores, the local tasks built from held-out documents run end to end through
``deltaflow eval --lm-eval`` and through lm-eval's own command line, offline, on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _documents import make_documents, make_hf_tokenizer, write_jsonl

pytest.importorskip("lm_eval")

from deltaflow.cli import main  # noqa: E402
from deltaflow.evals.harness import DeltaFlowLM  # noqa: E402
from deltaflow.train import TrainConfig, train  # noqa: E402

DOCS = make_documents(30, seed=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny byte-level model trained for a few steps on packed JSONL documents."""
    root = tmp_path_factory.mktemp("lm_eval")
    data = write_jsonl(root / "docs.jsonl", DOCS)
    config = TrainConfig(
        task="lm",
        task_kwargs={
            "data_dir": str(data),
            "seq_len": 64,
            "valid_fraction": 0.2,
            "cache_dir": str(root / "cache"),
        },
        model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "backend": "torch"},
        steps=4,
        batch_size=4,
        device="cpu",
        progress=False,
        log_every=2,
        out_dir=str(root / "run"),
        eval_kwargs={"num_examples": 2},
    )
    train(config)
    return root / "run"


def direct_logprobs(lm: DeltaFlowLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one plain forward."""
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return F.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_the_model_class_scores_what_a_direct_forward_scores(run, tmp_path):
    lm = DeltaFlowLM(pretrained=str(run), device="cpu", batch_size=3)
    assert lm.max_length == 64  # the run's training length
    sep = lm.eot_token_id
    pairs = [("The river", " stone"), ("a", " garden window"), ("", "music"), (DOCS[0], " the")]
    got = lm.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    for (context, continuation), (score, greedy) in zip(pairs, got):
        ctx = lm.tok_encode(context)
        ids = ([sep] + ctx + lm.tok_encode(continuation))[-65:]  # separator first, max_length
        n = len(lm.tok_encode(continuation))
        logprobs = direct_logprobs(lm, ids)[-n:]
        assert score == pytest.approx(float(logprobs.sum()), abs=1e-4)
        assert isinstance(greedy, bool)
    # rolling: a text longer than max_length is scored in windows, every token once
    text = DOCS[1]
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)
    ids = [sep] + lm.tok_encode(text)
    assert len(ids) > 2 * 64 and math.isfinite(rolling)
    first_window = float(direct_logprobs(lm, ids[:65]).sum())
    assert rolling < first_window < 0  # the later windows add their (negative) scores
    short = "the river"
    (score,) = lm.loglikelihood_rolling([SimpleNamespace(args=(short,))], disable_tqdm=True)
    assert score == pytest.approx(
        float(direct_logprobs(lm, [sep] + lm.tok_encode(short)).sum()), abs=1e-4
    )
    # generation: greedy, cut at the stop string
    (text,) = lm.generate_until(
        [SimpleNamespace(args=("the river", {"until": ["e"], "max_gen_toks": 8}))],
        disable_tqdm=True,
    )
    assert isinstance(text, str) and "e" not in text and len(text) <= 8


def test_model_args_are_checked(run, tmp_path):
    with pytest.raises(ValueError, match=r"unknown model_args \['trust_remote_code'\]"):
        DeltaFlowLM(pretrained=str(run), device="cpu", trust_remote_code=True)
    big = make_hf_tokenizer(tmp_path / "tok", DOCS, vocab_size=320)
    with pytest.raises(ValueError, match=r"has \d+ tokens but the model's vocabulary has 257"):
        DeltaFlowLM(pretrained=str(run), device="cpu", tokenizer=str(big))


def test_local_tasks_run_through_deltaflow_eval(run, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    argv = ["lm-eval-task", "--from-run", str(run), "--out", str(tasks), "--name", "tiny"]
    assert main([*argv, "--num-examples", "5", "--min-words", "5", "--max-words", "6"]) == 0
    captured = capsys.readouterr()
    assert "wrote 5 examples per task\n" in captured.err
    hint = f"evaluate: deltaflow eval {run} --lm-eval tiny_last_word,tiny_ppl"
    assert hint in captured.out  # the run's own path, not a literal RUN
    assert main([*argv, "--num-examples", "10000", "--min-words", "5"]) == 0  # more than exist
    err = capsys.readouterr().err
    assert "(asked for 10000: the held-out documents have only" in err
    assert main([*argv, "--num-examples", "5", "--min-words", "5", "--max-words", "6"]) == 0
    capsys.readouterr()
    examples = [json.loads(x) for x in (tasks / "tiny_last_word.jsonl").read_text().splitlines()]
    assert len(examples) == 5 and all(e["target"][1:].isalpha() for e in examples)
    heldout = [d for i, d in enumerate(DOCS) if i % 5 == 0]  # valid_fraction 0.2
    assert all(any(e["context"] in " ".join(d.split()) for d in heldout) for e in examples)

    argv = ["eval", str(run), "--lm-eval", "tiny_last_word,tiny_ppl", "--device", "cpu"]
    saved = tmp_path / "lm_eval.json"
    assert main([*argv, "--lm-eval-include", str(tasks), "--json", "--output", str(saved)]) == 0
    results = json.loads(capsys.readouterr().out)
    assert json.loads(saved.read_text()) == json.loads(json.dumps(results, default=str))
    last_word, ppl = results["tiny_last_word"], results["tiny_ppl"]
    assert last_word["acc,none"] in {0.0, 0.2, 0.4, 0.6, 0.8, 1.0}
    assert last_word["perplexity,none"] > 1.0
    # bits per byte of the held-out passages, recomputed from plain forwards (each passage
    # fits one window of max_length, so lm-eval scores [sep] + passage in one piece)
    lm = DeltaFlowLM(pretrained=str(run), device="cpu")
    texts = [json.loads(x)["text"] for x in (tasks / "tiny_ppl.jsonl").read_text().splitlines()]
    windows = [[lm.eot_token_id] + lm.tok_encode(t) for t in texts]
    assert all(len(ids) <= lm.max_length + 1 for ids in windows)
    nll = -sum(float(direct_logprobs(lm, ids).sum()) for ids in windows)
    by_hand = nll / math.log(2) / sum(len(t.encode()) for t in texts)
    assert ppl["bits_per_byte,none"] == pytest.approx(by_hand, rel=1e-4)
    assert ppl["byte_perplexity,none"] == pytest.approx(2**by_hand, rel=1e-4)


def test_lm_evals_own_command_line_with_the_model_registered(run, tmp_path):
    tasks = tmp_path / "tasks"
    assert main(["lm-eval-task", "--from-run", str(run), "--out", str(tasks), "--name", "cli"]) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "deltaflow.evals", "--model", "deltaflow", "--device", "cpu"]
    cmd += ["--model_args", f"pretrained={run}", "--batch_size", "2", "--tasks", "cli_last_word"]
    cmd += ["--include_path", str(tasks), "--limit", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cli_last_word" in done.stdout and "acc" in done.stdout
