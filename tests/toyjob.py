"""A tiny numpy worker job for tests: noisy gradient descent on a quadratic."""

import time

import numpy as np


def main(worker):
    cfg = worker.config
    rng = np.random.default_rng(cfg.seed + 1000 * worker.worker_id)
    x = np.full(1000, 5.0, dtype=np.float32)
    target = np.linspace(-1, 1, x.size, dtype=np.float32)
    worker.register([x], evaluate=lambda: {"accuracy": float(1.0 / (1.0 + np.mean((x - target) ** 2)))})
    delay = float(__import__("os").environ.get("TOYJOB_STEP_SECONDS", "0"))
    while True:
        noise = rng.normal(0, 0.1, x.size).astype(np.float32)
        x -= np.float32(cfg.lr) * (x - target + noise)
        if delay:
            time.sleep(delay)
        if not worker.step(float(np.mean((x - target) ** 2))):
            break
