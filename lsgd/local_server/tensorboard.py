"""A node's TensorBoard run (``TENSORBOARD=1``): its metrics rows as scalars.

A ``MetricsWriter`` sink: each batch of rows (one round's, or one evaluation's) is queued as it
is, and the writer's thread (``lsgd/tensorboard.py``) turns it into scalars under
``RUN_DIR/tensorboard/node<i>/``, with the job's global iteration as the step:

- ``loss/worker<id>``: the worker's averaged loss at the round;
- ``distance/<global_leader|center|local_leader>/worker<id>``: how far the worker was from
  what it was pulled toward (before the pull);
- ``leader/global`` (global rounds) and ``leader/local``: the id of the elected worker;
- ``resets/worker<id>``: times the worker was reset after non-finite values (when it happens);
- ``eval/<leader|average|center>/<metric>``: evaluations (node 0);
- ``rate/iterations_per_s``: the node's workers' iterations per second, over at least
  ``RATE_EVERY`` seconds.
"""

from __future__ import annotations

import logging
from typing import Iterator

from ..config import JobConfig
from ..tensorboard import EventWriter, Scalar, board_dir
from .metrics import MetricsWriter
from .metrics import cell_float as _num
from .metrics import cell_int as _int

log = logging.getLogger(__name__)

RATE_EVERY = 1.0  # seconds of rows behind each rate point
DISTANCES = (("pull_global", "global_leader"), ("pull_center", "center"),
             ("pull_local", "local_leader"))


class RowScalars:
    """Turns metrics rows into TensorBoard scalars; keeps what the rate needs. One thread."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # worker id -> its iteration count in its newest row
        self._resets: dict[int, int] = {}
        self._since: float | None = None  # time of the first row behind the next rate point
        self._steps = 0  # worker iterations since then

    def __call__(self, rows: list[dict]) -> Iterator[Scalar]:
        round_step: int | None = None
        newest = None
        for row in rows:
            step = _int(row.get("iteration"))
            if step is None:
                continue
            if row.get("kind") == "eval":
                value = _num(row.get("value"))
                if value is not None and row.get("target") and row.get("metric"):
                    yield f"eval/{row['target']}/{row['metric']}", value, step
                continue
            wid = _int(row.get("worker_id"))
            if wid is None:
                continue
            round_step = step
            newest = _num(row.get("time_s"))
            loss = _num(row.get("loss"))
            if loss is not None:
                yield f"loss/worker{wid}", loss, step
            for column, target in DISTANCES:
                d = _num(row.get(column))
                if d is not None:
                    yield f"distance/{target}/worker{wid}", d, step
            if row.get("reset"):
                self._resets[wid] = self._resets.get(wid, 0) + 1
                yield f"resets/worker{wid}", float(self._resets[wid]), step
            done = _int(row.get("worker_iterations"))
            if done is not None:
                if wid in self._seen and done >= self._seen[wid]:
                    self._steps += done - self._seen[wid]
                self._seen[wid] = done
        if round_step is None:
            return
        first = rows[0]
        if first.get("kind") == "global" and _int(first.get("global_leader")) is not None:
            yield "leader/global", float(first["global_leader"]), round_step
        if _int(first.get("local_leader")) is not None:
            yield "leader/local", float(first["local_leader"]), round_step
        if newest is not None:
            if self._since is None:
                self._since, self._steps = newest, 0
            elif newest - self._since >= RATE_EVERY:
                yield "rate/iterations_per_s", self._steps / (newest - self._since), round_step
                self._since, self._steps = newest, 0


def attach(config: JobConfig, metrics: MetricsWriter) -> EventWriter | None:
    """With ``TENSORBOARD=1``: a writer under ``RUN_DIR/tensorboard/node<i>/`` fed by
    ``metrics`` (the caller closes it); None otherwise."""
    if not config.tensorboard:
        return None
    writer = EventWriter(board_dir(config.run_dir, f"node{config.node_index}"), RowScalars())
    metrics.add_sink(writer.add)
    log.info("TensorBoard events in %s", writer.logdir)
    return writer






__all__ = ["RowScalars", "attach"]
