"""The node loop's part of an asynchronous rule: answer each worker's exchange at once, and
send the node's last deltas before the final round.

A mixin of ``LocalServer`` (``server.py``); the exchange itself and the sync thread are
``async_node.AsyncNode``.
"""

from __future__ import annotations

import logging
import math
import time

from . import messages as m
from .global_client import RPC_TIMEOUT
from .mailroom import MAX_TAKES
from .state import WorkerState

log = logging.getLogger("lsgd.local_server.server")


class AsyncMixin:
    """Exchanges of asynchronous rules (methods of ``LocalServer``)."""

    def _exchange(self, w: WorkerState, msg: m.Exchange) -> None:
        node = self.async_node
        if node is None or self.stopping:  # a synchronous rule never sends one; or the end
            self._send(w, m.Exchanged(False))
            return
        changed, distance, reset = node.exchange(w.local, msg.action, msg.healthy)
        self._send(w, m.Exchanged(changed, reset))
        if reset:
            self.resets[w.worker_id] = self.resets.get(w.worker_id, 0) + 1
            log.warning("worker %d: non-finite loss or parameters: reset to %s", w.worker_id,
                        "the center" if node.center is not None
                        else "its node's newest exchanged parameters")  # AsyncNode._fallback
        self.metrics.rows([{
            "round": 0, "kind": "exchange", "iteration": self.view.counter,
            "time_s": round(time.monotonic() - self.t0, 4), "worker_id": w.worker_id,
            "worker_iterations": msg.iterations, "loss": msg.loss,
            "local_leader": None, "global_leader": None, "pull_local": None, "pull_global": None,
            "pull_center": None if math.isnan(distance) else distance,
            "reset": "center" if reset else None}])

    def _flush_async(self) -> None:
        """Before the final round: every delta of this node reaches the center first."""
        if self.async_node is None:
            return
        self.view.wait("final round: sending this node's last center deltas", key="final")
        # flush starts no sync after round_timeout; one in flight ends within its calls'
        # deadlines (a push and at most MAX_TAKES + 1 downloads, each round_timeout + RPC_TIMEOUT)
        one_sync = (MAX_TAKES + 2) * (self.cfg.round_timeout + RPC_TIMEOUT)
        with self.liveness.blocking(self.cfg.round_timeout + one_sync + 5):
            if not self.async_node.flush(self.cfg.round_timeout):
                self.summary["deltas_lost"] = True
