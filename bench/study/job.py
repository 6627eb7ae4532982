"""The study's training loop, run by every worker through ``train.sh`` (``ENTRY=bench.study.job:main``).

The same loop for every rule: draw a batch, take one step, ``worker.step(loss, grad_norm=g)``
(GRAWA weighs by the gradient norm; the other rules ignore it). Every ``STUDY_MARK`` of its own
steps, and once more when its loop ends, the worker keeps a copy of its parameters and its mean
training loss since the previous copy; worker 0 also keeps a copy of its node's center, where
the rule has one (the buffer the workers pull toward). The study evaluates the copies
afterwards (``run.py``), the same way for every rule.

Steps are paced to one every ``STUDY_PACE`` seconds from a start the workers share (a deadline
schedule: a late step does not sleep), so that on a shared machine every worker advances at the
same rate, as on a cluster of equal devices. The shared start is a barrier in ``RUN_DIR`` (the
study runs every node on one machine): each worker marks itself ready, and all start 0.5 s after
the last one did, whatever their start-up took. The steps that missed their deadline by more
than one pace are counted.

Knobs (environment): ``STUDY_WORKLOAD`` (``cnn`` | ``mlp``), ``STUDY_DATA`` (the .npz of
``workloads.make_data``), ``STUDY_MARK``, ``STUDY_PACE``. Writes ``$RUN_DIR/study-w<id>.npz``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import workloads

BARRIER_TIMEOUT = 300.0  # seconds for every worker of the job to be ready
CENTER = "center"  # the node buffer of a center rule (lsgd.rules.base.CENTER)


def shared_start(run_dir: Path, worker_id: int, workers: int) -> float:
    """Mark this worker ready; wait for all ``workers``; the common start (``time.time()``)."""
    ready = run_dir / "study-ready"
    ready.mkdir(exist_ok=True)
    (ready / f"w{worker_id}").touch()
    end = time.monotonic() + BARRIER_TIMEOUT
    while len(marks := list(ready.iterdir())) < workers:
        if time.monotonic() > end:
            raise RuntimeError(f"only {len(marks)} of {workers} workers got ready in "
                               f"{BARRIER_TIMEOUT:g} s")
        time.sleep(0.02)
    return max(m.stat().st_mtime for m in marks) + 0.5


def node_center(worker) -> np.ndarray | None:
    """A copy of this node's center, or None (no center in this rule). The study reads the
    node's shared memory the way the worker's pulls read it (``worker._store``: lsgd's
    private attribute, read-only here)."""
    store = getattr(worker, "_store", None)
    if store is None or CENTER not in store.layout.buffers:
        return None
    return np.array(store.buffer(CENTER)[:store.layout.param_count], copy=True)


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
    keeps_center = worker.worker_id == 0
    snaps, centers, marks = [], [], []
    losses: list[float] = []

    def keep(step: int) -> None:
        snaps.append(task.flat())
        marks.append((step, time.time(), float(np.mean(losses)) if losses else float("nan")))
        losses.clear()
        if keeps_center:
            c = node_center(worker)
            centers.append(c if c is not None else np.zeros(0, np.float32))

    steps, late, compute = 0, 0, 0.0
    clock = time.perf_counter
    keep(0)
    start = shared_start(Path(cfg.run_dir), worker.worker_id, cfg.num_groups * cfg.workers)
    began = time.time()
    while True:
        due = start + steps * pace
        now = time.time()
        if now < due:
            time.sleep(due - now)
        elif pace and now > due + pace:
            late += 1
        idx = rng.integers(0, len(x), cfg.batch_size)
        t0 = clock()
        loss, norm = task.step(x[idx], y[idx])
        compute += clock() - t0
        steps += 1
        losses.append(loss)
        going = worker.step(loss, grad_norm=norm)
        if steps % every == 0 or not going:
            keep(steps)
        if not going:
            break
    out = Path(cfg.run_dir) / f"study-w{worker.worker_id}.npz"
    size = max((c.size for c in centers), default=0)
    arrays = {"centers": np.stack([c if c.size else np.full(size, np.nan, np.float32)
                                   for c in centers])} if size else {}
    np.savez(out, snaps=np.stack(snaps), marks=np.asarray(marks, np.float64), steps=steps,
             late=late, compute=compute, wall=time.time() - began, **arrays)
