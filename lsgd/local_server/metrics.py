"""The per-node metrics CSV: one row per worker and round, and one per evaluated metric.

Round rows fill ``round`` .. ``reset`` (the buffer a non-finite worker was reset to).
Evaluation rows (node 0 only) have kind ``eval`` and fill ``target`` (leader | average |
center), ``metric`` and ``value``, with ``worker_id`` naming the leader that was evaluated.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path
from typing import Callable

from ..files import open_private, private_dir

log = logging.getLogger(__name__)

COLUMNS = ["round", "kind", "iteration", "time_s", "worker_id", "worker_iterations", "loss",
           "local_leader", "global_leader", "pull_local", "pull_global", "pull_center",
           "reset", "target", "metric", "value"]


class MetricsWriter:
    """Appends rows to ``metrics.csv`` in the node's run directory, flushed every round."""

    def __init__(self, path: Path, staged: bool = False, keep: bool = False) -> None:
        """``staged``: write to a temporary file until ``commit()`` (a resume keeps the old
        file until it has succeeded). ``keep``: append to the rows already in ``path`` (a node
        rejoining its job after a crash); ``restart()`` empties it after all."""
        private_dir(path.parent)
        self.path = path
        self._tmp = path.with_name(f".{path.name}.resuming") if staged else None
        self._file = open_private(self._tmp or path, "a" if keep and not staged else "w",
                                  newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._sinks: list[Callable[[list[dict]], None]] = []
        if self._file.tell() == 0:
            self._csv.writeheader()
        self._file.flush()

    def restart(self) -> None:
        """Drop every row kept so far: the file holds the header only."""
        self._file.seek(0)
        self._file.truncate()
        self._csv.writeheader()
        self._file.flush()

    def resume(self, previous: list[dict], last_round: int) -> None:
        """Continue the rows of an earlier run up to ``last_round`` (a checkpoint's round)."""
        self._write([r for r in previous if r.get("round", "").isdigit() and int(r["round"]) <= last_round])
        if self._tmp is not None:
            os.replace(self._tmp, self.path)
            self._tmp = None

    @staticmethod
    def read(path: Path) -> list[dict]:
        """The rows of an existing metrics file (empty if there is none)."""
        if not path.exists():
            return []
        with path.open(newline="") as f:
            return list(csv.DictReader(f))

    def add_sink(self, sink: Callable[[list[dict]], None]) -> None:
        """Also hand every new batch of rows (as written, unformatted) to ``sink``: the node's
        view (progress line, status report), TensorBoard. A sink that raises is dropped with
        one warning; the CSV goes on."""
        self._sinks.append(sink)

    def rows(self, rows: list[dict]) -> None:
        self._write(rows)
        for sink in list(self._sinks):
            try:
                sink(rows)
            except Exception as exc:  # noqa: BLE001 - watching must never stop training
                log.warning("metrics sink %s failed and is dropped: %s", sink, exc)
                self._sinks.remove(sink)

    def _write(self, rows: list[dict]) -> None:
        for row in rows:
            self._csv.writerow({k: _fmt(row.get(k)) for k in COLUMNS})
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        if self._tmp is not None:  # the resume failed: the earlier file stays as it was
            self._tmp.unlink(missing_ok=True)


def cell_float(v: object) -> float | None:
    """A finite float from a metrics cell or row value (None, '', booleans, non-numbers and
    non-finite values: None)."""
    if v is None or v == "" or isinstance(v, bool):
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def cell_int(v: object) -> int | None:
    """``cell_float`` as a whole number."""
    f = cell_float(v)
    return int(f) if f is not None else None


def _fmt(v: object) -> object:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v
