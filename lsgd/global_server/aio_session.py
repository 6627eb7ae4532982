"""The nodes' session streams on a plain socket (``SESSION_PORT``): one event loop, no thread
per node, no gRPC.

At 512 nodes the node loops' messages are most of the server's work. On gRPC's synchronous
server each costs 180-230 µs of server CPU, on a ``grpc.aio`` stream 70 µs, on a plain asyncio
socket 32 µs (``bench/stream_floor.py``, docs/benchmarks.md). So they get a server of their
own on ``SESSION_PORT`` (JoinResponse.session_port tells the nodes), speaking
``lsgd/plane/session_wire.py``: the same ``SessionRequest`` / ``SessionReply`` messages as the
gRPC ``Session`` stream, one TCP connection per node session. Everything else (joins,
heartbeats, parameter streams, health) stays on the gRPC server on ``PORT``, and so does its
``Session`` method: a node that cannot reach ``SESSION_PORT`` uses that one. Under TLS there is
no session port (its connections are authenticated, not encrypted): the streams go to ``PORT``.

The checks are those of ``session.py``: the opening names a node session the servicer knows
(with a job secret, its MAC is good on this connection only: ``session_wire.opening_mac``),
every later message carries its MAC and the next number, and a call is answered by the same
steps as its unary form (``session_calls.py``). A stream ends with a reply numbered 0 carrying
a gRPC status code, as a gRPC stream ends with a status.

Admission is the synchronous server's, in the loop's terms: at most ``Limits.sessions`` streams
open, at most ``pending_per_host`` per host before their opening is checked, an opening within
``header_wait`` seconds, and one stream per node (a newer checked stream ends the older). A
node sends one call at a time: a stream with more than ``QUEUED`` messages waiting is ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from ..plane import session_wire as sw
from ..proto import lsgd_pb2 as pb
from ..signing import Verifier, derive_key
from .admission import Limits
from .coordinator import CoordinatorError
from .session import opening_error
from .session_calls import SessionCalls

if TYPE_CHECKING:
    from .servicer import GlobalServicer

log = logging.getLogger(__name__)

START_WAIT = 10.0  # seconds the server may take to start listening
QUEUED = 4  # messages a stream may have waiting (a node sends one call at a time)
UNREAD = 4 * sw.MAX_FRAME  # bytes of replies a stream may leave unread
LINGER = 1.0  # seconds an ended stream's last words may take to go out


class _End(Exception):
    """End this stream with ``code`` and one line."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Conn(asyncio.Protocol):
    """One node's connection: frames in, replies out; the stream's handler runs as a task."""

    def __init__(self, server: "SessionServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.host, self.peer = "?", "?"
        self.frames: asyncio.Queue = asyncio.Queue()
        self.buf = bytearray()
        self.seen = 0  # frames read
        self.node: int | None = None  # once its opening was checked
        self.task: asyncio.Task | None = None
        self.over = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.host, self.peer = str(peer[0]), f"ipv4:{peer[0]}:{peer[1]}"
        self.server._accept(self)

    def data_received(self, data: bytes) -> None:
        if self.over:
            return
        self.buf += data
        while len(self.buf) >= sw.LENGTH:
            size = int.from_bytes(self.buf[:sw.LENGTH], "big")
            limit = sw.MAX_FRAME if self.seen else sw.MAX_OPENING + sw.MAC_SIZE
            if size > limit:
                what = "a message" if self.seen else "an opening"
                return self.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{what} of {size} bytes; at most {limit}")
            if len(self.buf) < sw.LENGTH + size:
                return
            self.frames.put_nowait(bytes(self.buf[sw.LENGTH:sw.LENGTH + size]))
            del self.buf[:sw.LENGTH + size]
            self.seen += 1
            if self.frames.qsize() > QUEUED:
                return self.end(grpc.StatusCode.INVALID_ARGUMENT, "a node sends one call at a "
                                "time: wait for each reply")

    def connection_lost(self, exc: Exception | None) -> None:
        """The node went away: its handler stops too (it may wait in a barrier, holding the
        node's place until its round closes)."""
        self.over = True
        self._stop_frames()
        if self.task is not None:
            self.task.cancel()

    def _stop_frames(self) -> None:
        """No frame still queued is answered: the stream is over."""
        while not self.frames.empty():
            self.frames.get_nowait()
        self.frames.put_nowait(None)

    def send(self, reply: "pb.SessionReply | list[bytes]") -> None:
        """A reply: a message, or the parts of one encoded already (framed with one copy)."""
        if not self.over and self.transport is not None:
            parts = [reply.SerializeToString()] if isinstance(reply, pb.SessionReply) else reply
            self.transport.write(sw.frame(*parts))

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """End the stream: its status (counted as a failed ``Session`` call), then close (a
        peer that does not read it is cut off after ``LINGER`` seconds); its handler stops."""
        if self.over:
            return
        self.server.s.stats.count("Session", code.name)
        self.send(pb.SessionReply(n=0, code=code.value[0], details=details))
        self.over = True
        transport = self.transport
        if transport is not None:
            transport.close()  # after what is written; abort() if that never goes out
            asyncio.get_running_loop().call_later(LINGER, transport.abort)
        self._stop_frames()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class SessionServer(SessionCalls):
    """The session port's server (``start`` / ``stop`` from any thread)."""

    def __init__(self, servicer: "GlobalServicer", limits: Limits, secret: str | None = None,
                 verifier: Verifier | None = None) -> None:
        super().__init__(servicer)
        self.limits = limits
        self.key = derive_key(secret) if secret else None
        self.verifier = verifier  # later messages' MACs (the gRPC port's checker)
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._open: set[_Conn] = set()
        self._pending: Counter[str] = Counter()  # host -> streams whose opening is unchecked
        self._unchecked: dict[_Conn, None] = {}  # those streams, oldest first
        self._by_node: dict[int, _Conn] = {}

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
        self.listen()
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: the open streams end (their nodes open new ones, or are gone)."""
        self.deafen()
        loop = self._loop
        alive = self._thread is not None and self._thread.is_alive()
        if loop is not None and self._server is not None and alive and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(grace + 5)
            except (futures.TimeoutError, futures.CancelledError, RuntimeError):
                pass  # the loop ends as the server does, and may cancel this call with it
        if self._thread is not None:
            self._thread.join(grace + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        """End every open stream with a status the node understands (the server is going
        away), then stop listening."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._open):
            self._end(conn, grpc.StatusCode.UNAVAILABLE, "the global server is stopping")
        if self._stopped is not None:
            self._stopped.set()

    def _run(self, address: str, ready: futures.Future) -> None:
        host, _, port = address.rpartition(":")

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            try:
                self._server = await self._loop.create_server(
                    lambda: _Conn(self), host.strip("[]") or None, int(port), backlog=1024)
            except (OSError, ValueError) as exc:
                ready.set_exception(OSError(f"cannot listen on {address} ({exc})"))
                return
            ready.set_result(self._server.sockets[0].getsockname()[1])
            await self._stopped.wait()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if rest:  # the streams' handlers end as their connections close
                await asyncio.wait(rest, timeout=2.0)

        try:
            asyncio.run(main())
        except Exception as exc:  # noqa: BLE001 - told to start(), or logged
            if not ready.done():
                ready.set_exception(OSError(f"the session server failed: {exc}"))
            else:
                log.exception("the session server failed")

    # ------------------------------------------------------------------ a stream
    def _accept(self, conn: _Conn) -> None:
        """A new connection: its hello, then its handler, or its end at once (after the hello,
        so that the node knows the server refused it, not that the port is not ours)."""
        greeting, nonce = sw.hello()
        conn.transport.write(greeting)
        lim = self.limits
        # Connections without an opening yet: at most pending_per_host per host and sessions
        # in all. A new one takes the place of the oldest (a node sends its opening one round
        # trip after the hello: only a connection that sends nothing grows old), so that
        # strangers holding connections open cannot keep a node from opening its stream.
        if self._pending[conn.host] >= lim.pending_per_host:
            self._evict(next(c for c in self._unchecked if c.host == conn.host), "host")
        if len(self._unchecked) >= lim.sessions:
            self._evict(next(iter(self._unchecked)), "sessions")
        self._open.add(conn)
        self._unchecked[conn] = None
        self._pending[conn.host] += 1
        conn.task = self._loop.create_task(self._serve(conn, nonce))

    async def _serve(self, conn: _Conn, nonce: bytes) -> None:
        try:
            try:
                raw = await asyncio.wait_for(conn.frames.get(), self.limits.header_wait)
            except asyncio.TimeoutError:
                self.s.calls.add("Session")
                self._count("cancelled", "header")
                raise _End(grpc.StatusCode.CANCELLED, "no opening message within "
                           f"{self.limits.header_wait:g} s") from None
            if raw is None or conn.over:  # closed before its opening (a node's look at join)
                return
            self.s.calls.add("Session")  # every stream, as the gRPC server counts calls
            first = self._opening(nonce, raw)
            node = first.node
            self._bind(conn, node.node_index)
            expected = 1
            while True:
                raw = await conn.frames.get()
                if raw is None or conn.over:
                    return
                try:
                    req = pb.SessionRequest.FromString(raw)
                except DecodeError:
                    raise _End(grpc.StatusCode.INVALID_ARGUMENT,
                               "a session message does not parse") from None
                if self.verifier is not None:
                    why = self.verifier.check_message(first.nonce, req)
                    if why:
                        raise _End(grpc.StatusCode.UNAUTHENTICATED, why)
                if req.n != expected:
                    raise _End(grpc.StatusCode.INVALID_ARGUMENT,
                               f"session message {req.n} out of order (expected {expected})")
                expected += 1
                reply = await self._reply(node, req, conn.peer)
                if conn.over:
                    return
                conn.send(reply)
                if conn.transport.get_write_buffer_size() > UNREAD:
                    conn.transport.abort()  # its replies would stay in memory
                    raise _End(grpc.StatusCode.RESOURCE_EXHAUSTED, "the node does not read its "
                               "replies: wait for each reply before the next call")
        except _End as e:
            conn.end(e.code, e.details)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a fault of ours: the node hears of it, we log it
            log.exception("a session stream failed")
            conn.end(grpc.StatusCode.INTERNAL, "the global server failed on this stream (see "
                     "its log)")
        finally:
            self._close(conn)
            if conn.transport is not None:
                conn.transport.close()

    def _opening(self, nonce: bytes, raw: bytes) -> pb.SessionRequest:
        """Frame 0: its MAC on this connection, then the checks of ``session.serve``."""
        mac, opening = raw[:sw.MAC_SIZE], raw[sw.MAC_SIZE:]
        if len(raw) < sw.MAC_SIZE:
            raise _End(grpc.StatusCode.INVALID_ARGUMENT, "a session's opening starts with its "
                       f"{sw.MAC_SIZE}-byte MAC")
        if not sw.opening_ok(self.key, nonce, mac, opening):
            raise _End(grpc.StatusCode.UNAUTHENTICATED, "the session's opening has no valid "
                       "MAC: wrong job secret, or not an lsgd node")
        try:
            first = pb.SessionRequest.FromString(opening)
        except DecodeError:
            first = None
        why = opening_error(first)
        if why:
            raise _End(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            with self.s.cond:
                self.s._check(first.node)
                self.s.coord._node(first.node.node_index, first.node.session, self.s.clock())
        except CoordinatorError as exc:
            raise _End(getattr(grpc.StatusCode, exc.code), str(exc)) from None
        return first

    # ------------------------------------------------------------------ admission
    def _evict(self, old: _Conn, kind: str) -> None:
        self._count("cancelled", f"crowded-{kind}")
        self._end(old, grpc.StatusCode.CANCELLED, "no opening while newer streams came (too "
                  "many streams without an opening)")

    def _full(self) -> str:
        return (f"the global server already has {self.limits.sessions} session streams open "
                "(one per node); try again later")

    def _bind(self, conn: _Conn, index: int) -> None:
        """The stream's opening is checked: it is node ``index``'s; its older one ends. At most
        ``Limits.sessions`` streams are bound (a connection not yet opened counts against its
        host's pending ones: a node's look at the port, at its join, takes no stream's place)."""
        if index not in self._by_node and len(self._by_node) >= self.limits.sessions:
            self._count("refused", "sessions")
            raise _End(grpc.StatusCode.RESOURCE_EXHAUSTED, self._full())
        self._unpend(conn)
        conn.node = index
        old = self._by_node.get(index)
        self._by_node[index] = conn
        if old is not None and old is not conn:
            self._count("cancelled", "replaced")
            self._end(old, grpc.StatusCode.CANCELLED, "replaced by a newer stream of its node")

    def _end(self, conn: _Conn, code: grpc.StatusCode, details: str) -> None:
        """End ``conn`` from another task: its status, and its handler (``_Conn.end``)."""
        conn.end(code, details)
        self._close(conn)

    def _unpend(self, conn: _Conn) -> None:
        self._unchecked.pop(conn, None)
        if conn.node is None and conn.host in self._pending:
            self._pending[conn.host] -= 1
            if not self._pending[conn.host]:
                del self._pending[conn.host]

    def _close(self, conn: _Conn) -> None:
        if conn not in self._open:
            return
        self._open.discard(conn)
        self._unpend(conn)
        if conn.node is not None and self._by_node.get(conn.node) is conn:
            del self._by_node[conn.node]

    def _count(self, what: str, kind: str) -> None:
        admission = self.s.admission
        if admission is not None:
            admission.note(what, kind)

    @property
    def open_sessions(self) -> int:
        return len(self._open)
