"""A node session's calls on the session server's event loop (``aio_session.py``): answered by
the same steps as their unary forms (``polls.py``), waiting on futures instead of threads.

A step runs on the loop with the servicer's lock held for microseconds; a long-poll or a round
barrier waits on a future that the servicer's ``on_news`` resolves. A small download waits the
same way for the parameter store's news (``ParamStore.on_change``); a small upload of a round's
sum or leader never waits, and runs on the loop. Digests and the uploads of a leader that came
down a route, rare and sometimes slow (a hash of the center; a leader's digest, which
``PLANE=chain`` waits for), run in a small thread pool. At a round's close the leader's node is
answered first: every other node's download waits for its upload, and a node that reported
with ``then_pull`` gets that download in the round's answer (``_then_pull``).
"""

from __future__ import annotations

import asyncio
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from ..proto import lsgd_pb2 as pb
from ..rules.base import MAX_WEIGHT, MIN_WEIGHT
from ..wire import varint
from .coordinator import CoordinatorError
from .params import ParamError, sum_weight_ok
from .polls import CreditPoll, RoundBarrier
from .session import CallContext, Refused, method_of, parse_call
from .transfers import WIRES

if TYPE_CHECKING:
    from .servicer import GlobalServicer

DIGEST_POLL = 0.05  # seconds between looks while a digest question waits
PULL_TICK = 0.2  # seconds a download waits for the store's news before it looks again
CREDITS, ROUNDS, PARAMS = 0, 1, 2  # what a waiter waits for news of
THEN_PULL = (pb.BUFFER_KIND_UNSPECIFIED, pb.BUFFER_KIND_GLOBAL_LEADER)  # a report's then_pull


def _status(exc: CoordinatorError | ParamError | Refused) -> tuple[int, str]:
    """The gRPC status code (its number) and details of a refused call."""
    if isinstance(exc, Refused):
        return exc.code.value[0], exc.details
    return getattr(grpc.StatusCode, exc.code).value[0], str(exc)


_REPORT = pb.SessionReply.DESCRIPTOR.fields_by_name["report"].number
_DOWNLOAD = pb.ReportRoundResponse.DESCRIPTOR.fields_by_name["download"].number
_DATA = pb.ParamChunk.DESCRIPTOR.fields_by_name["data"].number


def _field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited field."""
    return varint(number << 3 | 2) + varint(length)


def _with_download(n: int, answer: pb.ReportRoundResponse, data: bytes) -> list[bytes]:
    """``SessionReply(n, report=answer)`` with ``answer.download = ParamChunk(offset=0,
    data=data)``, as the parts of its encoding: ``data`` (a round's leader, the same object in
    every node's answer) is not copied through protobuf, only once into the frame."""
    chunk = _field(_DATA, len(data))  # offset 0: the default, not written
    report = answer.SerializeToString() + _field(_DOWNLOAD, len(chunk) + len(data)) + chunk
    head = (pb.SessionReply(n=n).SerializeToString()
            + _field(_REPORT, len(report) + len(data)) + report)
    return [head, data]


class _LoopContext(CallContext):
    """What a call on an asyncio stream sees of its context: ``abort`` refuses the call."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return self._peer


class SessionCalls:
    """The calls of every node session on one event loop (``_loop``, set by the server that
    runs it), and the news that wakes their waits (any thread)."""

    def __init__(self, servicer: "GlobalServicer") -> None:
        self.s = servicer
        self._loop: asyncio.AbstractEventLoop | None = None
        # digests and leader uploads: rare, and they may wait or hash a vector
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lsgd-session")
        # futures waiting for news -> (their node or -1, the round whose leader their answer
        # carries or 0), by CREDITS, ROUNDS, PARAMS
        self._waiters: tuple[dict, dict, dict] = ({}, {}, {})

    def listen(self) -> None:
        """Hear the servicer's and the parameter store's news (after the loop runs)."""
        self.s.on_news = self._news
        self.s.params.on_change = self._param_news

    def deafen(self) -> None:
        self.s.on_news = None
        self.s.params.on_change = None

    # ------------------------------------------------------------------ news
    def _news(self, closed: bool) -> None:
        """The servicer's state changed (any thread, its lock held): wake the polls after it."""
        self._wake((CREDITS, ROUNDS) if closed else (CREDITS,))

    def _param_news(self) -> None:
        """The parameter store's state changed (any thread, its lock held): a download it
        held back may be ready."""
        self._wake((PARAMS,))

    def _wake(self, kinds: tuple[int, ...]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fire, kinds)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _fire(self, kinds: tuple[int, ...]) -> None:
        for kind in kinds:
            waiters = list(self._waiters[kind].items())
            self._waiters[kind].clear()
            if kind == ROUNDS and len(waiters) > 1:
                # A round closed: the nodes whose uploads the others' downloads wait for (the
                # leader's) hear first, so that their upload overlaps the other answers. A
                # node whose answer will carry that leader (then_pull) has nothing to do
                # before it is in: it waits for the store's news instead, so that the loop
                # reads the leader's upload first, not after N wake-ups.
                first = self.s.params.uploaders()
                waiters.sort(key=lambda wn: wn[1][0] not in first)
                pending = self.s.params.leader_pending()
                if pending:
                    later = {w: v for w, v in waiters if v[1] == pending and v[0] not in first}
                    self._waiters[PARAMS].update(later)
                    waiters = [(w, v) for w, v in waiters if w not in later]
            for w, _ in waiters:
                if not w.done():
                    w.set_result(True)

    async def _wait(self, kind: int, timeout: float, node: int = -1, carries: int = 0) -> bool:
        """Wait up to ``timeout`` seconds for news of ``kind`` (registered before the news
        that came during the caller's step is fired: call it right after the step), for
        ``node``'s call (``carries``: the round whose leader its answer carries, 0: none).
        False when none came."""
        loop = self._loop
        w = loop.create_future()
        self._waiters[kind][w] = (node, carries)
        timer = loop.call_later(timeout, lambda: w.done() or w.set_result(False))
        try:
            return await w
        finally:
            timer.cancel()
            for waiters in self._waiters:  # (_fire may have moved it)
                waiters.pop(w, None)
            if not w.done():
                w.cancel()

    # ------------------------------------------------------------------ calls
    async def _reply(self, node: pb.NodeId, req: pb.SessionRequest,
                     peer: str) -> pb.SessionReply | list[bytes]:
        """The reply to ``req``: a message, or the parts of one encoded already (a round's
        answer that carries the leader: ``_with_download``)."""
        method = method_of(req)
        ctx = _LoopContext(peer)
        try:
            field_, call = parse_call(node, req)
            try:
                if field_ == "digest":
                    answer = await self._digest(call, ctx)
                elif field_ == "pull":
                    answer = pb.ParamChunk(offset=0, data=await self._pull(call, ctx))
                elif field_ == "push" and (call.header.buffer == pb.BUFFER_KIND_NODE_SUM or
                                           not self.s.params.leader_waits(call.header.round_id)):
                    answer = self.s.SessionPush(call, ctx)  # it does not wait: on the loop
                elif field_ == "push":  # a leader that may wait for its digest (PLANE=chain)
                    answer = await self._loop.run_in_executor(self._pool, self.s.SessionPush,
                                                              call, ctx)
                elif field_ == "leave":  # never waits: on the loop
                    answer = self.s.Leave(call, ctx)
                elif field_ == "acquire":
                    answer = await self._poll(CreditPoll(self.s, call))
                else:
                    carried = self._carried_upload(call, ctx)  # checked before it counts
                    answer = await self._poll(RoundBarrier(self.s, call))
                    if carried is not None:
                        self._then_push(carried, answer, ctx)
                    if call.then_pull:
                        leader = await self._then_pull(call, answer, ctx)
                        if leader is not None:  # the answer, encoded around its bytes
                            self.s.calls.add(method)
                            return _with_download(req.n, answer, leader)
            except (CoordinatorError, ParamError) as exc:
                raise Refused(getattr(grpc.StatusCode, exc.code), str(exc)) from None
            self.s.calls.add(method)
            return pb.SessionReply(n=req.n, **{field_: answer})
        except Refused as r:
            self.s.stats.count(method, r.code.name)
            return pb.SessionReply(n=req.n, code=r.code.value[0], details=r.details)

    async def _poll(self, poll: CreditPoll | RoundBarrier) -> object:
        timed_out = False
        while True:
            with self.s.cond:
                answer = poll.step(True, timed_out)
                wait = poll.wait()
            if answer is not None:
                return answer
            req = poll.request
            timed_out = not await self._wait(ROUNDS if poll.news_only else CREDITS, wait,
                                             req.node.node_index,
                                             getattr(req, "then_pull", 0) and req.round_id)

    async def _pull(self, call: pb.PullParamsRequest, ctx: _LoopContext) -> bytes:
        """A small download: checked, then read whole on the loop as soon as it is ready (the
        store's news wakes it; ``PULL_TICK`` lets an exchange's deadline pass), holding no
        thread while it waits; refused when not ready within the round time-out. Its bytes
        (a round's leader: the same object for every node)."""
        buffer, wire = self.s.small_download_check(call, ctx)
        end = self._loop.time() + self.s.round_timeout
        while True:
            data = self.s.small_download(call, buffer, wire, 0.0)
            if data is not None:
                return data
            left = end - self._loop.time()
            if left <= 0:
                raise ParamError("DEADLINE_EXCEEDED", f"{buffer} of round {call.round_id} not "
                                 f"ready within {self.s.round_timeout:g} s")
            await self._wait(PARAMS, min(left, PULL_TICK))

    def _carried_upload(self, call: pb.ReportRoundRequest,
                        ctx: _LoopContext) -> tuple[pb.SessionUpload, bool] | None:
        """A report's ``then_pull`` and ``then_push``, checked before the report counts: a
        malformed one refuses the report (INVALID_ARGUMENT) and changes nothing. The carried
        upload and whether its values are finite, or None."""
        if call.then_pull not in THEN_PULL or call.then_pull_wire not in WIRES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "then_pull may name only the "
                          "global leader (BUFFER_KIND_GLOBAL_LEADER), in a known wire format")
        if not call.HasField("then_push"):
            return None
        upload, h = call.then_push, call.then_push.header
        if (h.buffer != pb.BUFFER_KIND_NODE_SUM or h.round_id != call.round_id
                or h.node != call.node or h.wire_format not in WIRES):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "then_push carries only this node's "
                          "sum (BUFFER_KIND_NODE_SUM) of the round it reports, in a known wire "
                          "format")
        if not 1 <= h.summands <= call.participants or not sum_weight_ok(
                h.summands, h.weight or float(h.summands)):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"then_push sums {h.summands} of the "
                          f"report's {call.participants} participants, weight {h.weight}: at "
                          f"least 1, at most the participants, each of weight in "
                          f"[{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]")
        try:
            return upload, self.s.small_upload_check(upload, ctx)
        except ParamError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            return None  # a format this server cannot read: the node's own push says so

    def _then_push(self, carried: tuple[pb.SessionUpload, bool], answer: pb.ReportRoundResponse,
                   ctx: _LoopContext) -> None:
        """The report's sum, taken now that the round has closed (as an upload right after the
        answer would be: a sum never waits, so on the loop), and the answer says so, or why not.
        Not for a missed or stopped round, or one whose sums go along a route (PLANE=chain)."""
        if answer.missed or answer.stopped or answer.route.members:
            return
        try:
            upload, finite = carried
            self.s.take_small_upload(upload, ctx, finite)
            answer.pushed = True
        except (CoordinatorError, ParamError, Refused) as exc:
            answer.push_code, answer.push_details = _status(exc)

    async def _then_pull(self, call: pb.ReportRoundRequest, answer: pb.ReportRoundResponse,
                         ctx: _LoopContext) -> bytes | None:
        """The round's answer carries the node's download of the leader (``then_pull``), as a
        ``pull`` call after it would have got it (the same checks and wait), or that call's
        refusal: one message less per node and round. Not for the leader's own node, a missed
        or stopped round, or a round whose leader travels on a route (PLANE=chain). Returns
        the leader's bytes for the answer's ``download`` (None: nothing to carry, or the
        refusal is in ``answer``)."""
        if (answer.missed or answer.stopped or not answer.has_leader or answer.route.members
                or answer.leader_node == call.node.node_index):
            return None
        req = pb.PullParamsRequest(node=call.node, round_id=call.round_id, buffer=call.then_pull,
                                   wire_format=call.then_pull_wire)
        try:
            return await self._pull(req, ctx)
        except (CoordinatorError, ParamError, Refused) as exc:
            answer.download_code, answer.download_details = _status(exc)
            return None

    async def _digest(self, call: pb.DigestRequest, ctx: _LoopContext) -> pb.DigestResponse:
        """A ``Digest`` call: its checks on the loop; its answer looked at every
        ``DIGEST_POLL`` s until there is one or the server's wait is over, so a wait holds no
        thread (a leader's digest is a look-up, on the loop; a center's may hash the center
        once per round, in the pool)."""
        self.s.digest_check(call, ctx)
        end = self._loop.time() + self.s.digest_wait
        while True:
            if call.center:
                answer = await self._loop.run_in_executor(self._pool, self.s.digest_answer, call,
                                                          0.0)
            else:
                answer = self.s.digest_answer(call, 0.0)
            if answer.sha256 or self._loop.time() >= end:
                return answer
            await asyncio.sleep(min(DIGEST_POLL, max(0.0, end - self._loop.time())))
