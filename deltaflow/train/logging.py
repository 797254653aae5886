"""Run logs: every record goes to ``log.jsonl``; ``train.csv`` / ``eval.csv`` are tables of them.

JSONL is the source of truth (one JSON object per line, appended and flushed as it happens).
The CSVs are regenerated from it on ``flush()``, so columns may appear mid-run (new eval
metrics) without breaking the header. On resume, records past the checkpoint's step are
dropped: they belong to the part of the run that is about to be redone. A checkpoint stores
how many records the log held when it was written (``keep_records``), so exactly those are
kept, whatever was logged at the same step after it (a final evaluation, say).
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any


class RunLogger:
    """Appends JSON records of kind 'train' / 'eval' / 'event'. A no-op when ``out_dir`` is None."""

    def __init__(
        self,
        out_dir: str | Path | None,
        *,
        resume_step: int | None = None,
        keep_records: int | None = None,
        start_records: list[dict[str, Any]] | None = None,
    ) -> None:
        """``resume_step``: continue the log in ``out_dir``, dropping records past that step
        (None: start the log over); ``keep_records``: keep exactly the first so many records
        instead (with ``resume_step``). ``start_records``: start the log with these (a fork)."""
        self.records: list[dict[str, Any]] = []
        self.dir = Path(out_dir) if out_dir is not None else None
        self._file = None
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

    def log(self, kind: str, step: int, **values: Any) -> dict[str, Any]:
        record = {"kind": kind, "step": step, **values}
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
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
