"""gRPC servicer of the global server: protobuf <-> ``Coordinator`` / ``ParamStore``.

It holds the coordinator's lock, turns ``CoordinatorError``/``ParamError`` into gRPC status
codes, and implements the long-polls (credits, round barriers, downloads) with bounded waits on
one condition variable that every state change notifies.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from typing import Callable, Iterator

import grpc

from ..proto import lsgd_pb2 as pb
from ..proto import lsgd_pb2_grpc as pb_grpc
from ..rules.base import Exchange as ExchangeKind, RoundKind
from . import session
from .coordinator import Coordinator, CoordinatorError
from .digests import WAIT as DIGEST_WAIT
from .params import ParamError, ParamStore
from .polls import CreditPoll, RoundBarrier
from .records import RoundState
from .routes import Routes
from .rpcstats import RpcStats
from .status import StatusBoard
from .transfers import TransferRPCs, _abort

log = logging.getLogger(__name__)



class CallCounter(grpc.ServerInterceptor):
    """Counts calls per RPC method (reported in the run summary and by the benchmarks)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001 - grpc API
        self.add(handler_call_details.method.rsplit("/", 1)[-1])
        return continuation(handler_call_details)

    def add(self, method: str) -> None:
        """Count one call (a call on a ``Session`` stream counts under its own method)."""
        with self._lock:
            self.counts[method] += 1


class GlobalServicer(TransferRPCs, pb_grpc.GlobalServerServicer):
    """Implements ``lsgd.v1.GlobalServer``."""

    def __init__(self, coordinator: Coordinator, params: ParamStore, round_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.coord = coordinator
        self.params = params
        self.epoch = secrets.randbits(63) | 1  # new in every server process
        self.checkpoint_due: tuple[int, dict] | None = None  # (round, state) to save
        self.checkpoint_since = 0.0
        self.round_timeout = round_timeout
        self.clock = clock
        lock = threading.RLock()
        self.cond = threading.Condition(lock)  # state changes: AcquireCredits long-polls wait here
        self.closed = threading.Condition(lock)  # a global/final round closed: ReportRound waits
        self._exchanged = 0  # newest round whose parameter exchange was started
        self.calls = CallCounter()
        self.admission = None  # the server's Admission (caps on streams and polls), once serving
        # What the status page shows (lsgd/status/http.py reads it under the lock), failed
        # calls and bytes moved (/metrics), and the gRPC health service once serving.
        self.board = StatusBoard(coordinator.num_groups, coordinator.workers,
                                 coordinator.started_at, exchange=params.rule.exchange.value)
        self.stats = RpcStats()
        self.health: Callable[[bool], None] | None = None  # set_serving(False) when the job is over
        self.drop_grace = 130.0  # see node_health (build_servicer: RECONNECT_TIMEOUT + 10 s)
        self._over = False  # the job finished or was stopped (updated on every change)
        self._told_health = False
        self._board_failed = False
        # Called (lock held) with the state and whether membership changed, whenever a round
        # opens, the stop target moves or a node joins, before any node can learn of it
        # (journal.py writes it), so a restarted server never issues a round id twice.
        self.journal: Callable[[dict, bool], None] | None = None
        self._journaled: tuple = (None, None)
        self.dumps = 0  # numbers every state taken: a restart goes on from the newest
        self.routes = Routes()  # PLANE=chain: data addresses and the leader's route (routes.py)
        self.digest_wait = DIGEST_WAIT  # seconds a member's Digest question waits for the source
        # The asyncio Session server's news: called (lock held) whenever polls should wake.
        self.on_news: Callable[[bool], None] | None = None
        self.session_port = 0  # where nodes open their Session streams (0: this server's port)
        self.bulk_port = 0  # where nodes move parameter vectors (0: on gRPC only; bulk.py)
        self.bulk_server = None  # its BulkServer (bulk.py), for its counts
        self._round_answer: tuple[tuple, pb.AcquireCreditsResponse] | None = None

    def state_dump(self) -> dict:
        """The coordinator's state, numbered (lock held)."""
        self.dumps += 1
        return self.coord.state(self.clock()) | {"dump": self.dumps}

    def node_health(self, index: int) -> bool | None:
        """The liveness probe's answer for node ``index`` (``probes.py``): None if it never
        joined; False once it was dropped and has not joined again within ``drop_grace``
        seconds (a node cut off by a partition has RECONNECT_TIMEOUT to reattach, then exits
        by itself: one whose container still runs after that is stuck); True otherwise."""
        with self.cond:
            node = self.coord.nodes.get(index)
            if node is None:
                return None
            return node.alive or node.left or self.clock() - node.dropped_at <= self.drop_grace

    # ------------------------------------------------------------------ shared
    def tick(self) -> None:
        """Advance time; called by the server's ticker thread and on every request."""
        with self.cond:
            self._change(lambda: self.coord.tick(self.clock()))
        self.params.poll()
        if self._over and not self._told_health and self.health is not None:
            self._told_health = True  # outside the lock: the health service answers watchers
            self.health(False)

    def _after_change(self) -> None:
        """Start the parameter exchange of a newly closed global/final round (lock held)."""
        rnd = self.coord.round
        if rnd is None or not rnd.closed or rnd.id <= self._exchanged or rnd.kind == RoundKind.LOCAL:
            return
        if self.coord.stopped is not None:  # a round closed by a job stop exchanges nothing
            return
        self._exchanged = rnd.id
        if rnd.checkpoint:
            self.checkpoint_due = (rnd.id, self.coord.state(self.clock()))
            self.checkpoint_since = self.clock()
        reports = {i: p for i, (_, p) in rnd.reports.items()}
        route = None
        if rnd.kind == RoundKind.GLOBAL and self.params.rule.exchange == ExchangeKind.LEADER:
            route = self.routes.plan(rnd.id, [n for n, p in reports.items() if p > 0],
                                     rnd.leader_node)
        elif rnd.kind == RoundKind.GLOBAL and self.params.rule.synchronous:
            route = self.routes.plan_sums(rnd.id, reports)
        else:
            self.routes.current = self.routes.center = None
        leader_route = route is not None and not route.reduce
        self.params.begin(rnd.id, rnd.kind, rnd.leader_node, reports, self.round_timeout,
                          average=rnd.evaluate,
                          leader_uploader=route.feeds_server if leader_route else None,
                          reduce=route if route is not None and route.reduce else None)
        self._wake(closed=True)  # after begin: the barriers' answers find the exchange open

    def _change(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the state (lock held); wake the long-polls only if it changed something.

        A pass that changes nothing wakes nobody, so waiting polls cannot wake each other in a
        loop (with 63 idle pollers that loop cost a whole core).
        """
        before = self._state()
        result = fn()
        self._after_change()
        self._observe()
        after = self._state()
        if after[0] > before[0] or after[1:] != before[1:]:  # more free credits, or news
            # a round closed or opened, or a stop: round barriers may be over
            self._wake(closed=after[1:3] != before[1:3] or after[5:] != before[5:])
        if self.journal is not None:
            c = self.coord
            key = ((c.rounds_opened, c.target, c.stop_reason), c.nodes.version)
            if key != self._journaled:
                members = key[1] != self._journaled[1]
                if members:
                    self.journal(self.state_dump(), True)
                else:
                    self.dumps += 1
                    self.journal(c.rounds_state() | {"dump": self.dumps}, False)
                self._journaled = key
        return result

    def _wake(self, closed: bool) -> None:
        """Wake the credit polls, and the round barriers too where ``closed`` (lock held): the
        threads waiting on ``cond`` / ``closed``, and the asyncio server's (``on_news``)."""
        self.cond.notify_all()
        if closed:
            self.closed.notify_all()
        hook = self.on_news  # read once: the session server may drop it meanwhile
        if hook is not None:
            hook(closed)

    def _observe(self) -> None:
        """Show the change on the status board (lock held). A fault of the board is logged
        once and never fails the call: the status page must not cost the job."""
        try:
            self.board.observe(self.coord, self.clock())
        except Exception:  # noqa: BLE001 - see the docstring
            if not self._board_failed:
                self._board_failed = True
                log.exception("status board: recording a change failed (logged once; the job "
                              "goes on)")
        self._over = self.coord.finished or self.coord.stopped is not None

    def _state(self) -> tuple:
        """What a long-poll can be waiting for: a pass that leaves it unchanged wakes nobody.

        Free credits first, not the counter: a node's report of steps it took on its credits
        moves them from held to done and frees none, and a grant only takes free credits, so
        the most frequent calls wake no poll (``_change`` wakes them when free credits grow or
        anything else here changes; every poll that wakes runs a credit request of its own).
        """
        c = self.coord
        return (c.target - c.done - c.outstanding, c.rounds_opened,
                c.round.closed if c.round else None, c.live_count, c.started, c.stop_reason,
                c.stopped)

    def _note_weight(self, request: pb.ReportRoundRequest) -> None:
        """Keep the weight of a node's sum for the open global round's reduce: only from a
        member's first, valid report of that round (anything else is left to
        ``Coordinator.report`` to refuse or answer, and notes nothing)."""
        node = request.node
        member = self.coord._node(node.node_index, node.session, self.clock())
        rnd = self.coord.round
        if (rnd is None or rnd.id != request.round_id or rnd.closed or rnd.kind != RoundKind.GLOBAL
                or node.node_index in rnd.reports
                or not 0 < request.participants <= member.workers):
            return
        self.routes.note_weight(node.node_index, request.round_id, request.participants,
                                request.weight)

    def _check(self, node: pb.NodeId) -> None:
        if node.job_id != self.coord.job_id:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"message for job '{node.job_id}', this server runs "
                                   f"'{self.coord.job_id}'")

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], object]) -> object:
        try:
            with self.cond:
                return self._change(fn)
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)

    def _look(self, context: grpc.ServicerContext, fn: Callable[[], object]) -> object:
        """``_call`` for checks that change nothing but when a node was last heard of
        (``Coordinator.heartbeat``): no state to compare, no poll to wake, nothing to journal
        (at 512 nodes, each of a round's 511 downloads of the leader makes one)."""
        try:
            with self.cond:
                return fn()
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)

    # ------------------------------------------------------------------ RPCs
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        def join() -> pb.JoinResponse:
            self._check(request.node)
            if request.param_count < 1:
                raise ParamError("INVALID_ARGUMENT", "param_count must be >= 1")
            self.coord.check_join(job_id=request.node.job_id, index=request.node.node_index,
                                  workers=request.num_workers, algorithm=request.algorithm,
                                  num_groups=request.num_groups)
            if self.params.param_count is None and request.node.node_index != 0:
                # Node 0 decides the model size; this node's client retries UNAVAILABLE.
                raise CoordinatorError("UNAVAILABLE", "waiting for node 0 to join (it decides "
                                       "the model size)")
            buffers = self.params.reserve(request.param_count)  # refused before any change
            if request.data_address:
                self.routes.note_join(request.node.node_index, request.data_address,
                                      context.peer())
            node = self.coord.join(
                job_id=request.node.job_id, index=request.node.node_index,
                workers=request.num_workers, algorithm=request.algorithm,
                num_groups=request.num_groups, now=self.clock(),
                resume_session=request.resume_session, held=request.held_credits,
                unreported=request.unreported, seq=request.seq,
                unanswered_seq=request.unanswered_seq, unanswered_steps=request.unanswered_steps,
                replaces_session=request.replaces_session)
            self.params.install(request.param_count, buffers)
            self.routes.count = request.param_count  # what reserve() accepted: the model's size
            self.routes.joined(node.index, request.data_address)
            # Every node offers its initial parameters until one upload has succeeded.
            return pb.JoinResponse(session=node.session, seed_center=not self.params.center_ready,
                                   counter=self.coord.done, epoch=self.epoch,
                                   round_id=node.last_round_seen,
                                   session_port=self.session_port,
                                   bulk_port=self.bulk_port)

        return self._call(context, join)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        def beat() -> pb.HeartbeatResponse:
            node = request.node
            self._check(node)
            report = (self.board.parse(node.node_index, request.report, self.coord.rounds_opened)
                      if request.HasField("report") else None)  # checked before any change
            self.coord.heartbeat(node.node_index, node.session, self.clock())
            resp = self._heartbeat_answer(node.node_index)
            if report is not None:
                resp.evaluations_held = self.board.store(node.node_index, node.session, report,
                                                         self.clock())
            else:
                resp.evaluations_held = self.board.evaluations_held(node.node_index, node.session)
            return resp

        return self._call(context, beat)

    def round_answer(self, rnd: RoundState) -> pb.AcquireCreditsResponse:
        """The answer to a credit poll whose news is round ``rnd`` (``Coordinator.round_news``;
        lock held): made once for every node it wakes, and never changed once made."""
        key = (rnd.id, self.coord.done)
        if self._round_answer is None or self._round_answer[0] != key:
            resp = pb.AcquireCreditsResponse(counter=self.coord.done, epoch=self.epoch)
            resp.round.id, resp.round.kind = rnd.id, int(rnd.kind)
            resp.round.iteration = rnd.iteration
            self._round_answer = (key, resp)
        return self._round_answer[1]

    def _heartbeat_answer(self, index: int) -> pb.HeartbeatResponse:
        """The counter, the stop, and what a node's progress line shows (caller holds the lock)."""
        coord = self.coord
        resp = pb.HeartbeatResponse(counter=coord.done, epoch=self.epoch,
                                    stopped=coord.stopped_for(index),
                                    nodes_alive=coord.live_count,
                                    nodes_missing=coord.missing_nodes()[:64],
                                    job_started=coord.started, rounds=coord.rounds_opened,
                                    aborted_reduce=self.routes.aborted_round)
        best = coord.last_leader
        if best is not None and best.leader is not None:
            resp.has_leader = True
            resp.leader.worker_id, resp.leader.loss = best.leader.worker_id, best.leader.loss
            resp.leader_node = best.leader_node or 0
        return resp

    def AcquireCredits(self, request: pb.AcquireCreditsRequest,
                       context: grpc.ServicerContext) -> pb.AcquireCreditsResponse:
        poll = CreditPoll(self, request)
        try:
            with self.cond:
                while (resp := poll.step(context.is_active())) is None:
                    # Woken by a change that can end the wait (``_state``: free credits, a
                    # round, the start, a stop); time-driven ones come from the server's ticker.
                    self.cond.wait(poll.wait())
                return resp
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)

    def ReportRound(self, request: pb.ReportRoundRequest,
                    context: grpc.ServicerContext) -> pb.ReportRoundResponse:
        barrier = RoundBarrier(self, request)
        try:
            with self.cond:
                resp = barrier.step(context.is_active())
                while resp is None:
                    # Woken when a round closes or opens, or the job stops (``_wake``); at 512
                    # nodes a tick every 0.1 s per waiting node was 5 000 wake-ups a second.
                    timed_out = not self.closed.wait(barrier.wait())
                    resp = barrier.step(context.is_active(), timed_out)
                return resp
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)

    def Session(self, request_iterator: Iterator[pb.SessionRequest],
                context: grpc.ServicerContext) -> Iterator[pb.SessionReply]:
        yield from session.serve(self, request_iterator, context)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        def leave() -> pb.LeaveResponse:
            self._check(request.node)
            if request.stop_job:  # node 0 stops the whole job (interrupted, failed)
                self.coord.stop_job(request.node.node_index, request.node.session,
                                    request.stop_job, request.consumed, request.late_consumed,
                                    self.clock())
                self.params.abort(self.coord.stopped or "job stopped")
            else:
                self.coord.leave(request.node.node_index, request.node.session, request.consumed,
                                 request.late_consumed, self.clock())
            return pb.LeaveResponse(counter=self.coord.done)

        return self._call(context, leave)

    def halt(self, reason: str) -> bool:
        """The global server itself was told to stop (SIGTERM) before the job ended: stop the
        job as node 0 would, so that the nodes are told. False if there is nothing to stop."""
        with self.cond:
            if not self._change(lambda: self.coord.live_nodes and self.coord.halt(
                    f"job stopped: the global server was {reason}", self.clock())):
                return False
        self.params.abort(reason)
        return True
