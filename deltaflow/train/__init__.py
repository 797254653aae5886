"""deltaflow.train: the training harness (config, loop, schedule, checkpoints, logs).

from deltaflow.train import TrainConfig, train
summary = train(TrainConfig(task="mqar", model={"rule": "efla", "hidden_size": 128}))
"""

from deltaflow.train.checkpoint import (
    CheckpointSaveError,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    resolve_checkpoint,
    save_checkpoint,
)
from deltaflow.train.config import TrainConfig, apply_overrides
from deltaflow.train.export import export_checkpoint, write_pretrained
from deltaflow.train.logging import RunLogger, read_log
from deltaflow.train.schedule import lr_at
from deltaflow.train.trainer import (
    DivergenceError,
    Trainer,
    build_model,
    build_task,
    model_logits,
    param_groups,
    train,
)

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
