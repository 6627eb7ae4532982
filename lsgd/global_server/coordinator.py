"""The global server's brain: counter, credits, rounds, membership and the stop rule.

Pure Python, no I/O, no threads: every method takes ``now`` (seconds, any monotonic origin) and
returns a decision. The gRPC servicer holds the lock and translates protobuf to these calls.

Counting. Workers step on *credits*: the coordinator grants a node credits, the node hands them
to its workers, and each SGD step consumes one. Consumed steps are reported back and added to
the global counter ``done``, which therefore equals the number of steps actually taken. Credits
are never granted past the next *target* (the next round boundary or the end of the budget):
``done + outstanding <= target``. When ``done`` reaches the target, every granted credit has
been used, the round opens, and each node learns of it on its next request. This keeps Algorithm
1's rule — a local round each time the global total crosses a multiple of
``num_groups*workers*l_comm``, a global round at multiples of ``num_groups*workers*g_comm`` —
exact, while a node talks to the global server only a few times per round.

Faults. A node silent for ``node_timeout`` is dropped: its outstanding credits are forfeited
(free for others), and no round waits for it. A round closes when every expected node has
reported or ``round_timeout`` has passed; late reports are told they missed it.

Membership (joins, reattaches, leaves): ``membership.Membership``; the records it keeps and
answers: ``records.py``; stopping the job (node 0 interrupted or failed): ``stopping.JobStop``.
"""

from __future__ import annotations

import dataclasses
import logging
import random

from ..leader import Candidate, elect
from ..rules.base import RoundKind
from . import claims, shares
from .membership import Membership
from .records import (CoordinatorError, Grant, NodeState, NodeTable, RoundOutcome, RoundState,
                      Schedule, _due)
from .stopping import JobStop

log = logging.getLogger(__name__)

DROP_SCAN = 0.05  # seconds between two of tick's passes looking for silent nodes
EARLIER_KEPT = 4  # rounds before the newest whose outcome a late-woken barrier may still ask

__all__ = ["Coordinator", "CoordinatorError", "Grant", "NodeState", "RoundOutcome", "RoundState",
           "Schedule"]


class Coordinator(Membership, JobStop):
    """State machine of the global server. Not thread-safe: the caller holds a lock."""

    def __init__(self, *, job_id: str, algorithm: str, num_groups: int, workers: int,
                 schedule: Schedule, max_seconds: float | None, node_timeout: float,
                 round_timeout: float, join_timeout: float, now: float,
                 eval_every: int = 0, checkpoint_every: int = 0,
                 rng: random.Random | None = None) -> None:
        self.job_id, self.algorithm = job_id, algorithm
        self.num_groups, self.workers = num_groups, workers
        self.schedule = schedule
        self.node_timeout, self.round_timeout = node_timeout, round_timeout
        self.started_at = now
        self.join_deadline = now + join_timeout
        self.deadline = now + max_seconds if max_seconds is not None else None
        self.rng = rng or random.SystemRandom()
        self.nodes: NodeTable = NodeTable()  # dict[int, NodeState] with running totals
        self.done = 0
        self.started = False
        self.stop_reason: str | None = None
        self.period_start = 0
        self.target, self.target_kind = schedule.next_event(0)
        self.round: RoundState | None = None  # newest round
        # The rounds before it, by id (a few): a node that reported one in time still gets its
        # outcome once a newer round opened (the session port answers a node whose answer
        # carries the leader only once the leader is in).
        self.earlier: dict[int, RoundState] = {}
        self.rounds_opened = 0
        self.eval_every = eval_every
        self.next_eval = eval_every  # counter value from which the next global round evaluates
        self.checkpoint_every = checkpoint_every
        self.next_checkpoint = checkpoint_every
        self.stop_reason_at: float | None = None  # when stop_reason was set (budget, MINUTES)
        self.stopped: str | None = None  # the job was stopped (stop_job), for this reason
        self.stopped_at = 0.0
        self.told: set[int] = set()  # nodes that have been answered with ``stopped``
        self.last_leader: RoundState | None = None  # newest closed global round with a leader
        self._scan_at = now  # when tick next looks for silent nodes
        self.rate_sum = 0.0  # live nodes' speeds summed (_take_speeds; 0: not all known)
        self._rate_of = -1  # ``nodes.changes`` when rate_sum was taken

    # ------------------------------------------------------------------ helpers
    @property
    def outstanding(self) -> int:
        """Credits the alive nodes hold (a running total: O(1))."""
        return self.nodes.outstanding

    @property
    def live_count(self) -> int:
        """Nodes alive and not left (a running total: O(1))."""
        return self.nodes.live

    @property
    def live_nodes(self) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.alive and not n.left]

    @property
    def finished(self) -> bool:
        """The final round has closed."""
        return self.round is not None and self.round.kind == RoundKind.FINAL and self.round.closed

    @property
    def all_gone(self) -> bool:
        """Every node that joined has left or been dropped (and at least one joined)."""
        return bool(self.nodes) and not self.live_count

    def _node(self, index: int, session: int, now: float) -> NodeState:
        node = self.nodes.get(index)
        if node is None or node.session != session:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"node {index} is not a member of job '{self.job_id}' "
                                   "(never joined, or replaced by a newer session); restart it")
        if node.needs_resume:
            raise CoordinatorError("FAILED_PRECONDITION", f"the global server restarted; node "
                                   f"{index} must reattach before anything else")
        if not node.alive:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"node {index} was dropped after {self.node_timeout:g} s of "
                                   "silence; a running node reattaches on its own (one that "
                                   "cannot: restart it with train.sh)")
        node.last_seen = now
        return node

    # ------------------------------------------------------------------ credits
    def _consume(self, node: NodeState, consumed: int, late: int, released: int) -> None:
        try:
            node.outstanding, node.spare = claims.settle(node.index, node.outstanding, node.spare,
                                                         consumed, late, released)
        except claims.ClaimError as exc:
            raise CoordinatorError("INVALID_ARGUMENT", str(exc)) from None
        node.consumed += consumed + late
        self.done += consumed + late

    def _settle_leaving(self, node: NodeState, consumed: int, late: int) -> None:
        """A leaving node's last counts. It gives back every credit it still holds first, so
        that steps a stuck worker took on credits the node released since its last report
        (``Leave`` carries no release) are late steps on credits it was granted."""
        self._consume(node, consumed, late, max(0, node.outstanding - consumed))

    def acquire(self, index: int, session: int, *, consumed: int, late: int, released: int,
                want: int, last_round_seen: int, now: float, seq: int = 0,
                used_ms: int = 0) -> Grant:
        """Report consumed steps (taken in ``used_ms``, 0: not measured) and ask for ``want``
        more credits.

        ``seq`` numbers the node's requests: the same number again is a retry and gets the
        same answer without counting anything twice; a smaller one is a replay and is refused.
        """
        node = self._node(index, session, now)
        if seq:
            try:
                claims.check_seq(index, seq, node.last_seq, ahead=1)
            except claims.ClaimError as exc:
                raise CoordinatorError("INVALID_ARGUMENT", str(exc)) from None
            if seq < node.last_seq:
                raise CoordinatorError("FAILED_PRECONDITION", f"credit request {seq} of node "
                                       f"{index} is older than {node.last_seq} (replayed)")
            if seq == node.last_seq and node.last_grant is not None:
                return node.last_grant
        timed = node.timed
        node.timed = shares.sampled(*timed, consumed, used_ms)
        try:
            grant = self._acquire(node, consumed=consumed, late=late, released=released,
                                  want=want, last_round_seen=last_round_seen, now=now)
        except CoordinatorError:
            node.timed = timed  # a refused request changes nothing
            raise
        if seq:
            node.last_seq = seq
        node.last_grant = grant  # also the later passes of a long-poll: the answer sent last
        return grant

    def round_news(self, index: int, session: int, last_round_seen: int,
                   now: float) -> Grant | None:
        """What ``acquire`` answers a long-poll woken with nothing to count (no steps, no
        ``seq``) when its news is a global or final round the node takes part in and has not
        seen: the round, and no credits. None where anything else may apply, and ``acquire``
        is asked instead (a closed round, for one: time may open the next). Unlike
        ``acquire`` it does not advance time: the answer is the same, and the 512 polls a
        round opening wakes at once need no 512 passes of ``tick`` (the server's ticker and
        every other call make them)."""
        rnd = self.round
        if (rnd is None or rnd.kind == RoundKind.LOCAL or rnd.closed or self.stopped is not None
                or index not in rnd.expected):
            return None
        try:
            node = self._node(index, session, now)  # a member, heard of now
        except CoordinatorError:
            return None  # acquire refuses it, saying why
        if node.left or max(node.last_round_seen, last_round_seen) >= rnd.id:
            return None
        node.last_round_seen = max(node.last_round_seen, last_round_seen)
        node.last_grant = Grant(round=rnd)
        return node.last_grant

    def _acquire(self, node: NodeState, *, consumed: int, late: int, released: int,
                 want: int, last_round_seen: int, now: float) -> Grant:
        index = node.index
        if last_round_seen > (self.round.id if self.round else 0):
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"round {last_round_seen} does not exist yet")
        self._consume(node, consumed, late, released)
        if self.stopped is not None:  # nothing more to grant; the answer carries the reason
            return Grant()
        node.last_round_seen = max(node.last_round_seen, last_round_seen)
        self.tick(now)
        rnd = self.round
        if rnd is not None and node.last_round_seen < rnd.id and index in rnd.expected:
            # A local round's answer also carries the node's first credits after it: one call
            # less per node and round (issue 15). Not a global round's: credits held through
            # its exchange (a slow download, a checkpoint) would stall the other nodes.
            if rnd.kind != RoundKind.LOCAL:
                return Grant(round=rnd)
            return dataclasses.replace(self._grant(node, want), round=rnd, wait=False)
        if self.finished or (rnd is not None and rnd.kind == RoundKind.FINAL):
            return Grant(wait=False)
        return self._grant(node, want)

    def _grant(self, node: NodeState, want: int) -> Grant:
        """Credits up to the next target for ``node``, or why there are none yet (``wait``).
        The node's first credits of a period are a share in proportion to its speed once every
        live node's is known; others, half a fair share (``shares.py``)."""
        if not self.started or want <= 0:
            return Grant(wait=want > 0)
        free = self.target - self.done - self.outstanding
        if free <= 0:
            return Grant(wait=True)
        period = min(self.target - self.period_start, self.schedule.global_period)
        # A node never holds more than a period (what a reattaching node may claim, claims.py);
        # without rounds nothing else bounds it.
        room = period - node.outstanding
        if room <= 0:
            return Grant(wait=True)
        # The node's first credits since the newest round; without rounds (an asynchronous
        # rule) every grant, so that what each node holds is worth the same time.
        opening = node.granted_in < self.rounds_opened or not self.schedule.rounds
        half = shares.half_fair(period, self.live_count)
        speed = shares.rate(*node.timed)
        share = shares.proportional(period, speed, self.rate_sum) if opening and (
            self._rate_of == self.nodes.changes) else 0  # over the same nodes
        if share:  # at least an eighth of a fair share, whatever another node's speed claims
            share = max(share, half // 4)
        grant = min(want, free, room, share or half)
        node.outstanding += grant
        node.granted_in = self.rounds_opened
        return Grant(grant=grant)

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[int]:
        """Advance time: start, drop silent nodes, stop on the deadline, open/close rounds.

        Returns the indices of the nodes dropped by this call.
        """
        dropped = []
        # The pass over every node runs at most every DROP_SCAN seconds (it is O(N), and tick
        # runs on every call): a silent node is dropped at most DROP_SCAN after its timeout.
        scan = now >= self._scan_at or now < self._scan_at - DROP_SCAN
        if scan:
            self._scan_at = now + DROP_SCAN
        live = self.live_nodes if scan else []
        if scan and not self.schedule.rounds:  # no rounds to take the speeds at: every scan
            self._take_speeds(live)
        for node in live:
            if now - node.last_seen > self.node_timeout:
                node.alive, node.dropped_at = False, now
                node.spare += node.outstanding  # forfeited, but it may still step on them
                node.outstanding = 0
                dropped.append(node.index)
                log.warning("node %d dropped: silent for %.1f s (node_timeout %g s)",
                            node.index, now - node.last_seen, self.node_timeout)
        if not self.started and now >= self.join_deadline and self.live_count:
            self.started = True
            log.warning("starting with %d of %d nodes after the join timeout",
                        self.live_count, self.num_groups)
        if self.deadline is not None and now >= self.deadline and self.stop_reason is None:
            self._stop("time budget reached", now)
        self._forfeit_after_stop(now)
        self._maybe_open_round(now)
        self._maybe_close_round(now)
        return dropped

    def _stop(self, reason: str, now: float | None = None) -> None:
        """Grant nothing more; the final round opens once granted credits are used, or
        ``round_timeout`` after the stop (``_forfeit_after_stop``)."""
        self.stop_reason = reason
        self.stop_reason_at = now
        if self.round is None or self.round.kind != RoundKind.FINAL:
            self.target = min(self.target, self.done + self.outstanding)
            self.target_kind = RoundKind.FINAL
        log.info("stopping: %s (counter %d)", reason, self.done)

    def _forfeit_after_stop(self, now: float) -> None:
        """A stopped job waits at most ``round_timeout`` for the credits nodes still hold: then
        they are forfeited (steps on them count as late) and the final round opens."""
        if self.stop_reason is None or self.target_kind != RoundKind.FINAL or self.finishing:
            return
        if self.stop_reason_at is None:
            self.stop_reason_at = now
        held = {n.index: n.outstanding for n in self.nodes.values() if n.alive and n.outstanding}
        if not held or now - self.stop_reason_at < self.round_timeout:
            return
        log.warning("stopping: credits still held %g s after the stop (node: credits %s); the "
                    "final round opens without them (steps on them count as late)",
                    self.round_timeout, held)
        for node in self.nodes.values():
            if node.alive:
                node.spare += node.outstanding
                node.outstanding = 0
        self.target = min(self.target, self.done)

    @property
    def finishing(self) -> bool:
        """The final round has opened."""
        return self.round is not None and self.round.kind == RoundKind.FINAL

    def _maybe_open_round(self, now: float) -> None:
        if not self.started or self.done < self.target or self.stopped is not None:
            return
        if self.round is not None and (self.round.kind == RoundKind.FINAL or not self.round.closed):
            return
        if self.target_kind == RoundKind.FINAL and self.stop_reason is None:
            self.stop_reason = "iteration budget reached"
        self.rounds_opened += 1
        live = self.live_nodes
        if self.round is not None:
            self.earlier[self.round.id] = self.round
            for old in [i for i in self.earlier if i <= self.round.id - EARLIER_KEPT]:
                del self.earlier[old]
        self.round = RoundState(self.rounds_opened, self.target_kind, self.target, now,
                                expected={n.index for n in live})
        self._take_speeds(live)
        if self.target_kind == RoundKind.GLOBAL:
            self.round.evaluate, self.next_eval = _due(self.target, self.eval_every, self.next_eval)
            self.round.checkpoint, self.next_checkpoint = _due(self.target, self.checkpoint_every,
                                                               self.next_checkpoint)
        log.debug("round %d (%s) at %d", self.round.id, self.round.kind.name, self.target)
        if self.target_kind == RoundKind.FINAL:
            self._grant_last_steps()
        if self.target_kind != RoundKind.FINAL:
            self.period_start = self.target
            self.target, self.target_kind = self.schedule.next_event(self.target)
            if self.stop_reason is not None:
                self.target, self.target_kind = self.done, RoundKind.FINAL
        if self.round.kind == RoundKind.LOCAL:
            # Local rounds have no cross-node barrier: each node runs its own.
            self.round.closed = True

    def _take_speeds(self, live: list[NodeState]) -> None:
        """The live nodes' speeds, summed for shares of the next period: only once every live
        node's speed is known (``shares.py``)."""
        speeds = [shares.rate(*n.timed) for n in live]
        self.rate_sum = sum(speeds) if speeds and all(v > 0 for v in speeds) else 0.0
        # The nodes it was taken over: once one joins, leaves or is dropped, it no longer sizes
        # shares (half shares until the next round takes the speeds again).
        self._rate_of = self.nodes.changes

    def _grant_last_steps(self) -> None:
        """The job ends: each worker may take one step past its last credit (the update its
        loop makes before ``step()`` answers False, counted like any other), reported late."""
        for node in self.live_nodes:
            node.spare += node.workers

    def _maybe_close_round(self, now: float) -> None:
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        pending = rnd.pending
        while pending:  # drop the front while it is done: it cannot be waited for again
            i = next(iter(pending))
            node = self.nodes[i]
            if i not in rnd.reports and node.alive and not node.left:
                break
            pending.discard(i)
        if pending and now - rnd.opened_at < self.round_timeout:
            return
        waiting = {i for i in pending
                   if i not in rnd.reports and self.nodes[i].alive and not self.nodes[i].left}
        if waiting:
            log.warning("round %d closed without node(s) %s after %g s", rnd.id, sorted(waiting),
                        self.round_timeout)
        rnd.closed = True
        rnd.leader = elect(c for c, _ in rnd.reports.values() if c is not None)
        if rnd.leader is not None:
            rnd.leader_node = next(i for i, (c, _) in rnd.reports.items() if c == rnd.leader)
            self.last_leader = rnd

    # ------------------------------------------------------------------ rounds
    def report(self, index: int, session: int, round_id: int, best: Candidate | None,
               participants: int, now: float) -> RoundOutcome:
        """A node's part of round ``round_id``; call ``outcome`` until ready."""
        node = self._node(index, session, now)
        rnd = self.round
        if rnd is None or round_id != rnd.id:
            if rnd is not None and 0 < round_id < rnd.id:
                return RoundOutcome(ready=True, missed=True)
            raise CoordinatorError("INVALID_ARGUMENT", f"round {round_id} is not open")
        if best is not None and best.worker_id // self.workers != index:
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"worker {best.worker_id} does not belong to node {index}")
        if participants > node.workers or participants < 0:
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"{participants} participants but node {index} has "
                                   f"{node.workers} workers")
        node.last_round_seen = max(node.last_round_seen, round_id)
        if rnd.kind == RoundKind.LOCAL:
            return RoundOutcome(ready=True, leader=best, leader_node=index if best else None,
                                participants=participants, nodes=(index,))
        if rnd.closed:
            return RoundOutcome(ready=True, missed=True)
        if index in rnd.reports:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"node {index} already reported round {round_id}")
        rnd.reports[index] = (best, participants)
        self._maybe_close_round(now)
        return self.outcome(index, round_id)

    def outcome(self, index: int, round_id: int) -> RoundOutcome:
        """The result of a global/final round once it has closed (also after a newer round
        opened: a node that reported this one in time was not late)."""
        rnd = self.round
        if rnd is not None and rnd.id != round_id:
            rnd = self.earlier.get(round_id)
            if rnd is not None and not rnd.closed:  # replaced open: it never will close
                rnd = None
        if rnd is None or index not in rnd.reports:
            return RoundOutcome(ready=True, missed=True)
        if not rnd.closed:
            return RoundOutcome(ready=False)
        if rnd.outcome is None:  # made once per round: its reports and leader are final
            rnd.outcome = RoundOutcome(ready=True, leader=rnd.leader, leader_node=rnd.leader_node,
                                       participants=sum(p for _, p in rnd.reports.values()),
                                       nodes=tuple(sorted(rnd.reports)), evaluate=rnd.evaluate,
                                       checkpoint=rnd.checkpoint)
        return rnd.outcome

    # ------------------------------------------------------------------ persistence
    def state(self, now: float) -> dict:
        """What a restarted server needs to go on (JSON-able). Rounds in flight are not kept."""
        return {
            "job_id": self.job_id, **self.rounds_state(),
            "elapsed": now - self.started_at,
            "nodes": {str(i): {"session": n.session, "workers": n.workers, "consumed": n.consumed,
                               "left": n.left, "alive": n.alive, "last_seq": n.last_seq,
                               "spare": n.spare}
                      for i, n in self.nodes.items()},
        }

    def rounds_state(self) -> dict:
        """The part of ``state`` that a round opening or a stop changes (journaled)."""
        return {"done": self.done, "rounds_opened": self.rounds_opened, "target": self.target,
                "target_kind": int(self.target_kind), "period_start": self.period_start,
                "next_eval": self.next_eval, "next_checkpoint": self.next_checkpoint,
                "stop_reason": self.stop_reason, "started": self.started,
                "stopped": self.stopped}

    def restore(self, state: dict, now: float, membership: bool = True) -> None:
        """Go on from ``state()``: every node that was alive gets ``node_timeout`` to reattach.

        ``membership=False`` (resuming a stopped job from a checkpoint): counter and rounds go
        on, and the nodes join afresh.
        """
        if state.get("job_id") != self.job_id:
            raise ValueError(f"saved state is of job '{state.get('job_id')}', not '{self.job_id}'")
        self.done, self.rounds_opened = int(state["done"]), int(state["rounds_opened"])
        self.target, self.target_kind = int(state["target"]), RoundKind(state["target_kind"])
        self.period_start, self.next_eval = int(state["period_start"]), int(state["next_eval"])
        self.next_checkpoint = int(state.get("next_checkpoint", self.next_checkpoint))
        self.stop_reason, self.started = state["stop_reason"], bool(state["started"])
        self.started_at = now - float(state["elapsed"])
        if self.deadline is not None:
            self.deadline = self.started_at + (self.deadline - now)
        self.round = None
        self.earlier = {}
        if not membership:
            self.started = False  # it starts again once the nodes have joined
            return
        for key, n in state["nodes"].items():
            self.nodes[int(key)] = NodeState(int(key), int(n["session"]), int(n["workers"]),
                                             joined_at=now, last_seen=now, consumed=int(n["consumed"]),
                                             last_round_seen=self.rounds_opened,
                                             alive=bool(n["alive"]), left=bool(n["left"]),
                                             last_seq=int(n.get("last_seq", 0)),
                                             spare=int(n.get("spare", 0)), needs_resume=True)
        if state.get("stopped"):  # the job had been stopped: a restarted server ends it too
            self.halt(str(state["stopped"]), now)

    def missing_nodes(self) -> list[int]:
        """Nodes of the job that are not taking part now: never joined, dropped or left."""
        if self.live_count == self.num_groups:  # the usual answer, without a pass over N nodes
            return []
        live = {n.index for n in self.live_nodes}
        return [i for i in range(self.num_groups) if i not in live]

    def snapshot(self) -> dict:
        """A JSON-able summary of the state (for logs and the run summary)."""
        return {
            "counter": self.done,
            "rounds": self.rounds_opened,
            "stop_reason": self.stop_reason,
            # not ``last_grant`` (the answer kept for a retry): it holds a round with every
            # node's report, which made the summary grow with the square of the nodes
            "nodes": {i: dataclasses.asdict(dataclasses.replace(n, last_grant=None))
                      | {"session": None} for i, n in self.nodes.items()},
        }
