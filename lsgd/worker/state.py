"""A worker's private state in checkpoints: optimizer buffers and the like.

``register(..., state=...)`` names tensors that belong to this worker alone (momentum buffers,
Adam moments): never exchanged, but saved at every checkpoint round to
``RUN_DIR/node<i>/state-worker<id>.npz`` and loaded back on ``RESUME=1``. ``state`` is a list
(numpy arrays, PyTensor shared variables, PyTorch tensors) or a function returning one, for
state a framework creates lazily (PyTorch optimizers create momentum at the first step).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_path
from .adapters import as_params

log = logging.getLogger(__name__)


class WorkerState:
    def __init__(self, state: Any, path: Path) -> None:
        self._state = state
        self.path = path

    def _adapter(self):  # noqa: ANN202
        items = self._state() if callable(self._state) else self._state
        return as_params(list(items)) if items else None

    def save(self, round_id: int) -> None:
        adapter = self._adapter()
        if adapter is None:
            return
        flat = np.empty(adapter.param_count, np.float32)
        adapter.read_into(flat)
        with atomic_path(self.path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, round=np.array(round_id, dtype=np.int64), state=flat)

    @property
    def exists(self) -> bool:
        """Whether the state has been created (a framework may create it at the first step)."""
        return self._adapter() is not None

    def load(self) -> bool:
        """Restore the saved state; False (logged) when there is none that fits."""
        adapter = self._adapter()
        if adapter is None or not self.path.exists():
            log.warning("no saved worker state to resume from (%s)", self.path)
            return False
        with np.load(self.path, allow_pickle=False) as z:
            flat = z["state"]
        if flat.shape != (adapter.param_count,):
            log.warning("saved worker state %s has %d values, the state now %d; not restored",
                        self.path, flat.size, adapter.param_count)
            return False
        adapter.write_from(flat)
        return True


def make(state: Any | None, run_dir: str, node_index: int, worker_id: int) -> WorkerState | None:
    if state is None:
        return None
    if not (callable(state) or isinstance(state, (list, tuple))):
        raise TypeError("state must be a list of arrays / shared variables / tensors, or a "
                        "function returning one")
    return WorkerState(state, Path(run_dir) / f"node{node_index}" / f"state-worker{worker_id}.npz")


__all__ = ["WorkerState", "make"]
