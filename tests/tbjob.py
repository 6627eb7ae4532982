"""A tiny entry for the TensorBoard tests: noisy gradient descent on a quadratic (as toyjob.py)
whose loop logs scalars of its own with ``worker.log()`` every ``TBJOB_EVERY`` steps (10), and
records every ``on_log`` call in ``<TBJOB_DIR>/<worker_id>.onlog`` (one JSON line per call).
"""

import json
import os

import numpy as np


def main(worker):
    out = os.environ.get("TBJOB_DIR")
    every = int(os.environ.get("TBJOB_EVERY", "10"))
    if out and not worker.is_evaluator:
        path = os.path.join(out, f"{worker.worker_id}.onlog")

        @worker.on_log
        def record(scalars, step):
            with open(path, "a") as f:
                f.write(json.dumps({"scalars": scalars, "step": step}) + "\n")

    rng = np.random.default_rng(worker.config.seed + 1000 * worker.worker_id)
    x = np.full(100, 5.0, dtype=np.float32)
    target = np.linspace(-1, 1, x.size, dtype=np.float32)
    worker.register([x], evaluate=lambda: {"accuracy": float(1 / (1 + np.mean((x - target) ** 2)))})
    step = 0
    while True:
        step += 1
        x -= np.float32(worker.config.lr) * (x - target + rng.normal(0, 0.1, x.size).astype(np.float32))
        loss = float(np.mean((x - target) ** 2))
        if step % every == 0:
            worker.log({"custom/loss": loss, "custom/id": worker.worker_id})
        if not worker.step(loss):
            break
