"""deltaflow.train: the training harness (config, loop, schedule, checkpoints, logs).

from deltaflow.train import TrainConfig, train
summary = train(TrainConfig(task="mqar", model={"rule": "efla", "hidden_size": 128}))
"""

from __future__ import annotations

from typing import Any

from deltaflow import lazy_attribute

# Imported on first use (PEP 562): the command line imports only what a command needs.
_LAZY = {
    "CheckpointSaveError": "deltaflow.train.checkpoint",
    "latest_checkpoint": "deltaflow.train.checkpoint",
    "load_checkpoint": "deltaflow.train.checkpoint",
    "load_config": "deltaflow.train.checkpoint",
    "resolve_checkpoint": "deltaflow.train.checkpoint",
    "save_checkpoint": "deltaflow.train.checkpoint",
    "TrainConfig": "deltaflow.train.config",
    "apply_overrides": "deltaflow.train.config",
    "export_checkpoint": "deltaflow.train.export",
    "write_pretrained": "deltaflow.train.export",
    "RunLogger": "deltaflow.train.logging",
    "read_log": "deltaflow.train.logging",
    "lr_at": "deltaflow.train.schedule",
    "DivergenceError": "deltaflow.train.trainer",
    "Trainer": "deltaflow.train.trainer",
    "build_model": "deltaflow.train.build",
    "build_task": "deltaflow.train.build",
    "model_logits": "deltaflow.train.build",
    "param_groups": "deltaflow.train.build",
    "train": "deltaflow.train.trainer",
}

__all__ = [
    "TrainConfig",
    "apply_overrides",
    "Trainer",
    "train",
    "DivergenceError",
    "build_model",
    "build_task",
    "model_logits",
    "param_groups",
    "lr_at",
    "RunLogger",
    "read_log",
    "save_checkpoint",
    "load_checkpoint",
    "load_config",
    "latest_checkpoint",
    "resolve_checkpoint",
    "CheckpointSaveError",
    "export_checkpoint",
    "write_pretrained",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
