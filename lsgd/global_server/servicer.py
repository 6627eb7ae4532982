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
from dataclasses import replace
from typing import Callable, Iterator

import grpc

from ..leader import Candidate
from ..proto import lsgd_pb2 as pb
from ..proto import lsgd_pb2_grpc as pb_grpc
from ..rules.base import Exchange as ExchangeKind, RoundKind
from . import session
from .coordinator import Coordinator, CoordinatorError
from .buffers import DELTA, MAIL
from .digests import SIZE as DIGEST_SIZE, WAIT as DIGEST_WAIT
from .params import AVERAGE, CENTER, LEADER, SUM, ParamError, ParamStore, _wire_dtype
from .routes import Routes
from .rpcstats import RpcStats
from .status import StatusBoard

log = logging.getLogger(__name__)

BUFFERS = {pb.BUFFER_KIND_GLOBAL_LEADER: LEADER, pb.BUFFER_KIND_CENTER: CENTER,
           pb.BUFFER_KIND_NODE_SUM: SUM, pb.BUFFER_KIND_AVERAGE: AVERAGE,
           pb.BUFFER_KIND_CENTER_DELTA: DELTA, pb.BUFFER_KIND_MAIL: MAIL}
PULLABLE = {LEADER, CENTER, AVERAGE, MAIL}
WIRES = {pb.WIRE_FORMAT_UNSPECIFIED: "float32", pb.WIRE_FORMAT_BFLOAT16: "bfloat16"}
MAX_CREDIT_WAIT = 0.5  # seconds one AcquireCredits call may long-poll
BARRIER_TICK = 1.0  # seconds a round barrier waits for news before it advances time itself
DEFAULT_CHUNK = 1 << 17  # elements per download chunk when the client names none (512 KiB)
MAX_CHUNK = 1 << 20  # 4 MiB of float32: within the 8 MiB message limit


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


def _abort(context: grpc.ServicerContext, exc: CoordinatorError | ParamError) -> None:
    context.abort(getattr(grpc.StatusCode, exc.code), str(exc))


class GlobalServicer(pb_grpc.GlobalServerServicer):
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
        self.closed.notify_all()
        self.cond.notify_all()
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
            self.cond.notify_all()
            if after[1:3] != before[1:3] or after[5:] != before[5:]:  # a round closed or
                self.closed.notify_all()  # opened, or a stop: round barriers may be over
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
            self.routes.joined(node.index, request.data_address)
            # Every node offers its initial parameters until one upload has succeeded.
            return pb.JoinResponse(session=node.session, seed_center=not self.params.center_ready,
                                   counter=self.coord.done, epoch=self.epoch,
                                   round_id=node.last_round_seen)

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

    def _heartbeat_answer(self, index: int) -> pb.HeartbeatResponse:
        """The counter, the stop, and what a node's progress line shows (caller holds the lock)."""
        coord = self.coord
        resp = pb.HeartbeatResponse(counter=coord.done, epoch=self.epoch,
                                    stopped=coord.stopped_for(index),
                                    nodes_alive=coord.live_count,
                                    nodes_missing=coord.missing_nodes()[:64],
                                    job_started=coord.started, rounds=coord.rounds_opened)
        best = coord.last_leader
        if best is not None and best.leader is not None:
            resp.has_leader = True
            resp.leader.worker_id, resp.leader.loss = best.leader.worker_id, best.leader.loss
            resp.leader_node = best.leader_node or 0
        return resp

    def AcquireCredits(self, request: pb.AcquireCreditsRequest,
                       context: grpc.ServicerContext) -> pb.AcquireCreditsResponse:
        node = request.node
        end = self.clock() + min(MAX_CREDIT_WAIT, request.max_wait_ms / 1000.0)
        counts = dict(consumed=request.consumed, late=request.late_consumed,
                      released=request.released, seq=request.seq, used_ms=request.used_ms)
        try:
            with self.cond:
                self._check(node)
                while True:
                    grant = self._change(lambda: self.coord.acquire(
                        node.node_index, node.session, want=request.want,
                        last_round_seen=request.last_round_seen, now=self.clock(), **counts))
                    counts = dict(consumed=0, late=0, released=0, seq=0, used_ms=0)  # once
                    left = end - self.clock()
                    if not grant.wait or left <= 0 or not context.is_active():
                        break
                    # Woken by a change that can end the wait (``_state``: free credits, a
                    # round, the start, a stop); time-driven ones come from the server's ticker.
                    self.cond.wait(left)
                resp = pb.AcquireCreditsResponse(grant=grant.grant, counter=self.coord.done,
                                                 epoch=self.epoch,
                                                 stopped=self.coord.stopped_for(node.node_index))
                if grant.round is not None:
                    resp.round.id = grant.round.id
                    resp.round.kind = int(grant.round.kind)
                    resp.round.iteration = grant.round.iteration
                return resp
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)

    def ReportRound(self, request: pb.ReportRoundRequest,
                    context: grpc.ServicerContext) -> pb.ReportRoundResponse:
        node = request.node
        best = Candidate(request.best.worker_id, request.best.loss) if request.has_best else None
        end = self.clock() + self.round_timeout + 1.0  # the round itself closes by then
        try:
            with self.cond:
                self._check(node)
                if request.weight:  # before the report, which may close the round and plan it
                    self._note_weight(request)
                # if this report closes the round, its waiters wake
                out = self._change(lambda: self.coord.report(
                    node.node_index, node.session, request.round_id, best,
                    request.participants, self.clock()))
                while not out.ready and self.clock() < end and context.is_active():
                    # Woken when a round closes or opens, or the job stops (``_change``); the
                    # server's ticker closes a round at its deadline. The tick here, once a
                    # second at most, is for a servicer without a ticker (tests): at 512 nodes
                    # a tick every 0.1 s per waiting node was 5 000 wake-ups a second.
                    if not self.closed.wait(min(BARRIER_TICK, max(0.0, end - self.clock()))):
                        self._change(lambda: self.coord.tick(self.clock()))
                    out = self.coord.outcome(node.node_index, request.round_id)
                stopped = self.coord.stopped_for(node.node_index)
                route = self.routes.for_node(node.node_index, request.round_id)
        except (CoordinatorError, ParamError) as exc:
            _abort(context, exc)
        if not out.ready:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"round {request.round_id} did not close")
        resp = pb.ReportRoundResponse(missed=out.missed, participants=out.participants,
                                      nodes=list(out.nodes), evaluate=out.evaluate,
                                      checkpoint=out.checkpoint, stopped=stopped)
        if out.leader is not None:
            resp.has_leader = True
            resp.leader.worker_id = out.leader.worker_id
            resp.leader.loss = out.leader.loss
            resp.leader_node = out.leader_node
        if route is not None and not out.missed:
            resp.route.CopyFrom(self.routes.message(route))
        return resp

    def Bypass(self, request: pb.BypassRequest, context: grpc.ServicerContext) -> pb.DataRoute:
        def bypass() -> pb.DataRoute:
            self._check(request.node)
            index = request.node.node_index
            self.coord._node(index, request.node.session, self.clock())
            before = self.routes.current
            if request.reduce and self.params.settled(request.round_id):
                raise CoordinatorError("FAILED_PRECONDITION", f"the reduce of round "
                                       f"{request.round_id} is over")
            try:
                info = self.routes.bypass(index, request.round_id, request.epoch,
                                          request.stalled, request.why, request.reduce)
            except CoordinatorError as exc:
                if exc.code == "ABORTED":  # a reduce: the round's exchange is skipped now
                    self.params.fail(request.round_id, str(exc))
                raise
            if (before is not None and info is not before
                    and info.feeds_server != before.feeds_server
                    and not self.params.reassign_upload(request.round_id, LEADER,
                                                        before.feeds_server, index)):
                info = self.routes.current = replace(info, feeds_server=before.feeds_server)
            return self.routes.message(info)

        return self._call(context, bypass)

    def Digest(self, request: pb.DigestRequest,
                     context: grpc.ServicerContext) -> pb.DigestResponse:
        def who() -> int:
            self._check(request.node)
            index = request.node.node_index
            self.coord._node(index, request.node.session, self.clock())
            if len(request.sha256) not in (0, DIGEST_SIZE):
                raise ParamError("INVALID_ARGUMENT", f"a digest is {DIGEST_SIZE} bytes, got "
                                 f"{len(request.sha256)}")
            if request.center and request.sha256:
                raise ParamError("INVALID_ARGUMENT", "the center's digest is the server's own: "
                                 "nobody registers it")
            if request.sha256:  # only the source of the round's leader route registers
                r = self.routes.current
                if r is None or r.round_id != request.round_id or r.reduce or r.route.root != index:
                    raise CoordinatorError("PERMISSION_DENIED", f"node {index} is not the "
                                           f"source of round {request.round_id}'s leader route")
                self.params.digests.register(request.round_id, bytes(request.sha256))
            return index

        self._call(context, who)
        if request.sha256:
            return pb.DigestResponse(sha256=request.sha256)
        if request.center:  # outside the servicer's lock (the store has its own)
            digest = self.params.center_digest(request.round_id, self.digest_wait)
        else:
            digest = self.params.digests.get(request.round_id, self.digest_wait)
        return pb.DigestResponse(sha256=digest or b"")

    def Session(self, request_iterator: Iterator[pb.SessionRequest],
                context: grpc.ServicerContext) -> Iterator[pb.SessionReply]:
        yield from session.serve(self, request_iterator, context)

    def PushParams(self, request_iterator: Iterator[pb.PushParamsRequest],
                   context: grpc.ServicerContext) -> pb.PushParamsResponse:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an upload starts with a header")
        h = first.header
        buffer = BUFFERS.get(h.buffer)
        if buffer is None or buffer == AVERAGE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot upload buffer {h.buffer}")
        wire = WIRES.get(h.wire_format)
        if wire is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown wire format {h.wire_format}")
        self._call(context, lambda: (self._check(h.node),
                                     self.coord.heartbeat(h.node.node_index, h.node.session,
                                                          self.clock())))

        received = 0

        def chunks() -> Iterator[tuple[int, bytes]]:
            nonlocal received
            for req in request_iterator:
                if not req.HasField("chunk"):
                    raise ParamError("INVALID_ARGUMENT", "only chunks may follow the header")
                received += len(req.chunk.data)
                yield req.chunk.offset, req.chunk.data

        try:
            if buffer == MAIL:
                self._post_mail(h, chunks(), wire)
            elif buffer == DELTA:
                if self.params.rule.synchronous:
                    raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} is "
                                     "synchronous: it takes no center deltas")
                self.params.push_delta(h.node.node_index, h.node.session, h.round_id,
                                       h.param_count, chunks(), _wire_dtype(wire))
            else:
                self.params.push(h.node.node_index, h.round_id, buffer, h.param_count,
                                 h.summands, chunks(), wire=wire, weight=h.weight)
        except ParamError as exc:
            _abort(context, exc)
        finally:
            self.stats.moved(received=received)
        return pb.PushParamsResponse()

    def PullParams(self, request: pb.PullParamsRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.ParamChunk]:
        buffer = BUFFERS.get(request.buffer)
        if buffer not in PULLABLE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot download buffer {request.buffer}")
        wire = WIRES.get(request.wire_format)
        if wire is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown wire format {request.wire_format}")
        self._call(context, lambda: (self._check(request.node),
                                     self.coord.heartbeat(request.node.node_index,
                                                          request.node.session, self.clock())))
        chunk = request.chunk_elements or DEFAULT_CHUNK
        if not 1 <= chunk <= MAX_CHUNK:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunk_elements must be in 1..{MAX_CHUNK}, got {chunk}")
        if buffer == MAIL:
            yield from self._deliver_mail(request, chunk, context)
            return
        sent = 0
        try:
            for offset, data in self.params.pull(request.round_id, buffer, chunk,
                                                 timeout=self.round_timeout, wire=wire):
                yield pb.ParamChunk(offset=offset, data=data)
                sent += len(data)
        except ParamError as exc:
            _abort(context, exc)
        finally:
            self.stats.moved(sent=sent)

    def _post_mail(self, h: pb.PushHeader, chunks, wire: str) -> None:
        """A gossip rule's mail for a random other node (``mail.py``)."""
        if not getattr(self.params.rule, "gossip", False) or self.params.mail is None:
            raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} sends no mail")
        if h.param_count != self.params.param_count:
            raise ParamError("INVALID_ARGUMENT", f"mail of {h.param_count} parameters; the "
                             f"job's model has {self.params.param_count}")
        with self.cond:
            live = [n.index for n in self.coord.live_nodes]
        self.params.mail.post(h.node.node_index, h.node.session, h.round_id, h.weight, live,
                              chunks, _wire_dtype(wire))

    def _deliver_mail(self, request: pb.PullParamsRequest, chunk: int,
                      context: grpc.ServicerContext) -> Iterator[pb.ParamChunk]:
        """This node's mail, delivery ``round_id`` (``mail.py``); float32 on the wire."""
        try:
            if not getattr(self.params.rule, "gossip", False) or self.params.mail is None:
                raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} sends no mail")
            if request.wire_format != pb.WIRE_FORMAT_UNSPECIFIED:
                raise ParamError("INVALID_ARGUMENT", "mail is sent as float32")
            vec, weight = self.params.mail.take(request.node.node_index, request.node.session,
                                                request.round_id)
        except ParamError as exc:
            _abort(context, exc)
        if vec is None:
            yield pb.ParamChunk(offset=0, data=b"", weight=0.0)
            return
        sent = 0
        try:
            for lo in range(0, vec.size, chunk):
                data = vec[lo : lo + chunk].tobytes()
                yield pb.ParamChunk(offset=lo, data=data, weight=weight if lo == 0 else 0.0)
                sent += len(data)
        finally:
            self.stats.moved(sent=sent)

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
