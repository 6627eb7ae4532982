"""TensorBoard event files that never hold up the caller (``TENSORBOARD=1``).

``EventWriter`` owns a ``tensorboardX.SummaryWriter`` in a thread of its own: ``add()`` only
puts a batch into a bounded queue (a full queue drops the batch and counts it, it never waits),
and the thread turns batches into scalars and writes them. ``close()`` waits a bounded time for
what is queued to reach the file. A writer that fails (disk full, directory removed) logs one
warning and drops everything after.

Layout under ``RUN_DIR/tensorboard/``: ``node<i>/`` (each node's local server:
``local_server/tensorboard.py``) and ``worker<id>/`` (``worker.log()``, ``worker/scalars.py``).
``tensorboard --logdir RUN_DIR/tensorboard`` shows them as runs side by side.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from .files import private_dir

log = logging.getLogger(__name__)

QUEUE_BATCHES = 10_000  # batches waiting for the writer thread; more are dropped
FLUSH_SECS = 2.0  # the thread flushes the event file at least this often
CLOSE_TIMEOUT = 10.0  # seconds close() waits for the queued batches to be written
IDLE = 0.5  # seconds between the thread's checks for close() while nothing comes
INSTALL = "pip install 'lsgd[tensorboard]'"

Scalar = tuple[str, float, int]  # tag, value, step
_STOP = object()


def board_dir(run_dir: str | Path, name: str) -> Path:
    """Where the run ``name`` (``node0``, ``worker3``) of a job writes its event files."""
    return Path(run_dir) / "tensorboard" / name


def _identity(item: Any) -> Iterable[Scalar]:
    return item


class EventWriter:
    """Writes scalars to TensorBoard event files in ``logdir`` from a background thread.

    Args:
        logdir: the directory of this run's event files (created mode 0700).
        convert: turns one queued item into ``(tag, value, step)`` scalars, in the writer's
            thread (so the caller pays only for a queue put); by default items are lists of
            scalars already.

    Raises:
        ImportError: tensorboardX is not installed (the message says what to install).
    """

    def __init__(self, logdir: str | Path,
                 convert: Callable[[Any], Iterable[Scalar]] = _identity) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(f"TensorBoard event files need tensorboardX: {INSTALL}") from None
        self.logdir = private_dir(logdir)
        self._writer = SummaryWriter(logdir=str(self.logdir), max_queue=1000,
                                     flush_secs=FLUSH_SECS)
        self._convert = convert
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        self.dropped = 0  # batches dropped: queue full, or the writer failed
        self.written = 0  # scalars handed to tensorboardX
        self._failed: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"lsgd-tensorboard-{self.logdir.name}",
                                        daemon=True)
        self._thread.start()

    def add(self, item: Any) -> None:
        """Queue ``item`` for the writer thread; never blocks (a full queue drops it)."""
        if self._closed or self._failed is not None:
            return
        try:
            self._queue.put_nowait((time.time(), item))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("TensorBoard writer for %s falls behind; dropping events", self.logdir)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Write what is queued (waiting at most ``timeout`` s), then close the event file.

        Safe to call twice."""
        if self._closed:
            return
        self._closed = True  # the thread ends once the queue is empty
        try:
            self._queue.put_nowait(_STOP)  # wakes it at once (else it sees _closed in IDLE s)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("TensorBoard writer for %s did not finish in %g s; some events may be "
                        "missing", self.logdir, timeout)
        if self.dropped:
            log.warning("TensorBoard writer for %s dropped %d batches of events", self.logdir,
                        self.dropped)

    def _run(self) -> None:
        try:
            while True:
                try:
                    entry = self._queue.get(timeout=IDLE)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if entry is _STOP:
                    break
                if self._failed is not None:
                    continue
                wall, item = entry
                try:
                    for tag, value, step in self._convert(item):
                        self._writer.add_scalar(tag, value, step, walltime=wall)
                        self.written += 1
                except Exception as exc:  # noqa: BLE001 - watching must never stop training
                    self._failed = f"{type(exc).__name__}: {exc}"
                    log.warning("TensorBoard writer for %s failed and stops: %s", self.logdir,
                                self._failed)
        finally:
            try:
                self._writer.close()  # flushes tensorboardX's own queue into the file
            except Exception as exc:  # noqa: BLE001
                log.warning("TensorBoard writer for %s could not close: %s", self.logdir, exc)


__all__ = ["EventWriter", "board_dir", "INSTALL"]
