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

Stopping the job (node 0 interrupted or failed): ``stopping.JobStop``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field

from ..leader import Candidate, elect
from ..rules.base import RoundKind
from . import claims
from .stopping import JobStop

log = logging.getLogger(__name__)


class CoordinatorError(Exception):
    """A request the coordinator refuses; ``code`` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "INVALID_ARGUMENT" | "FAILED_PRECONDITION" | "NOT_FOUND"


@dataclass(frozen=True)
class Schedule:
    """Where the rounds fall on the global counter, and the iteration budget."""

    local_period: int | None  # None: no local rounds
    global_period: int
    max_iterations: int | None

    @classmethod
    def for_job(cls, *, num_groups: int, workers: int, l_comm: int, g_comm: int,
                local_rounds: bool, max_iterations: int | None) -> "Schedule":
        n = num_groups * workers
        return cls(n * l_comm if local_rounds else None, n * g_comm, max_iterations)

    @property
    def period(self) -> int:
        """The most iterations between two rounds: no node can hold more credits."""
        return self.local_period or self.global_period

    @property
    def detached_steps(self) -> int:
        """Steps a node cut off from the server may take on credits of its own, per detachment
        (one global period; the node keeps the same rule)."""
        return self.global_period

    def next_event(self, after: int) -> tuple[int, RoundKind]:
        """The first boundary strictly after ``after`` and the kind of round it triggers."""
        candidates = [((after // self.global_period) + 1) * self.global_period]
        if self.local_period:
            candidates.append(((after // self.local_period) + 1) * self.local_period)
        target = min(candidates)
        kind = RoundKind.GLOBAL if target % self.global_period == 0 else RoundKind.LOCAL
        if self.max_iterations is not None and target >= self.max_iterations:
            return self.max_iterations, RoundKind.FINAL
        return target, kind


@dataclass
class NodeState:
    index: int
    session: int
    workers: int
    joined_at: float
    last_seen: float
    outstanding: int = 0
    last_round_seen: int = 0
    alive: bool = True
    left: bool = False
    consumed: int = 0  # total steps this node reported
    spare: int = 0  # credits no longer outstanding that it may still step on (claims.py)
    last_seq: int = 0  # newest numbered credit request
    last_grant: "Grant | None" = None  # the answer to it (given again to a retry)
    needs_resume: bool = False  # restored from saved state: must reattach (Join) first


@dataclass
class RoundState:
    id: int
    kind: RoundKind
    iteration: int
    opened_at: float
    expected: set[int]
    reports: dict[int, tuple[Candidate | None, int]] = field(default_factory=dict)
    closed: bool = False
    leader: Candidate | None = None
    leader_node: int | None = None
    evaluate: bool = False  # nodes upload their sums so that node 0 can evaluate the average
    checkpoint: bool = False  # every node (and the server) saves a checkpoint at this round


@dataclass(frozen=True)
class Grant:
    """Answer to a credit request."""

    grant: int = 0
    round: RoundState | None = None  # run this round before training on
    wait: bool = False  # nothing to give yet: ask again (the servicer long-polls)


@dataclass(frozen=True)
class RoundOutcome:
    """Answer to a round report."""

    ready: bool  # False: the round is still open, wait
    missed: bool = False
    leader: Candidate | None = None
    leader_node: int | None = None
    participants: int = 0
    nodes: tuple[int, ...] = ()
    evaluate: bool = False
    checkpoint: bool = False


def _due(target: int, every: int, next_at: int) -> tuple[bool, int]:
    """Whether a global round at ``target`` is the first at or past ``next_at`` (an evaluation
    or checkpoint round, every ``every`` iterations; 0: never), and the next such counter."""
    if not every or target < next_at:
        return False, next_at
    return True, (target // every + 1) * every


class Coordinator(JobStop):
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
        self.nodes: dict[int, NodeState] = {}
        self.done = 0
        self.started = False
        self.stop_reason: str | None = None
        self.period_start = 0
        self.target, self.target_kind = schedule.next_event(0)
        self.round: RoundState | None = None  # newest round
        self.rounds_opened = 0
        self.eval_every = eval_every
        self.next_eval = eval_every  # counter value from which the next global round evaluates
        self.checkpoint_every = checkpoint_every
        self.next_checkpoint = checkpoint_every
        self.stop_reason_at: float | None = None  # when stop_reason was set (budget, MINUTES)
        self.stopped: str | None = None  # the job was stopped (stop_job), for this reason
        self.stopped_at = 0.0
        self.told: set[int] = set()  # nodes that have been answered with ``stopped``

    # ------------------------------------------------------------------ helpers
    @property
    def outstanding(self) -> int:
        return sum(n.outstanding for n in self.nodes.values() if n.alive)

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
        return bool(self.nodes) and not self.live_nodes

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
                                   "silence; restart it with train.sh to rejoin")
        node.last_seen = now
        return node

    # ------------------------------------------------------------------ membership
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
                raise CoordinatorError("FAILED_PRECONDITION",
                                       f"node {index} is already in the job; each node index runs once")
            if self.round is None or self.round.kind != RoundKind.FINAL:
                self._replace(old, now)
        if self.round is not None and self.round.kind == RoundKind.FINAL:
            raise CoordinatorError("FAILED_PRECONDITION", "the job is finishing; no node can join")
        session = self.rng.getrandbits(63) | 1
        node = NodeState(index, session, workers, joined_at=now, last_seen=now,
                         last_round_seen=self._round_seen_on_join(index),
                         consumed=old.consumed if old is not None else 0)  # the index's total
        self.nodes[index] = node
        if len(self.live_nodes) == self.num_groups:
            self.started = True
        log.info("node %d joined (%d/%d live)", index, len(self.live_nodes), self.num_groups)
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
            raise CoordinatorError("FAILED_PRECONDITION", self.stopped)
        if algorithm != self.algorithm or num_groups != self.num_groups or workers != self.workers:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"node {index} runs algorithm={algorithm} num_groups={num_groups} workers={workers} "
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
            return rnd.id - 1
        return rnd.id

    def heartbeat(self, index: int, session: int, now: float) -> None:
        self._node(index, session, now)

    def leave(self, index: int, session: int, consumed: int, late: int, now: float) -> None:
        node = self._node(index, session, now)
        self._consume(node, consumed, late, 0)
        node.left = True
        node.outstanding = 0
        log.info("node %d left; counter %d", index, self.done)
        self._maybe_close_round(now)

    # ------------------------------------------------------------------ credits
    def _consume(self, node: NodeState, consumed: int, late: int, released: int) -> None:
        try:
            node.outstanding, node.spare = claims.settle(node.index, node.outstanding, node.spare,
                                                         consumed, late, released)
        except claims.ClaimError as exc:
            raise CoordinatorError("INVALID_ARGUMENT", str(exc)) from None
        node.consumed += consumed + late
        self.done += consumed + late

    def acquire(self, index: int, session: int, *, consumed: int, late: int, released: int,
                want: int, last_round_seen: int, now: float, seq: int = 0) -> Grant:
        """Report consumed steps and ask for ``want`` more credits.

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
        grant = self._acquire(node, consumed=consumed, late=late, released=released, want=want,
                              last_round_seen=last_round_seen, now=now)
        if seq:
            node.last_seq = seq
        node.last_grant = grant  # also the later passes of a long-poll: the answer sent last
        return grant

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
            return Grant(round=rnd)
        if self.finished or (rnd is not None and rnd.kind == RoundKind.FINAL):
            return Grant(wait=False)
        if not self.started or want <= 0:
            return Grant(wait=want > 0)
        free = self.target - self.done - self.outstanding
        if free <= 0:
            return Grant(wait=True)
        # Half a fair share of the period per request: a fast node comes back for more of what
        # is left, so nodes of different speeds share a period without revoking credits.
        live = max(1, len(self.live_nodes))
        grant = min(want, free, max(1, math.ceil((self.target - self.period_start) / (2 * live))))
        node.outstanding += grant
        return Grant(grant=grant)

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[int]:
        """Advance time: start, drop silent nodes, stop on the deadline, open/close rounds.

        Returns the indices of the nodes dropped by this call.
        """
        dropped = []
        for node in self.live_nodes:
            if now - node.last_seen > self.node_timeout:
                node.alive = False
                node.spare += node.outstanding  # forfeited, but it may still step on them
                node.outstanding = 0
                dropped.append(node.index)
                log.warning("node %d dropped: silent for %.1f s (node_timeout %g s)",
                            node.index, now - node.last_seen, self.node_timeout)
        if not self.started and now >= self.join_deadline and self.live_nodes:
            self.started = True
            log.warning("starting with %d of %d nodes after the join timeout",
                        len(self.live_nodes), self.num_groups)
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
        self.round = RoundState(self.rounds_opened, self.target_kind, self.target, now,
                                expected={n.index for n in self.live_nodes})
        if self.target_kind == RoundKind.GLOBAL:
            self.round.evaluate, self.next_eval = _due(self.target, self.eval_every, self.next_eval)
            self.round.checkpoint, self.next_checkpoint = _due(self.target, self.checkpoint_every,
                                                               self.next_checkpoint)
        log.debug("round %d (%s) at %d", self.round.id, self.round.kind.name, self.target)
        if self.target_kind != RoundKind.FINAL:
            self.period_start = self.target
            self.target, self.target_kind = self.schedule.next_event(self.target)
            if self.stop_reason is not None:
                self.target, self.target_kind = self.done, RoundKind.FINAL
        if self.round.kind == RoundKind.LOCAL:
            # Local rounds have no cross-node barrier: each node runs its own.
            self.round.closed = True

    def _maybe_close_round(self, now: float) -> None:
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        waiting = {i for i in rnd.expected - set(rnd.reports)
                   if self.nodes[i].alive and not self.nodes[i].left}
        if waiting and now - rnd.opened_at < self.round_timeout:
            return
        if waiting:
            log.warning("round %d closed without node(s) %s after %g s", rnd.id, sorted(waiting),
                        self.round_timeout)
        rnd.closed = True
        rnd.leader = elect(c for c, _ in rnd.reports.values() if c is not None)
        if rnd.leader is not None:
            rnd.leader_node = next(i for i, (c, _) in rnd.reports.items() if c == rnd.leader)

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
        """The result of a global/final round once it has closed."""
        rnd = self.round
        if rnd is None or rnd.id != round_id or index not in rnd.reports:
            return RoundOutcome(ready=True, missed=True)
        if not rnd.closed:
            return RoundOutcome(ready=False)
        return RoundOutcome(ready=True, leader=rnd.leader, leader_node=rnd.leader_node,
                            participants=sum(p for _, p in rnd.reports.values()),
                            nodes=tuple(sorted(rnd.reports)), evaluate=rnd.evaluate,
                            checkpoint=rnd.checkpoint)

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
                "stop_reason": self.stop_reason, "started": self.started}

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

    def snapshot(self) -> dict:
        """A JSON-able summary of the state (for logs and the run summary)."""
        return {
            "counter": self.done,
            "rounds": self.rounds_opened,
            "stop_reason": self.stop_reason,
            "nodes": {i: dataclasses.asdict(n) | {"session": None} for i, n in self.nodes.items()},
        }
