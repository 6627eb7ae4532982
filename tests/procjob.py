"""A worker job that starts processes of its own: a ``multiprocessing.Pool`` and (with PyTorch)
a ``DataLoader(num_workers=2)``, used at every step, as real input pipelines are, and a helper
program (``sleep 600``, as a tool started with ``subprocess`` would be) that, unlike the Pool and
DataLoader processes, never notices that its parent died.

Noisy gradient descent on a quadratic (as ``toyjob.py``); the noise of each step is drawn by the
Pool and the targets come from the DataLoader. Knobs (environment): PROCJOB_LOADER=1 adds the
DataLoader; PROCJOB_DIR: each worker writes the pids of the processes it started to
``<dir>/<worker_id>.<life>.children`` once they run, and its step count to
``<dir>/<worker_id>.count`` at the end; PROCJOB_DIE="<worker>:<step>" SIGKILLs that worker
there (first life only); PROCJOB_STALL="<worker>:<step>" makes it sleep 600 s there (after
writing ``<dir>/<worker_id>.stalled``); PROCJOB_STEP_SECONDS slows each step.
"""

import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np


def noise(seed):
    return np.random.default_rng(seed).normal(0, 0.1, 64).astype(np.float32)


def children():
    """Pids of this process's direct children."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid():
            pids.append(int(stat.parent.name))
    return pids


def batches(size):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    targets = torch.linspace(-1, 1, size).repeat(256, 1)
    loader = DataLoader(TensorDataset(targets), batch_size=8, num_workers=2, persistent_workers=True)
    while True:
        for (batch,) in loader:
            yield batch.mean(0).numpy()


def main(worker):
    out = Path(os.environ["PROCJOB_DIR"])
    die = tuple(int(v) for v in os.environ.get("PROCJOB_DIE", "-1:-1").split(":"))
    stall = tuple(int(v) for v in os.environ.get("PROCJOB_STALL", "-1:-1").split(":"))
    delay = float(os.environ.get("PROCJOB_STEP_SECONDS", "0"))
    x = np.full(64, 5.0, dtype=np.float32)
    worker.register([x])
    pool = multiprocessing.Pool(2)
    subprocess.Popen(["sleep", "600"])
    targets = batches(x.size) if os.environ.get("PROCJOB_LOADER") == "1" else None
    step = 0
    while True:
        step += 1
        target = next(targets) if targets is not None else np.zeros_like(x)
        x -= np.float32(worker.config.lr) * (x - target + pool.apply(noise, (step,)))
        if step == 1:  # all started now
            (out / f"{worker.worker_id}.{worker.restarts}.children").write_text(
                " ".join(map(str, children())))
        if (worker.worker_id, step) == die and not worker.restarts:
            os.kill(os.getpid(), signal.SIGKILL)
        if (worker.worker_id, step) == stall:
            (out / f"{worker.worker_id}.stalled").write_text("")
            time.sleep(600)
        if delay:
            time.sleep(delay)
        if not worker.step(float(np.mean((x - target) ** 2))):
            break
    pool.close()
    pool.join()
    (out / f"{worker.worker_id}.count").write_text(str(step))


def group_leader(parent_pid, pids):
    """For the process-group tests: lead a group as a worker does, start a program, wait."""
    from lsgd.local_server.procs import lead_own_group

    lead_own_group(parent_pid)
    pids.send((os.getpid(), subprocess.Popen(["sleep", "600"]).pid))  # a pipe: no lock to hold
    time.sleep(600)


def stand_in_server(pids):
    """A local server stand-in: starts one ``group_leader`` as its worker, then waits."""
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=group_leader, args=(os.getpid(), pids)).start()
    time.sleep(600)
