"""A preset's grid: every (width, cell, variant, learning rate, weight decay, seed) as one
:class:`RunSpec` with its full training config, in the order the runs are trained.

The rest of ``deltaflow compare`` is split by job: :mod:`deltaflow.lab.runner` trains the specs
(in a process pool, resumably), :mod:`deltaflow.lab.select` picks each cell's best learning
rate, :mod:`deltaflow.lab.report` writes the tables and prose, and
:mod:`deltaflow.lab.comparison` runs the whole job.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from deltaflow.lab.presets import RENAMED_VARIANTS, VARIANTS, Preset
from deltaflow.train import TrainConfig
from deltaflow.train.config import fields_left_out_of_run_ids
from deltaflow.train.schedule import effective_warmup

# TrainConfig fields that say how a run is executed, not what it trains, and came after grids
# were committed (marked in_run_id=False on the field itself, train/config.py): left out of run
# ids, so committed grids keep their ids (--resume, --report-only).
RUNTIME_ONLY_FIELDS = fields_left_out_of_run_ids()
# Fields that came later and do change training, at the value every older grid trained with:
# left out of run ids at that value only (a wsd grid gets ids of its own, and so does a grid
# with an early stop).
LATER_FIELD_DEFAULTS = {"schedule": "cosine", "decay_fraction": 0.2, "early_stop": None}


@dataclass(frozen=True)
class RunSpec:
    variant: str
    cell: str
    width: int | None
    lr: float
    seed: int
    config: TrainConfig
    weight_decay: float | None = None  # set when the preset sweeps weight decay
    shared: str | None = None  # the --shared folder substituted into the task's paths

    @property
    def run_id(self) -> str:
        config = self.config.to_dict()
        for name in RUNTIME_ONLY_FIELDS:  # added after grids were committed; ids stay valid
            config.pop(name, None)
        for name, old in LATER_FIELD_DEFAULTS.items():
            if config.get(name) == old:
                config.pop(name, None)
        if str(config.get("device", "")).startswith("cuda:"):  # which GPU of a host ran it is
            config["device"] = "cuda"  # not part of the run: 'cuda:1' resumes a 'cuda' run
        text = json.dumps(config, sort_keys=True)
        if self.shared:  # the same run on another machine (another checkout path): same id
            prefix = json.dumps(self.shared.rstrip("/") + "/")[:-1]  # '"<shared>/': path starts
            text = text.replace(prefix, '"{shared}/')
        digest = hashlib.sha1(text.encode())
        width = f"-w{self.width}" if self.width is not None else ""
        # only swept weight decays appear in the id, so ids of older grids stay valid
        wd = f"-wd{self.weight_decay:g}" if self.weight_decay is not None else ""
        return (
            f"{self.variant}-{self.cell}{width}-lr{self.lr:g}{wd}-s{self.seed}-"
            f"{digest.hexdigest()[:8]}"
        )


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """A committed run record under today's names: a variant renamed since
    (:data:`deltaflow.lab.presets.RENAMED_VARIANTS`) gets its new name in ``variant`` and in
    its id's prefix. The config, and so the id's hash, is the same, so the record's id is the
    one today's :class:`RunSpec` computes (--resume, --report-only find it)."""
    old = record.get("variant")
    if old not in RENAMED_VARIANTS:
        return record
    new = RENAMED_VARIANTS[old]
    run_id = str(record.get("id", ""))
    if run_id.startswith(old + "-"):
        run_id = new + run_id[len(old) :]
    return {**record, "variant": new, "id": run_id}


def _fill(value: Any, shared: str | None) -> Any:
    """Substitute ``{shared}`` in string task arguments (paths into the shared data folder)."""
    if isinstance(value, str) and "{shared}" in value:
        if shared is None:
            raise ValueError(
                "this preset reads shared data: pass --shared DIR (the folder with corpus/)"
            )
        return value.replace("{shared}", shared)
    return value


def expand_grid(
    preset: Preset,
    *,
    device: str = "auto",
    steps: int | None = None,
    scale: float = 1.0,
    shared: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[RunSpec]:
    """All runs of a preset, in the order they will be trained (cheapest widths first)."""
    base = copy.deepcopy(preset.base)
    for key, value in (overrides or {}).items():  # section overrides merge: model.x=... keeps model
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    n_steps = steps if steps is not None else max(1, round(base.get("steps", 1000) * scale))
    base["steps"] = n_steps
    if base.get("warmup_steps") is not None:  # what the trainer would use, written down (the
        # stored configs of grids run before it did so keep resuming)
        base["warmup_steps"] = effective_warmup(base["warmup_steps"], n_steps)
    if base.get("eval_every"):
        base["eval_every"] = min(base["eval_every"], n_steps)
    base.update(device=device, progress=False, out_dir=None)
    specs = []
    for width in preset.widths or [None]:
        for cell, cell_spec in preset.cells.items():
            for variant in cell_variants(preset, cell):
                for lr, wd in itertools.product(preset.lrs, preset.weight_decays or [None]):
                    for seed in preset.variant_seeds(variant):
                        data = copy.deepcopy(base)
                        preset.variant_model(variant)  # validates the name
                        data["model"] = {**base.get("model", {}), **VARIANTS[variant]}
                        if width is not None:
                            data["model"]["hidden_size"] = width
                        data["task"] = cell_spec["task"]
                        task_kwargs = {
                            k: _fill(v, shared) for k, v in cell_spec.get("task_kwargs", {}).items()
                        }
                        extra = base.get("task_kwargs", {})  # from --set task_kwargs.x=...
                        data["task_kwargs"] = {**task_kwargs, **extra, "seed": seed}
                        for key, value in cell_spec.items():  # per-cell TrainConfig overrides
                            if key not in CELL_KEYS:
                                data[key] = copy.deepcopy(value)
                        data.update(lr=lr, seed=seed)
                        if wd is not None:
                            data["weight_decay"] = wd
                        config = TrainConfig.from_dict(data)
                        specs.append(RunSpec(variant, cell, width, lr, seed, config, wd, shared))
    return specs


# keys of a cell spec that describe the cell; any other key overrides a TrainConfig field
CELL_KEYS = ("task", "task_kwargs", "variants", "contrast")


def cell_variants(preset: Preset, cell: str) -> list[str]:
    """The preset's variants that run on ``cell`` (a cell may name a subset: ``variants``)."""
    wanted = preset.cells[cell].get("variants")
    return [v for v in preset.variants if wanted is None or v in wanted]
