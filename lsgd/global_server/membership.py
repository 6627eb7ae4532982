"""Membership: who is in the job, joining, reattaching, replacing a restarted run, leaving.

A mixin of ``Coordinator`` (``coordinator.py``), pure like it: the clock is an argument, the
caller holds the lock, and a refused call raises ``CoordinatorError`` having changed nothing.
"""

from __future__ import annotations

import logging

from ..rules.base import RoundKind
from . import claims
from .records import CoordinatorError, NodeState

log = logging.getLogger("lsgd.global_server.coordinator")
FINISHING = "the job is finishing"  # the start of the refusal of a join that came too late


class Membership:
    """Joins, reattaches and leaves (methods of ``Coordinator``)."""

    def join(self, *, job_id: str, index: int, workers: int, algorithm: str, num_groups: int,
             now: float, resume_session: int = 0, held: int = 0, unreported: int = 0,
             seq: int = 0, unanswered_seq: int = 0, unanswered_steps: int = 0,
             replaces_session: int = 0) -> NodeState:
        """Admit a node (or raise CoordinatorError, changing nothing).

        With ``resume_session`` equal to the node's session (after a server restart or a
        partition), the node keeps its session: it holds ``held`` credits and took
        ``unreported`` steps the counter lacks (counted now, as late steps), plus the steps of
        its credit request ``unanswered_seq`` if that request never arrived. ``seq`` numbers
        the join like a credit request, so a repeated join counts nothing twice. A resume
        whose session matches no node is refused: the node must be started again.

        With ``replaces_session`` equal to the session of the live member ``index`` (the node
        restarted after a crash, by hand or by a supervisor, before ``node_timeout`` dropped
        it), that member is dropped now and the node joins afresh (see ``_replace``).
        """
        self.check_join(job_id=job_id, index=index, workers=workers, algorithm=algorithm,
                        num_groups=num_groups)
        old = self.nodes.get(index)
        if resume_session:
            if old is None or old.session != resume_session or old.left:
                why = "it left the job" if old is not None and old.session == resume_session else (
                    "the server does not know that session (it restarted from a state saved "
                    "before the node joined, or the node was replaced by a newer run)")
                raise CoordinatorError("FAILED_PRECONDITION",
                                       f"node {index} cannot reattach: {why}; start the node "
                                       "again with train.sh to join afresh")
            return self._reattach(old, now, held=held, unreported=unreported, seq=seq,
                                  unanswered_seq=unanswered_seq, unanswered_steps=unanswered_steps)
        if old is not None and old.alive and not old.left:
            if not replaces_session or old.session != replaces_session:
                silent = now - old.last_seen
                if silent > min(2.0, self.node_timeout / 2):  # its heartbeats stopped: a run
                    # that died and is not dropped yet; this one joins once it is (the node
                    # retries UNAVAILABLE until CONNECT_TIMEOUT)
                    raise CoordinatorError(
                        "UNAVAILABLE", f"node {index} is still held by an earlier run, silent "
                        f"for {silent:.1f} s; it is dropped after {self.node_timeout:g} s "
                        "(NODE_TIMEOUT), then this run joins")
                raise CoordinatorError("FAILED_PRECONDITION",
                                       f"node {index} is already in the job; each node index runs once")
            if self.round is None or self.round.kind != RoundKind.FINAL:
                self._replace(old, now)
        if self.round is not None and self.round.kind == RoundKind.FINAL:
            raise CoordinatorError("FAILED_PRECONDITION", f"{FINISHING}; no node can join")
        session = self.rng.getrandbits(63) | 1
        node = NodeState(index, session, workers, joined_at=now, last_seen=now,
                         last_round_seen=self._round_seen_on_join(index),
                         consumed=old.consumed if old is not None else 0)  # the index's total
        self.nodes[index] = node
        if self.live_count == self.num_groups:
            self.started = True
        log.info("node %d joined (%d/%d live)", index, self.live_count, self.num_groups)
        return node

    def _replace(self, old: NodeState, now: float) -> None:
        """A restarted node takes the place of its earlier run: that membership ends as if
        ``node_timeout`` had dropped it (its outstanding credits are freed, rounds stop waiting
        for it; the steps it took but never reported are lost)."""
        log.warning("node %d restarted: its earlier run is dropped (%d credits freed) and the "
                    "node joins again", old.index, old.outstanding)
        old.alive = False
        old.outstanding = 0
        self._maybe_close_round(now)

    def check_join(self, *, job_id: str, index: int, workers: int, algorithm: str,
                   num_groups: int) -> None:
        """Refuse (CoordinatorError) a node whose job or settings differ; changes nothing."""
        if job_id != self.job_id:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"job id '{job_id}' does not match the server's '{self.job_id}'")
        if self.stopped is not None:
            self.told.add(index)  # this refusal is how a (re)joining node learns of the stop
            raise CoordinatorError("FAILED_PRECONDITION", self.stopped)
        if algorithm != self.algorithm or num_groups != self.num_groups or workers != self.workers:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"node {index} runs algorithm={algorithm[:200]} num_groups={num_groups} workers={workers} "
                f"but the job runs algorithm={self.algorithm} num_groups={self.num_groups} "
                f"workers={self.workers}; use the same train.sh settings on every node")
        if not 0 <= index < self.num_groups:
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"node index {index} is out of range 0..{self.num_groups - 1}")

    def _reattach(self, old: NodeState, now: float, *, held: int, unreported: int, seq: int,
                  unanswered_seq: int, unanswered_steps: int) -> NodeState:
        """The node ``old`` comes back with its session (see ``join``); every count is bounded
        by what it can have done (``claims.py``) and checked before anything changes."""
        index = old.index
        try:
            claims.check_seq(index, seq, old.last_seq, ahead=0 if old.needs_resume else 2)
            if seq and seq == old.last_seq:  # a repeated join: already applied
                return old
            if seq and seq < old.last_seq:  # not a retry: something else used newer numbers
                raise CoordinatorError("FAILED_PRECONDITION",
                                       f"join {seq} of node {index} is older than its request "
                                       f"{old.last_seq} (replayed); start the node again")
            if unanswered_seq and (unanswered_seq >= claims.MAX_SEQ
                                   or (seq and unanswered_seq >= seq)):
                raise claims.ClaimError(f"unanswered request {unanswered_seq} of node {index} "
                                        f"is not before this join ({seq})")
            counted = unreported + (unanswered_steps if unanswered_seq > old.last_seq else 0)
            spare = claims.reattach(index, held, counted, old.outstanding, old.spare,
                                    period=self.schedule.period,
                                    detached_steps=self.schedule.detached_steps,
                                    restored=old.needs_resume)
        except claims.ClaimError as exc:
            raise CoordinatorError("INVALID_ARGUMENT", str(exc)) from None
        old.alive, old.last_seen, old.outstanding, old.needs_resume = True, now, held, False
        old.spare = spare
        old.last_seq, old.last_grant = seq, None
        old.last_round_seen = self._round_seen_on_join(index)
        old.consumed += counted
        self.done += counted
        log.info("node %d reattached (holds %d credits, %d steps reported now)", index, held,
                 counted)
        return old

    def _round_seen_on_join(self, index: int) -> int:
        """A joining node takes part from the next round, or from the open one if that round
        waits for it (a reattaching node must not skip a round, above all the final one)."""
        rnd = self.round
        if rnd is None:
            return 0
        if not rnd.closed and index in rnd.expected and index not in rnd.reports:
            rnd.pending.add(index)  # the round waits for it again, as for any expected node
            return rnd.id - 1
        return rnd.id

    def heartbeat(self, index: int, session: int, now: float) -> None:
        self._node(index, session, now)

    def leave(self, index: int, session: int, consumed: int, late: int, now: float) -> None:
        node = self._node(index, session, now)
        self._settle_leaving(node, consumed, late)
        node.left = True
        node.outstanding = 0
        log.info("node %d left; counter %d", index, self.done)
        self._maybe_close_round(now)
