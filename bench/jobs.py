"""Worker functions the benchmarks run through ``train.sh`` (``ENTRY=bench.jobs:<name>``).

Each writes what it measured to ``$RUN_DIR/<name>-<worker_id>.*`` when its loop ends.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np


def _out(worker, name: str) -> Path:
    return Path(worker.config.run_dir) / f"{name}-{worker.worker_id}"


def step_timer(worker) -> None:
    """No real training: time every ``worker.step`` call (the control plane's worst case). The
    parameters change by one in-place add per step, outside the timed call, as any training loop
    changes them (lsgd stops a loop whose registered parameters never change)."""
    x = np.zeros(1000, np.float32)
    worker.register([x])
    cap = int(os.environ.get("BENCH_MAX_STEPS", "2000000"))
    ns = np.zeros(cap, np.int64)
    clock = time.perf_counter_ns
    n = 0
    while n < cap:
        x[n % x.size] += 1.0
        t0 = clock()
        keep = worker.step(0.5)
        ns[n] = clock() - t0
        n += 1
        if not keep:
            break
    np.save(f"{_out(worker, 'step_ns')}.npy", ns[:n])


def mlp(worker) -> None:
    """The medium workload (``bench.workload``) with timestamps and periodic test accuracy."""
    from .workload import NumpyMLP, make_data

    cfg = worker.config
    model = NumpyMLP(seed=cfg.seed, lr=cfg.lr, momentum=cfg.momentum)
    x, y = make_data(20000, seed=1)
    xt, yt = make_data(1000, seed=99)
    eval_every = int(os.environ.get("BENCH_EVAL_EVERY", "0"))
    worker.register(model.params, evaluate=lambda: {"accuracy": model.accuracy(xt, yt)})
    rng = np.random.default_rng([cfg.seed, worker.worker_id])
    curve, marks, steps, in_lsgd = [], [], 0, 0.0
    clock = time.perf_counter
    first = time.time()  # before the first step, as in the plain baseline loop
    while True:
        idx = rng.integers(0, len(x), cfg.batch_size)
        loss = model.step(x[idx], y[idx])
        steps += 1
        if steps % 10 == 0:
            marks.append((time.time(), steps))
        if eval_every and steps % eval_every == 0:
            curve.append((time.time(), steps, model.accuracy(xt, yt)))
        t = clock()
        keep = worker.step(loss)
        in_lsgd += clock() - t  # time the loop spent in lsgd: requests, waits, rounds, pulls
        if not keep:
            break
    last = time.time()
    _out(worker, "mlp").with_suffix(".json").write_text(json.dumps(
        {"steps": steps, "first": first, "last": last, "batch": cfg.batch_size, "curve": curve,
         "marks": marks, "in_lsgd_s": in_lsgd}))


def paced(worker) -> None:
    """A worker whose step takes a set time, per node (a mixed cluster): a sleep of
    ``BENCH_STEP_SECONDS`` (``"<node 0's>,<node 1's>,..."``, the last one for the nodes not
    named) after a cheap in-place update of the first 100,000 of ``BENCH_SIZE`` parameters
    (100,000: all of them), so a big model costs only its exchanges. The sleep
    stands for work done elsewhere (an accelerator, another machine): it leaves the cores to
    lsgd. Writes the time each ``worker.step`` call returned and the seconds spent inside them."""
    cfg = worker.config
    delays = [float(v) for v in os.environ.get("BENCH_STEP_SECONDS", "0.005").split(",")]
    delay = delays[min(cfg.node_index, len(delays) - 1)]
    x = np.full(int(os.environ.get("BENCH_SIZE", "100000")), 5.0, np.float32)
    target = np.linspace(-1, 1, min(x.size, 100_000), dtype=np.float32)
    head = x[:target.size]
    worker.register([x])
    lr = np.float32(cfg.lr)
    ends, in_step, start = [], 0.0, time.time()
    clock = time.perf_counter
    while True:
        head -= lr * (head - target)
        head[len(ends) % head.size] += 0.5  # never converged to a fixed point: the loop trains
        time.sleep(delay)
        t = clock()
        keep = worker.step(float(np.mean((head[:1000] - target[:1000]) ** 2)))
        in_step += clock() - t
        ends.append(time.time())
        if not keep:
            break
    _out(worker, "paced").with_suffix(".json").write_text(json.dumps(
        {"node": cfg.node_index, "start": start, "ends": ends, "in_step": in_step}))
