"""The two long-polls of the node loop, as steps that never block: a credit request and a round
barrier.

``GlobalServicer.AcquireCredits`` and ``ReportRound`` (threads of the synchronous server) and the
asyncio ``Session`` server (``aio_session.py``, one event loop for every node's stream) run the
same steps; only how they wait between two steps differs (a condition variable, or a future
that ``GlobalServicer._wake`` resolves). Each step runs with the servicer's lock held and
returns the answer, or None: wait for news (``news_only``: a round opening or closing, or a
stop; otherwise any change that can free credits) for at most ``wait()`` seconds, then step
again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..leader import Candidate
from ..proto import lsgd_pb2 as pb
from .coordinator import CoordinatorError

if TYPE_CHECKING:
    from .servicer import GlobalServicer

MAX_CREDIT_WAIT = 0.5  # seconds one AcquireCredits call may long-poll
BARRIER_TICK = 1.0  # seconds a round barrier waits for news before it advances time itself


class CreditPoll:
    """One ``AcquireCredits`` call."""

    news_only = False

    def __init__(self, servicer: "GlobalServicer", request: pb.AcquireCreditsRequest) -> None:
        self.s, self.request = servicer, request
        self.end = servicer.clock() + min(MAX_CREDIT_WAIT, request.max_wait_ms / 1000.0)
        self._counts = dict(consumed=request.consumed, late=request.late_consumed,
                            released=request.released, seq=request.seq, used_ms=request.used_ms)
        self._first = True

    def wait(self) -> float:
        return max(0.0, self.end - self.s.clock())

    def step(self, active: bool = True, timed_out: bool = False) -> pb.AcquireCreditsResponse | None:
        """Ask (the node's counts go with the first ask only); the answer, or None to wait.
        (``timed_out`` is the barrier's: a credit poll asks again either way.)"""
        s, req, node = self.s, self.request, self.request.node
        if self._first:
            s._check(node)
            self._first = False
        else:  # woken: most often by a round opening, the same answer for every node
            news = s.coord.round_news(node.node_index, node.session, req.last_round_seen,
                                      s.clock())
            if news is not None:
                return s.round_answer(news.round)
        grant = s._change(lambda: s.coord.acquire(
            node.node_index, node.session, want=req.want, last_round_seen=req.last_round_seen,
            now=s.clock(), **self._counts))
        self._counts = dict(consumed=0, late=0, released=0, seq=0, used_ms=0)
        if grant.wait and self.wait() > 0 and active:
            return None
        resp = pb.AcquireCreditsResponse(grant=grant.grant, counter=s.coord.done, epoch=s.epoch,
                                         stopped=s.coord.stopped_for(node.node_index))
        if grant.round is not None:
            resp.round.id = grant.round.id
            resp.round.kind = int(grant.round.kind)
            resp.round.iteration = grant.round.iteration
        return resp


class RoundBarrier:
    """One ``ReportRound`` call: the node's report, then the wait for its round to close."""

    news_only = True

    def __init__(self, servicer: "GlobalServicer", request: pb.ReportRoundRequest) -> None:
        self.s, self.request = servicer, request
        self.end = servicer.clock() + servicer.round_timeout + 1.0  # the round closes by then
        self._out = None

    def wait(self) -> float:
        """At most ``BARRIER_TICK``: the tick below is for a servicer without a ticker (tests);
        the server's ticker closes a round at its deadline."""
        return min(BARRIER_TICK, max(0.0, self.end - self.s.clock()))

    def step(self, active: bool = True, timed_out: bool = False) -> pb.ReportRoundResponse | None:
        """The first step reports; a later one (``timed_out``: no news came within ``wait()``)
        looks again. The answer, or None to wait; ``CoordinatorError`` DEADLINE_EXCEEDED when
        the round did not close in time."""
        s, req, node = self.s, self.request, self.request.node
        if self._out is None:
            s._check(node)
            if req.weight:  # before the report, which may close the round and plan it
                s._note_weight(req)
            best = Candidate(req.best.worker_id, req.best.loss) if req.has_best else None
            self._out = s._change(lambda: s.coord.report(
                node.node_index, node.session, req.round_id, best, req.participants, s.clock()))
        else:
            if timed_out:
                s._change(lambda: s.coord.tick(s.clock()))
            self._out = s.coord.outcome(node.node_index, req.round_id)
        out = self._out
        if not out.ready and s.clock() < self.end and active:
            return None
        if not out.ready:
            raise CoordinatorError("DEADLINE_EXCEEDED", f"round {req.round_id} did not close")
        resp = pb.ReportRoundResponse(missed=out.missed, participants=out.participants,
                                      node_count=len(out.nodes), evaluate=out.evaluate,
                                      checkpoint=out.checkpoint,
                                      stopped=s.coord.stopped_for(node.node_index))
        if out.leader is not None:
            resp.has_leader = True
            resp.leader.worker_id = out.leader.worker_id
            resp.leader.loss = out.leader.loss
            resp.leader_node = out.leader_node
        route = s.routes.for_node(node.node_index, req.round_id)
        if route is not None and not out.missed:
            resp.route.CopyFrom(s.routes.message(route))
        return resp
