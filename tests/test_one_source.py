"""Facts written once: every place that used to keep its own copy now derives from one source,
and these tests fail if two places ever disagree again (issue 36)."""

from __future__ import annotations

import dataclasses

import pytest
from test_train import make, toy_config

from deltaflow.lab.grid import RUNTIME_ONLY_FIELDS
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
        trainer.logger.close()
    with pytest.raises(ValueError, match="cannot resume"):  # a training field still refuses
        Trainer(cfg.replace(lr=1e-3), model=make()[0], task=task)
