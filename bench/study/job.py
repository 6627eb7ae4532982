"""The study's training loop, run by every worker through ``train.sh`` (``ENTRY=bench.study.job:main``).

The same loop for every rule: draw a batch, take one step, ``worker.step(loss)``. Every
``STUDY_MARK`` of its own steps the worker keeps a snapshot of its parameters and the mean
training loss since the last one; the study evaluates the snapshots afterwards (``run.py``), the
same way for every rule. Steps are paced to one every ``STUDY_PACE`` seconds of the worker's own
clock (a deadline schedule: a late step does not sleep), so that on a shared machine every
worker advances at the same rate, as on a cluster of equal devices; the steps that missed their
deadline are counted.

Knobs (environment): ``STUDY_WORKLOAD`` (``cnn`` | ``mlp``), ``STUDY_DATA`` (the .npz of
``workloads.make_data``), ``STUDY_MARK``, ``STUDY_PACE``. Writes ``$RUN_DIR/study-w<id>.npz``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import workloads


def main(worker) -> None:
    cfg = worker.config
    name = os.environ["STUDY_WORKLOAD"]
    data = workloads.load_data(os.environ["STUDY_DATA"])
    x, y = data["train"]
    xt, yt = data["test"]
    every = int(os.environ.get("STUDY_MARK", "50"))
    pace = float(os.environ.get("STUDY_PACE", "0"))
    task = workloads.task(name, cfg.seed, cfg.lr, cfg.momentum)
    worker.register(task.params, evaluate=lambda: {"accuracy": task.accuracy(xt, yt)})
    rng = np.random.default_rng([cfg.seed, worker.worker_id, 7])
    snaps, marks = [task.flat()], [(0, time.time(), float("nan"))]
    losses: list[float] = []
    steps, late, compute = 0, 0, 0.0
    clock = time.perf_counter
    start = clock()
    while True:
        due = start + steps * pace
        now = clock()
        if now < due:
            time.sleep(due - now)
        elif pace and now > due + pace:
            late += 1
        idx = rng.integers(0, len(x), cfg.batch_size)
        t0 = clock()
        loss = task.step(x[idx], y[idx])
        compute += clock() - t0
        steps += 1
        losses.append(loss)
        keep = worker.step(loss)
        if steps % every == 0:
            snaps.append(task.flat())
            marks.append((steps, time.time(), float(np.mean(losses))))
            losses.clear()
        if not keep:
            break
    out = Path(cfg.run_dir) / f"study-w{worker.worker_id}.npz"
    np.savez(out, snaps=np.stack(snaps), marks=np.asarray(marks, np.float64), steps=steps,
             late=late, compute=compute, wall=clock() - start)
