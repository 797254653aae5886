"""Run logs: every record goes to ``log.jsonl``; ``train.csv`` / ``eval.csv`` are tables of them.

JSONL is the source of truth (one JSON object per line, appended and flushed as it happens).
The CSVs are regenerated from it on ``flush()``, so columns may appear mid-run (new eval
metrics) without breaking the header. On resume, records past the checkpoint's step are
dropped: they belong to the part of the run that is about to be redone.

Optional sinks, off by default (one config flag each): TensorBoard event files in
``<out_dir>/tensorboard`` (``tensorboard --logdir runs/``; a resumed run purges the events past
its checkpoint, a fresh run in an old folder starts them over) and Weights & Biases in
``<out_dir>/wandb``, offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it
later; a resumed run continues the same W&B run id). Both get every numeric value of the
'train' and 'eval' records as ``train/loss``, ``eval/ppl``, ...
dropped: they belong to the part of the run that is about to be redone. A checkpoint stores
how many records the log held when it was written (``keep_records``), so exactly those are
kept, whatever was logged at the same step after it (a final evaluation, say).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any


class RunLogger:
    """Appends JSON records of kind 'train' / 'eval' / 'event'. A no-op when ``out_dir`` is None."""

    def __init__(
        self,
        out_dir: str | Path | None,
        *,
        resume_step: int | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        run_config: dict[str, Any] | None = None,
        keep_records: int | None = None,
        start_records: list[dict[str, Any]] | None = None,
    ) -> None:
        """``resume_step``: continue the log in ``out_dir``, dropping records past that step
        (None: start the log over); ``keep_records``: keep exactly the first so many records
        instead (with ``resume_step``). ``start_records``: start the log with these (a fork)."""
        self.records: list[dict[str, Any]] = []
        self.dir = Path(out_dir) if out_dir is not None else None
        self._file = None
        self._sinks: list[Any] = []
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "log.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # torn last line of a killed run
                    continue
                self.records.append(record)
            if resume_step is None:  # fresh run in an old directory: start the log over
                self.records = []
            elif keep_records is not None:
                self.records = self.records[:keep_records]
            else:
                self.records = [r for r in self.records if r.get("step", 0) <= resume_step]
        if start_records is not None:
            self.records = list(start_records)
        tmp = path.with_name(".log.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, path)
        self._file = open(path, "a")  # noqa: SIM115 (kept open for the run)
        if tensorboard:
            self._sinks.append(TensorBoardSink(self.dir / "tensorboard", resume_step))
        if wandb:
            self._sinks.append(WandbSink(self.dir, run_config or {}, resume_step is not None))

    def log(self, kind: str, step: int, **values: Any) -> dict[str, Any]:
        record = {"kind": kind, "step": step, **values}
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if kind in ("train", "eval"):
            scalars = {
                f"{kind}/{k}": float(v)
                for k, v in values.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            }
            for sink in self._sinks:
                sink.log(step, scalars)
        return record

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]

    def flush(self) -> None:
        """Rewrite train.csv and eval.csv from the records (atomically)."""
        if self.dir is None:
            return
        for kind in ("train", "eval"):
            rows = self.of_kind(kind)
            if rows:
                _write_csv(self.dir / f"{kind}.csv", rows)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class TensorBoardSink:
    """Scalars into TensorBoard event files (``torch.utils.tensorboard``)."""

    def __init__(self, folder: Path, resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "tensorboard=True needs the tensorboard package: pip install "
                "'deltaflow[tensorboard]' (or pip install tensorboard)"
            ) from None
        if resume_step is None and folder.is_dir():  # a fresh run in an old folder
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        # resumed at step S: events after S belong to the part about to be redone
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases, offline by default; the run id is kept in the run folder, so a resumed
    run appends to the same W&B run."""

    def __init__(self, folder: Path, run_config: dict[str, Any], resumed: bool) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "wandb=True needs the wandb package: pip install 'deltaflow[wandb]' "
                "(or pip install wandb)"
            ) from None
        id_file = folder / "wandb_run_id"
        if resumed and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B run ids: short, alphanumeric
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            dir=str(folder),
            project=os.environ.get("WANDB_PROJECT", "deltaflow"),
            name=folder.resolve().name,
            id=run_id,
            resume="allow",
            config=run_config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(silent=True),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns and k != "kind")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)


def read_log(out_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run directory's log.jsonl (skips a torn last line)."""
    out = []
    for line in (Path(out_dir) / "log.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
