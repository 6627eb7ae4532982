"""Node checkpoints: every slot and node buffer, with the round they belong to.

``RUN_DIR/node<i>/checkpoint.npz`` holds the vectors (numpy's npz, read without pickle) and
``checkpoint.json`` the round, the global iteration and each worker's own step count. Both are
written atomically (temporary file, fsync, rename), the vectors first, so a crash mid-write
leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..files import atomic_path, write_atomic
from .store import NodeStore

NPZ, META = "checkpoint.npz", "checkpoint.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message says why."""


def save(directory: Path, store: NodeStore, round_id: int, iteration: int,
         worker_iterations: dict[int, int]) -> None:
    arrays = {f"slot{i}": store.slot(i) for i in range(store.layout.slots)}
    arrays |= {f"buffer_{name}": store.buffer(name) for name in store.layout.buffers}
    with atomic_path(directory / NPZ) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, round=np.array(round_id, dtype=np.int64), **arrays)
    write_atomic(directory / META, json.dumps({
        "round": round_id, "iteration": iteration,
        "worker_iterations": {str(k): v for k, v in worker_iterations.items()}}))


def load(directory: Path, store: NodeStore) -> dict:
    """Fill ``store`` from the checkpoint in ``directory``; returns its metadata."""
    try:
        meta = json.loads((directory / META).read_text())
        with np.load(directory / NPZ, allow_pickle=False) as z:
            if int(z["round"]) != meta["round"]:
                raise CheckpointError(f"{directory / NPZ} is of round {int(z['round'])}, "
                                      f"{META} of round {meta['round']}")
            names = [f"slot{i}" for i in range(store.layout.slots)]
            names += [f"buffer_{n}" for n in store.layout.buffers]
            for name in names:
                if name not in z or z[name].shape != (store.layout.param_count,):
                    raise CheckpointError(f"the checkpoint in {directory} does not fit this model "
                                          f"and WORKERS ({name} missing or of another size)")
            for i in range(store.layout.slots):
                store.slot(i)[:] = z[f"slot{i}"]
            for n in store.layout.buffers:
                store.buffer(n)[:] = z[f"buffer_{n}"]
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot resume from {directory}: {exc}") from None
    return meta
