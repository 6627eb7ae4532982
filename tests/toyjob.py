"""A tiny numpy worker job for tests: noisy gradient descent on a quadratic.

Fault knobs (environment): TOYJOB_DIE="<worker>:<step>" SIGKILLs that worker at that step,
TOYJOB_STALL="<worker>:<step>[:<seconds>]" makes it sleep there (600 s by default),
TOYJOB_QUIT="<worker>:<step>" ends that worker's loop early (it returns without being told to),
TOYJOB_STEP_SECONDS slows each step. With TOYJOB_COUNT_DIR set, each worker writes how many
times it called ``worker.step`` to ``<dir>/<worker_id>.count`` when its loop ends.
"""

import os
import signal
import time

import numpy as np


def _fault(name):
    spec = os.environ.get(name, "")
    return tuple(float(v) for v in spec.split(":")) if spec else (-1, -1)


def main(worker):
    cfg = worker.config
    rng = np.random.default_rng(cfg.seed + 1000 * worker.worker_id)
    x = np.full(1000, 5.0, dtype=np.float32)
    target = np.linspace(-1, 1, x.size, dtype=np.float32)
    worker.register([x], evaluate=lambda: {"accuracy": float(1.0 / (1.0 + np.mean((x - target) ** 2)))})
    delay = float(os.environ.get("TOYJOB_STEP_SECONDS", "0"))
    die, stall, quit_at = _fault("TOYJOB_DIE"), _fault("TOYJOB_STALL"), _fault("TOYJOB_QUIT")
    step = 0
    while True:
        step += 1
        if (worker.worker_id, step) == die:
            os.kill(os.getpid(), signal.SIGKILL)
        if (worker.worker_id, step) == stall[:2]:
            time.sleep(stall[2] if len(stall) > 2 else 600)
        noise = rng.normal(0, 0.1, x.size).astype(np.float32)
        x -= np.float32(cfg.lr) * (x - target + noise)
        if delay:
            time.sleep(delay)
        if not worker.step(float(np.mean((x - target) ** 2))):
            break
        if (worker.worker_id, step) == quit_at:
            break
    count_dir = os.environ.get("TOYJOB_COUNT_DIR")
    if count_dir:
        with open(os.path.join(count_dir, f"{worker.worker_id}.count"), "w") as f:
            f.write(str(step))
