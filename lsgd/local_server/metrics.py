"""The per-node metrics CSV: one row per worker and round, and one per evaluated metric.

Round rows fill ``round`` .. ``reset`` (the buffer a non-finite worker was reset to).
Evaluation rows (node 0 only) have kind ``eval`` and fill ``target`` (leader | average |
center), ``metric`` and ``value``, with ``worker_id`` naming the leader that was evaluated.
"""

from __future__ import annotations

import csv
import os

from ..files import open_private, private_dir
import math
from pathlib import Path

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
        self.rows([r for r in previous if r.get("round", "").isdigit() and int(r["round"]) <= last_round])
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

    def rows(self, rows: list[dict]) -> None:
        for row in rows:
            self._csv.writerow({k: _fmt(row.get(k)) for k in COLUMNS})
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        if self._tmp is not None:  # the resume failed: the earlier file stays as it was
            self._tmp.unlink(missing_ok=True)


def _fmt(v: object) -> object:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v
