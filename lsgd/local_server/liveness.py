"""The node loop's liveness beat, as its workers see it.

Workers read a shared timestamp (``WorkerContext.beat``) while they wait for their local server
and give up when it is older than ``max(round_timeout, connect_timeout) + 30`` s: a node whose
loop stopped must not leave its workers waiting forever. The loop refreshes it each time it
looks at its inbox. A few of its calls block longer than that on purpose and with a bound of
their own (a global round's barrier, a parameter download or upload, a checkpoint save), so
``LoopBeat.blocking(limit)`` wraps them: a thread beats for the loop while the call runs, but
only for ``limit`` seconds. A call that overstays its bound is stuck, the beat goes stale, and
the workers notice, as they would for a loop that stopped anywhere else. The node's heartbeat to
the global server (``Heartbeat``) reads the same beat and stops beating once it is stale, so a
node whose process is up but whose loop is stuck is dropped from the job, and its Kubernetes
liveness probe (``lsgd probe --live``) fails.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

PERIOD = 1.0  # seconds between beats on the loop's behalf (workers check about every second)
MARGIN = 30.0  # seconds past the longest bounded call before a silent loop counts as stuck


def stale_after(round_timeout: float, connect_timeout: float) -> float:
    """Seconds of a silent loop beat after which the loop counts as stuck: its longest blocking
    call (a round barrier, or the first connection) is bounded by these, plus a margin."""
    return max(round_timeout, connect_timeout) + MARGIN


class LoopBeat:
    """Writes ``time.monotonic()`` into ``shared.value`` for the node loop (Linux's monotonic
    clock is the same in every process of the machine, and no wall-clock jump moves it)."""

    def __init__(self, shared: Any, period: float = PERIOD) -> None:
        self.shared, self.period = shared, period
        self._until = 0.0  # time.monotonic() until which the thread beats (0: it does not)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The loop is running now."""
        self.shared.value = time.monotonic()

    @contextmanager
    def blocking(self, limit: float) -> Iterator[None]:
        """Keep beating while the caller blocks in a call bounded by ``limit`` seconds (its
        own deadline plus a margin); beat no longer once ``limit`` has passed."""
        self.beat()
        with self._lock:
            outer = self._until
            self._until = time.monotonic() + limit
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lsgd-loop-beat",
                                                daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._until = outer  # an enclosing call's bound again (0 outside any)
            self.beat()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.period + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                if time.monotonic() < self._until:
                    self.beat()
