"""A tiny numpy worker job for tests: noisy gradient descent on a quadratic.

Fault knobs (environment): TOYJOB_DIE="<worker>:<step>" SIGKILLs that worker at that step (in its first life; the time goes
to ``<dir>/<worker_id>.died``),
TOYJOB_STALL="<worker>:<step>[:<seconds>]" makes it sleep there (600 s by default),
TOYJOB_QUIT="<worker>:<step>" ends that worker's loop early (it returns without being told to),
TOYJOB_NAN="<worker>:<step>" makes its parameters NaN there (a diverged model),
TOYJOB_RAISE="<worker>:<step>[,<worker>:<step>...]" raises a Python error there (a bug in the
user's code), TOYJOB_NAN_LOSS=1 reports a NaN loss at every step (a job that never trains),
TOYJOB_EXIT_SECONDS="<seconds>[:<evaluator's>]" delays the process's exit by that much (an exit
handler, a slow teardown; the evaluator's may differ),
TOYJOB_STEP_SECONDS slows each step (``"<node 0's>,<node 1's>,..."``: per node, the last one for the
nodes not named), TOYJOB_EVAL_SECONDS each evaluation. With TOYJOB_COUNT_DIR
set, each worker writes how many times it called ``worker.step`` to ``<dir>/<worker_id>.count``
when its loop ends. TOYJOB_STATS=<k> adds k running statistics that training never changes,
starting at the worker's id, and writes them to ``<dir>/<worker_id>.stats`` at the end.
With TOYJOB_COUNT_DIR set, a worker started again (respawned) writes the mean of the
parameters it started from to ``<dir>/<worker_id>.restart`` (the initial model's is 5.0).
TOYJOB_SIZE sets the number of parameters (1000). TOYJOB_MOMENTUM=1 uses a momentum buffer, registered as the worker's own state; a resumed worker
writes the norm of the buffer it got back to ``<dir>/<worker_id>.velocity``.
TOYJOB_TIMES_DIR: each worker writes ``<dir>/<worker_id>.times``, JSON ``{"node", "start",
"ends", "in_step"}``: the time before its first step, the time each ``worker.step`` call returned
(``time.time()``), and the seconds spent inside those calls.
"""

import atexit
import json
import math
import os
import signal
import time

import numpy as np


def _faults(name):
    return {tuple(float(v) for v in spec.split(":")) for spec in os.environ.get(name, "").split(",")
            if spec}


def _fault(name):
    spec = os.environ.get(name, "")
    return tuple(float(v) for v in spec.split(":")) if spec else (-1, -1)


class WithStats:
    """Parameters ``x`` followed by statistics ``s``, which rounds average instead of pull."""

    def __init__(self, x, s):
        self.x, self.s = x, s
        self.param_count, self.stats_count = x.size + s.size, s.size
        self.average_stats = True

    def read_into(self, flat):
        flat[: self.x.size], flat[self.x.size :] = self.x, self.s

    def write_from(self, flat):
        self.x[:], self.s[:] = flat[: self.x.size], flat[self.x.size :]


def main(worker):
    if os.environ.get("TOYJOB_EXIT_SECONDS"):  # also in the evaluator, whose register() ends it
        delays = [float(v) for v in os.environ["TOYJOB_EXIT_SECONDS"].split(":")]
        atexit.register(time.sleep, delays[-1] if worker.is_evaluator else delays[0])
    cfg = worker.config
    rng = np.random.default_rng(cfg.seed + 1000 * worker.worker_id)
    x = np.full(int(os.environ.get("TOYJOB_SIZE", "1000")), 5.0, dtype=np.float32)
    target = np.linspace(-1, 1, x.size, dtype=np.float32)
    stats = np.full(int(os.environ.get("TOYJOB_STATS", "0")), worker.worker_id, dtype=np.float32)
    eval_delay = float(os.environ.get("TOYJOB_EVAL_SECONDS", "0"))

    def evaluate():
        time.sleep(eval_delay)
        return {"accuracy": float(1.0 / (1.0 + np.mean((x - target) ** 2)))}

    momentum = os.environ.get("TOYJOB_MOMENTUM") == "1"
    velocity = np.zeros_like(x)
    worker.register(WithStats(x, stats) if stats.size else [x], evaluate=evaluate,
                    state=[velocity] if momentum else None)
    if worker.restarts and not worker.is_evaluator and os.environ.get("TOYJOB_COUNT_DIR"):
        with open(os.path.join(os.environ["TOYJOB_COUNT_DIR"], f"{worker.worker_id}.restart"), "w") as f:
            f.write(repr(float(np.mean(x))))
    if momentum and worker.iterations and os.environ.get("TOYJOB_COUNT_DIR"):
        with open(os.path.join(os.environ["TOYJOB_COUNT_DIR"], f"{worker.worker_id}.velocity"), "w") as f:
            f.write(repr(float(np.linalg.norm(velocity))))
    delays = [float(v) for v in os.environ.get("TOYJOB_STEP_SECONDS", "0").split(",")]
    delay = delays[min(cfg.node_index, len(delays) - 1)]
    times_dir = os.environ.get("TOYJOB_TIMES_DIR")
    ends, in_step, start = [], 0.0, time.time()
    die, stall, quit_at = _fault("TOYJOB_DIE"), _fault("TOYJOB_STALL"), _fault("TOYJOB_QUIT")
    nan_at, raise_at = _fault("TOYJOB_NAN"), _faults("TOYJOB_RAISE")
    nan_loss = os.environ.get("TOYJOB_NAN_LOSS") == "1"
    step = 0
    while True:
        step += 1
        if (worker.worker_id, step) == die and not worker.restarts:  # its first life only
            if os.environ.get("TOYJOB_COUNT_DIR"):
                with open(os.path.join(os.environ["TOYJOB_COUNT_DIR"], f"{worker.worker_id}.died"), "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if (worker.worker_id, step) == stall[:2]:
            time.sleep(stall[2] if len(stall) > 2 else 600)
        if (worker.worker_id, step) in raise_at:
            raise RuntimeError("a bug in the training loop")
        if (worker.worker_id, step) == nan_at:
            x[::7] = np.nan
        noise = rng.normal(0, 0.1, x.size).astype(np.float32)
        if momentum:
            velocity *= np.float32(0.9)
            velocity += x - target + noise
            x -= np.float32(cfg.lr) * velocity
        else:
            x -= np.float32(cfg.lr) * (x - target + noise)
        if delay:
            time.sleep(delay)
        loss = math.nan if nan_loss else float(np.mean((x - target) ** 2))
        t = time.perf_counter()
        keep = worker.step(loss)
        if times_dir:
            in_step += time.perf_counter() - t
            ends.append(time.time())
        if not keep:
            break
        if (worker.worker_id, step) == quit_at:
            break
    if times_dir:
        with open(os.path.join(times_dir, f"{worker.worker_id}.times"), "w") as f:
            json.dump({"node": cfg.node_index, "start": start, "ends": ends, "in_step": in_step}, f)
    count_dir = os.environ.get("TOYJOB_COUNT_DIR")
    if count_dir:
        with open(os.path.join(count_dir, f"{worker.worker_id}.count"), "w") as f:
            f.write(str(step))
        if stats.size:
            np.savetxt(os.path.join(count_dir, f"{worker.worker_id}.stats"), stats)
        with open(os.path.join(count_dir, f"{worker.worker_id}.finite"), "w") as f:
            f.write(str(bool(np.isfinite(x).all())))
