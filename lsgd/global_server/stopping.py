"""Stopping a whole job from node 0: a part of the global server's brain (``Coordinator``).

When node 0 ends for any reason but the job's end (Ctrl-C, SIGTERM, no worker left, a
failure) it stops the whole job with ``Leave(stop_job=reason)``: the coordinator records why,
grants nothing more, closes the open round, opens no other, refuses joins, and every later
answer to a node carries the reason (``stopped_for``), so that every node ends within about one
heartbeat. The global server serves on until every live node has been told, at most ``linger``
seconds (``stop_settled``), then exits.

Pure logic, like the coordinator: the clock is an argument, the caller holds the lock.
"""

from __future__ import annotations

import logging

from .records import CoordinatorError

log = logging.getLogger("lsgd.global_server.coordinator")


class JobStop:
    """Mixin of ``Coordinator``: the job-stop decision and who has been told of it."""

    stopped: str | None  # the job was stopped, for this reason (set by ``halt``)
    stopped_at: float
    told: set[int]  # nodes that have been answered with ``stopped``

    STOP_REASON_MAX = 500  # characters of a stop reason kept (a bounded field)

    def stop_job(self, index: int, session: int, reason: str, consumed: int, late: int,
                 now: float) -> None:
        """Node 0 stops the whole job (it was interrupted, or failed): it leaves, reporting its
        steps not yet counted (as ``leave`` does), and every other node is told ``reason``.

        Raises CoordinatorError (changing nothing) for another node, a stale session or a
        negative count.
        """
        if index != 0:
            raise CoordinatorError("PERMISSION_DENIED",
                                   f"node {index} cannot stop the job; only node 0 can")
        node = self._node(index, session, now)
        self._settle_leaving(node, consumed, late)  # checked as any count (raises, no change)
        node.left = True
        node.outstanding = 0
        self.halt(f"job stopped on node 0: {reason.strip()[:self.STOP_REASON_MAX] or 'stopped'}",
                  now)

    def halt(self, text: str, now: float) -> bool:
        """Stop the job now for ``text`` (stop_job, or the global server itself told to stop);
        False when it is already stopped or finished (nothing changes)."""
        if self.stopped is not None or self.finished:
            return False
        self.stopped, self.stopped_at, self.stop_reason = text, now, text
        if not self.finishing:  # the final round's opening granted it already
            self._grant_last_steps()  # each worker's update before step() answered False
        if self.round is not None and not self.round.closed:
            self.round.closed = True  # its waiters wake and are told; no exchange follows
        log.warning("%s (counter %d)", text, self.done)
        return True

    def stopped_for(self, index: int) -> str:
        """The stop reason to put in an answer to node ``index`` ('' while the job runs);
        records that the node has been told."""
        if self.stopped is None:
            return ""
        self.told.add(index)
        return self.stopped

    def stop_settled(self, now: float, linger: float) -> bool:
        """After a stop: every live node has been told (or ``linger`` seconds have passed), so
        the global server may exit."""
        if self.stopped is None:
            return False
        waiting = [n.index for n in self.live_nodes if n.index not in self.told]
        return not waiting or now - self.stopped_at >= linger
