"""Pure decisions of a node's round, apart from queues, shared memory and gRPC.

A worker sent a Pull reads the node buffers it names (``WorkerState.reading``) until its Done
arrives; a reset non-finite worker reads the buffer it copies. The node must not overwrite such a
buffer meanwhile: a worker would pull toward half an old and half a new vector. Counting Done
messages is not enough (one worker's Done must never stand in for another's, and a worker late
from an earlier round still reads), so the node asks which workers still read the buffer.
"""

from __future__ import annotations

from collections.abc import Iterable

from .state import WorkerState


def readers(workers: Iterable[WorkerState], buffer: str) -> list[int]:
    """Ids of the workers that may still read node buffer ``buffer``: sent a pull that reads
    it, no Done from them since, and their process not known to be gone."""
    return [w.worker_id for w in workers if buffer in w.reading and not w.gone]


__all__ = ["readers"]
