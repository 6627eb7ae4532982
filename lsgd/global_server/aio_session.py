"""The nodes' ``Session`` streams on an asyncio gRPC server: one event loop, no thread per node.

On the synchronous server every message of a stream crosses from gRPC's polling thread to the
stream's handler thread and back: 186-234 µs of server CPU per message, where an asyncio server
spends 98-100 µs (``bench/stream_floor.py``, docs/benchmarks.md). At 512 nodes the node loops'
messages are most of the server's work, so they get a server of their own, on ``SESSION_PORT``
(JoinResponse.session_port tells the nodes). Everything else (joins, heartbeats, parameter
streams, health) stays on the synchronous server on ``PORT``, and so does its ``Session`` method:
a node that cannot reach ``SESSION_PORT`` uses that one.

The protocol and the checks are those of ``session.py`` and ``lsgd.security.CallCheck``: the
opening message is signed (its metadata covers its bytes, with the same nonce memory as the
other port, so an opening cannot be replayed across them), every later message carries its MAC
and the next number, under mutual TLS the node must be one its certificate names, and a call is
answered by the same steps as its unary form (``polls.py``): a step runs on the loop with the
servicer's lock held for microseconds, and a long-poll or a round barrier waits on a future
that the servicer's ``on_news`` resolves, not on a thread. A small download waits the same way
for the parameter store's news (``ParamStore.on_change``); a small upload of a round's sum
never waits, and runs on the loop. Digests and leader uploads, rare and sometimes slow (a hash
of the center; a leader's digest, which ``PLANE=chain`` waits for), run in a small thread
pool.

Admission is the synchronous server's, in the loop's terms: at most ``Limits.sessions`` streams
open, at most ``pending_per_host`` per host before their opening is checked, an opening within
``header_wait`` seconds, and one stream per node (a newer checked stream cancels the older).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from ..proto import lsgd_pb2 as pb
from ..security import _wrong_node
from ..signing import SIGNATURE_KEY, Verifier
from ..wire import SMALL_VECTOR
from .admission import Limits, _host
from .coordinator import CoordinatorError
from .params import ParamError
from .polls import CreditPoll, RoundBarrier
from .session import CallContext, Refused, method_of, opening_error, parse_call

if TYPE_CHECKING:
    from ..security import Security
    from .servicer import GlobalServicer

log = logging.getLogger(__name__)

SERVICE = "lsgd.v1.GlobalServer"
METHOD = f"/{SERVICE}/Session"
SERVER_SAID = (("lsgd-status", "server"),)  # trailing metadata of every status it sends
MAX_MESSAGE = 64 * 1024  # bytes; an opening, or a call (about 100 B) beside a small vector
DIGEST_POLL = 0.05  # seconds between looks while a digest question waits
PULL_TICK = 0.2  # seconds a download waits for the store's news before it looks again
CREDITS, ROUNDS, PARAMS = 0, 1, 2  # what a waiter waits for news of
START_WAIT = 10.0  # seconds the server may take to start listening


@dataclass(eq=False)
class _Stream:
    context: object  # grpc.aio.ServicerContext
    host: str
    node: int | None = None  # once its opening was checked
    cancelled: str = ""
    task: asyncio.Task | None = None  # the handler's


class _LoopContext(CallContext):
    """What a call on an asyncio stream sees of its context: ``abort`` refuses the call."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return self._peer


class SessionServer:
    """The asyncio server of the ``Session`` streams (``start`` / ``stop`` from any thread)."""

    def __init__(self, servicer: "GlobalServicer", limits: Limits,
                 security: "Security | None" = None, verifier: Verifier | None = None) -> None:
        self.s = servicer
        self.limits = limits
        self.security = security
        self.verifier = verifier
        self.check_nodes = bool(security and security.mtls and security.cert is not None)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        # digests and leader uploads: rare, and they may wait or hash a vector
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lsgd-session")
        # futures waiting for news -> their node (-1: none), by CREDITS, ROUNDS, PARAMS
        self._waiters: tuple[dict, dict, dict] = ({}, {}, {})
        self._open: set[_Stream] = set()
        self._pending: Counter[str] = Counter()  # host -> streams whose opening is unchecked
        self._by_node: dict[int, _Stream] = {}

    # ------------------------------------------------------------------ life
    def start(self, address: str) -> int:
        """Listen on ``address`` ("host:port"); returns the port. ``OSError`` if it cannot."""
        ready: futures.Future = futures.Future()
        self._thread = threading.Thread(target=self._run, args=(address, ready), daemon=True,
                                        name="lsgd-session-server")
        self._thread.start()
        try:
            self.port = ready.result(START_WAIT)
        except futures.TimeoutError:
            raise OSError(f"the session server did not start within {START_WAIT:g} s") from None
        self.s.on_news = self._news
        self.s.params.on_change = self._param_news
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: the open streams end (their nodes open new ones, or are gone)."""
        self.s.on_news = None
        self.s.params.on_change = None
        loop = self._loop
        alive = self._thread is not None and self._thread.is_alive()
        if loop is not None and self._server is not None and alive and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(grace), loop).result(grace + 5)
            except (futures.TimeoutError, futures.CancelledError, RuntimeError):
                pass  # the loop ends as the server does, and may cancel this call with it
        if self._thread is not None:
            self._thread.join(grace + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self, grace: float) -> None:
        """End every open stream with a status the node understands (the server is going
        away), then stop the server."""
        ends = [self._loop.create_task(self._end(st, grpc.StatusCode.UNAVAILABLE,
                                                 "the global server is stopping"))
                for st in list(self._open)]
        if ends:
            await asyncio.wait(ends, timeout=grace)
        await self._server.stop(grace)

    def _run(self, address: str, ready: futures.Future) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            server = grpc.aio.server(options=_options())
            handler = grpc.method_handlers_generic_handler(SERVICE, {
                "Session": grpc.stream_stream_rpc_method_handler(
                    self._serve, response_serializer=pb.SessionReply.SerializeToString)})
            server.add_generic_rpc_handlers((handler,))
            creds = self.security.server_credentials() if self.security else None
            try:
                port = (server.add_secure_port(address, creds) if creds
                        else server.add_insecure_port(address))
            except RuntimeError:  # gRPC's text says little more and asks for GRPC_VERBOSITY
                ready.set_exception(OSError(f"cannot listen on {address} (address in use, or "
                                            "not local)"))
                return
            if port == 0:
                ready.set_exception(OSError(f"cannot listen on {address} (address in use or "
                                            "not local)"))
                return
            self._server = server
            await server.start()
            ready.set_result(port)
            await server.wait_for_termination()
            # the calls' own tasks end after the server: asyncio.run would cancel them, noisily
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if rest:
                await asyncio.wait(rest, timeout=2.0)

        try:
            asyncio.run(main())
        except Exception as exc:  # noqa: BLE001 - told to start(), or logged
            if not ready.done():
                ready.set_exception(OSError(f"the session server failed: {exc}"))
            else:
                log.exception("the session server failed")

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
                # leader's) hear first, so that their upload overlaps the other answers.
                first = self.s.params.uploaders()
                waiters.sort(key=lambda wn: wn[1] not in first)
            for w, _ in waiters:
                if not w.done():
                    w.set_result(True)

    async def _wait(self, kind: int, timeout: float, node: int = -1) -> bool:
        """Wait up to ``timeout`` seconds for news of ``kind`` (registered before the news
        that came during the caller's step is fired: call it right after the step), for
        ``node``'s call. False when none came."""
        loop = self._loop
        w = loop.create_future()
        waiters = self._waiters[kind]
        waiters[w] = node
        timer = loop.call_later(timeout, lambda: w.done() or w.set_result(False))
        try:
            return await w
        finally:
            timer.cancel()
            waiters.pop(w, None)
            if not w.done():
                w.cancel()

    # ------------------------------------------------------------------ a stream
    async def _serve(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[pb.SessionReply]:  # noqa: ANN001
        self.s.calls.add("Session")  # every stream, as the synchronous server counts calls
        if self.verifier is not None and not any(k == SIGNATURE_KEY for k, _ in
                                                 context.invocation_metadata() or ()):
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED,
                              self.verifier.check(None, METHOD, b""))
        stream = await self._admit(context)
        try:
            it = requests.__aiter__()
            try:
                raw = await asyncio.wait_for(it.__anext__(), self.limits.header_wait)
            except StopAsyncIteration:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, opening_error(None))
            except asyncio.TimeoutError:
                self._count("cancelled", "header")
                await self._abort(context, grpc.StatusCode.CANCELLED, "no opening message within "
                                    f"{self.limits.header_wait:g} s")
            first = await self._opening(raw, context)
            node = first.node
            self._bind(stream, node.node_index)
            peer = context.peer()
            expected = 1
            async for raw in it:
                try:
                    req = pb.SessionRequest.FromString(raw)
                except DecodeError:
                    await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                        "a session message does not parse")
                if self.verifier is not None:
                    why = self.verifier.check_message(first.nonce, req)
                    if why:
                        await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, why)
                if req.n != expected:
                    await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                        f"session message {req.n} out of order (expected "
                                        f"{expected})")
                expected += 1
                yield await self._reply(node, req, peer)
        finally:
            self._close(stream)

    async def _opening(self, raw: bytes, context) -> pb.SessionRequest:  # noqa: ANN001
        """Message 0, checked as ``CallCheck`` and ``session.serve`` check it (a large one is
        refused before it is hashed: only later messages may carry a vector)."""
        if len(raw) > MAX_MESSAGE:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              f"a session stream's opening is at most {MAX_MESSAGE} bytes")
        if self.verifier is not None:
            signature = next((v for k, v in context.invocation_metadata() or ()
                              if k == SIGNATURE_KEY), None)
            why = self.verifier.check(signature, METHOD, raw)
            if why:
                await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, why)
        try:
            first = pb.SessionRequest.FromString(raw)
        except DecodeError:
            first = None
        why = opening_error(first)
        if why:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, why)
        if self.check_nodes:
            why = _wrong_node(first, context.auth_context())
            if why:
                await self._abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        try:
            with self.s.cond:
                self.s._check(first.node)
                self.s.coord._node(first.node.node_index, first.node.session, self.s.clock())
        except CoordinatorError as exc:
            await self._abort(context, getattr(grpc.StatusCode, exc.code), str(exc))
        return first

    async def _reply(self, node: pb.NodeId, req: pb.SessionRequest, peer: str) -> pb.SessionReply:
        method = method_of(req)
        ctx = _LoopContext(peer)
        try:
            field_, call = parse_call(node, req)
            try:
                if field_ == "digest":
                    answer = await self._digest(call, ctx)
                elif field_ == "pull":
                    answer = await self._pull(call, ctx)
                elif field_ == "push" and call.header.buffer == pb.BUFFER_KIND_NODE_SUM:
                    answer = self.s.SessionPush(call, ctx)  # a sum never waits: on the loop
                elif field_ == "push":  # a leader may wait for its digest (PLANE=chain)
                    answer = await self._loop.run_in_executor(self._pool, self.s.SessionPush,
                                                              call, ctx)
                else:
                    answer = await self._poll(CreditPoll(self.s, call) if field_ == "acquire"
                                              else RoundBarrier(self.s, call))
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
            timed_out = not await self._wait(ROUNDS if poll.news_only else CREDITS, wait,
                                             poll.request.node.node_index)

    async def _pull(self, call: pb.PullParamsRequest, ctx: _LoopContext) -> pb.ParamChunk:
        """A small download: checked, then read whole on the loop as soon as it is ready (the
        store's news wakes it; ``PULL_TICK`` lets an exchange's deadline pass), holding no
        thread while it waits; refused when not ready within the round time-out."""
        buffer, wire = self.s.small_download_check(call, ctx)
        end = self._loop.time() + self.s.round_timeout
        while True:
            data = self.s.small_download(call, buffer, wire, 0.0)
            if data is not None:
                return pb.ParamChunk(offset=0, data=data)
            left = end - self._loop.time()
            if left <= 0:
                raise ParamError("DEADLINE_EXCEEDED", f"{buffer} of round {call.round_id} not "
                                 f"ready within {self.s.round_timeout:g} s")
            await self._wait(PARAMS, min(left, PULL_TICK))

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

    # ------------------------------------------------------------------ admission
    async def _admit(self, context) -> _Stream:  # noqa: ANN001
        host = _host(context.peer() or "")
        lim = self.limits
        if len(self._open) >= lim.sessions:
            kind, why = "sessions", (f"the global server already has {lim.sessions} session "
                                     "streams open (one per node); try again later")
        elif self._pending[host] >= lim.pending_per_host:
            kind, why = "host", (f"{host} already has {lim.pending_per_host} streams open that "
                                 "have not named a node session")
        else:
            stream = _Stream(context, host, task=asyncio.current_task())
            self._open.add(stream)
            self._pending[host] += 1
            return stream
        self._count("refused", kind)
        await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        raise AssertionError("unreachable")

    def _bind(self, stream: _Stream, index: int) -> None:
        """The stream's opening is checked: it is node ``index``'s; its older one ends."""
        self._unpend(stream)
        stream.node = index
        old = self._by_node.get(index)
        self._by_node[index] = stream
        if old is not None and old is not stream:
            old.cancelled = "replaced by a newer stream of its node"
            self._count("cancelled", "replaced")
            self._loop.create_task(self._end(old, grpc.StatusCode.CANCELLED, old.cancelled))

    async def _abort(self, context, code: grpc.StatusCode, details: str) -> None:  # noqa: ANN001
        """End this stream with ``code`` (counted as the synchronous server's interceptor counts
        a failed call; marked as the server's own answer, so that the node does not take it
        for a port it cannot reach)."""
        self.s.stats.count("Session", code.name)
        await context.abort(code, details, SERVER_SAID)

    async def _end(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """End ``stream`` from another task: its status, then its handler (which may be waiting
        in a barrier: aborting alone would leave it running until its round closed)."""
        try:
            await self._abort(stream.context, code, details)
        except BaseException:  # noqa: BLE001 - abort raises by design; the stream may be over
            pass
        if stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()

    def _unpend(self, stream: _Stream) -> None:
        if stream.node is None and stream.host in self._pending:
            self._pending[stream.host] -= 1
            if not self._pending[stream.host]:
                del self._pending[stream.host]

    def _close(self, stream: _Stream) -> None:
        if stream not in self._open:
            return
        self._open.discard(stream)
        self._unpend(stream)
        if stream.node is not None and self._by_node.get(stream.node) is stream:
            del self._by_node[stream.node]

    def _count(self, what: str, kind: str) -> None:
        admission = self.s.admission
        if admission is not None:
            admission.note(what, kind)

    @property
    def open_sessions(self) -> int:
        return len(self._open)


def _options() -> list:
    """The synchronous server's options, with message limits for session messages: a call,
    or a small vector whole (an 8 MiB message would be read on the loop before its refusal)."""
    from .server import SERVER_OPTIONS

    limits = {"grpc.max_receive_message_length": SMALL_VECTOR + MAX_MESSAGE,
              "grpc.max_send_message_length": SMALL_VECTOR + MAX_MESSAGE}
    return [o for o in SERVER_OPTIONS if o[0] not in limits] + list(limits.items())
