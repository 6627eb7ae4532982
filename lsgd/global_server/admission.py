"""Admission to the global server's threads: parameter streams can never starve control calls.

The gRPC server is synchronous: every call in progress holds one thread of its pool until its
handler returns, and a parameter stream waits on its peer (an upload for its header and chunks,
a download for the peer to take each chunk). Without bounds, 50 upload streams that send nothing
held all the threads, heartbeats timed out and every node was dropped (issue 9, item 14).

``Admission`` is a server interceptor that bounds this:

- the pool has ``Limits.threads = streams + control`` threads; parameter streams (``PushParams``,
  ``PullParams``) never take more than ``streams`` of them (more are refused at once with
  RESOURCE_EXHAUSTED), so ``control`` threads always remain for Join, Heartbeat,
  AcquireCredits, ReportRound and Leave;
- streams whose header has not named a node session yet are capped per peer host, streams of one
  session per session, and the long-polls (AcquireCredits, ReportRound, Digest) per
  session: a node makes one call at a time, so its legitimate use is far below the caps;
- ``Session`` streams (one per node: the node loop's credit and round calls) hold a thread each
  for as long as the node is there, from ``sessions`` threads of their own: at most
  ``sessions`` are open; until the servicer has checked a stream's opening message (the node
  and its session) it counts as a stream that has not named a session (capped per host, and
  cancelled without an opening within ``header_wait``); a newer checked stream of a node
  replaces its older one, whatever the session (the older is cancelled);
- a watchdog cancels a stream that waits on its peer too long (no upload header within
  ``header_wait``, no next chunk sent or taken within ``idle``) or lives longer than
  ``lifetime`` (a node's own deadline for a transfer is shorter); the handler's own bounded waits
  (a download waiting for its round) do not count as waiting on the peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

log = logging.getLogger(__name__)

STREAMS = ("PushParams", "PullParams")
POLLS = ("AcquireCredits", "ReportRound", "Digest")  # they hold a thread by design


@dataclass(frozen=True)
class Limits:
    """Caps and time bounds on the server's calls (``for_job`` sizes them from the job)."""

    streams: int  # parameter streams in progress, all peers together
    control: int  # threads beyond ``streams``: parameter streams cannot take them
    pending_per_host: int  # streams from one host that have not named a session yet
    streams_per_session: int  # parameter streams of one node session
    polls_per_session: int  # AcquireCredits / ReportRound calls in progress of one node session
    sessions: int = 64  # Session streams open, all nodes together (a thread each)
    header_wait: float = 5.0  # seconds an upload may take to send its header
    idle: float = 10.0  # seconds a stream may wait on its peer for the next chunk (either way)
    lifetime: float = 45.0  # seconds any parameter stream may last

    @property
    def threads(self) -> int:
        """The size of the server's thread pool."""
        return self.streams + self.control + self.sessions

    @classmethod
    def for_job(cls, num_groups: int, round_timeout: float, **overrides: float) -> "Limits":
        """Limits for a job of ``num_groups`` nodes.

        A node makes one call at a time from its loop (a long-poll, or one transfer) beside its
        heartbeats, so control needs about two threads per node plus room for quick calls;
        streams get one per node and room for the ones a node abandons on a deadline. A node
        gives a transfer ``round_timeout + 10`` seconds (``global_client.RPC_TIMEOUT``): a
        stream may live a little longer.
        """
        values: dict = dict(streams=2 * num_groups + 4, control=3 * num_groups + 16,
                            pending_per_host=num_groups + 2, streams_per_session=2,
                            polls_per_session=2, sessions=2 * num_groups + 8,
                            lifetime=round_timeout + 15.0)
        return cls(**(values | overrides))


@dataclass(eq=False)
class _Stream:
    context: grpc.ServicerContext
    method: str
    host: str
    started: float
    session: tuple[int, int] | None = None  # (node index, session) once its header named one
    waiting_since: float | None = None  # waiting on the peer since (None: not now)
    cancelled: str = ""  # why the watchdog cancelled it (or a newer stream replaced it)
    closed: bool = False


def _host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", "unix:...")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


class Admission(grpc.ServerInterceptor):
    """Caps parameter streams and long-polls, and cancels streams that wait on their peer too long.

    Counts of refusals and cancellations are in ``refused`` and ``cancelled`` (by reason).
    """

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.refused: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()
        self._pending: Counter[str] = Counter()  # host -> streams without a session yet
        self._sessions: Counter[tuple[int, int]] = Counter()
        self._polls: Counter[tuple[int, int]] = Counter()
        self._by_node: dict[int, _Stream] = {}  # each node's checked Session stream
        self._by_context: dict[object, _Stream] = {}  # open Session streams by their context
        self._open_sessions = 0
        self._watchdog: threading.Thread | None = None
        self._logged: dict[str, float] = {}  # reason -> last time logged (rate limit)

    @property
    def open_streams(self) -> int:
        """Parameter streams in progress (``Session`` streams are ``open_sessions``)."""
        with self._lock:
            return len(self._streams) - self._open_sessions

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return self._open_sessions

    # ------------------------------------------------------------------ interceptor
    def intercept_service(self, continuation, details):  # noqa: ANN001 - grpc API
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if method == "PushParams" and handler.request_streaming and not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(self._upload(handler.stream_unary), **kw)
        if method == "PullParams" and handler.response_streaming and not handler.request_streaming:
            return grpc.unary_stream_rpc_method_handler(self._download(handler.unary_stream), **kw)
        if method == "Session" and handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._session(handler.stream_stream), **kw)
        if method in POLLS and not handler.request_streaming and not handler.response_streaming:
            return grpc.unary_unary_rpc_method_handler(self._poll(handler.unary_unary), **kw)
        return handler

    def _upload(self, behavior: Callable) -> Callable:
        def upload(request_iterator, context):  # noqa: ANN001 - grpc API
            stream = self._open(context, "PushParams")
            try:
                requests = self._watched(stream, request_iterator)
                first = next(requests, None)
                if first is not None and first.HasField("header"):
                    self._bind(stream, first.header.node, context)
                head = [] if first is None else [first]
                return behavior(_chain(head, requests), context)
            finally:
                self._close(stream)

        return upload

    def _download(self, behavior: Callable) -> Callable:
        def download(request, context):  # noqa: ANN001 - grpc API
            stream = self._open(context, "PullParams")
            try:
                self._bind(stream, request.node, context)
                for response in behavior(request, context):
                    stream.waiting_since = self.clock()  # until the peer has taken it
                    yield response
                    stream.waiting_since = None
            finally:
                self._close(stream)

        return download

    def _session(self, behavior: Callable) -> Callable:
        def session(request_iterator, context):  # noqa: ANN001 - grpc API
            stream = self._open(context, "Session")
            try:
                requests = iter(request_iterator)
                stream.waiting_since = self.clock()  # for its opening message (header_wait)
                first = next(requests, None)
                stream.waiting_since = None
                yield from behavior(_chain([] if first is None else [first], requests), context)
            finally:
                self._close(stream)

        return session

    def bind_session(self, context: grpc.ServicerContext, index: int, session: int) -> None:
        """The servicer checked this stream's opening: it is node ``index``'s (``session``).
        The node's older stream, if any, is cancelled: a node has one."""
        with self._lock:
            stream = self._by_context.get(context)
            if stream is None or stream.closed or stream.session is not None:
                return
            self._unbind(stream)  # off its host's count of streams without a session
            stream.session = (index, session)
            old = self._by_node.get(index)
            self._by_node[index] = stream
            if old is not None:
                old.cancelled = "replaced by a newer stream of its node"
                self.cancelled["replaced"] += 1
        if old is not None:
            old.context.cancel()

    def _poll(self, behavior: Callable) -> Callable:
        def poll(request, context):  # noqa: ANN001 - grpc API
            key = (request.node.node_index, request.node.session)
            with self._lock:
                busy = self._polls[key] >= self.limits.polls_per_session
                if not busy:
                    self._polls[key] += 1
            if busy:
                self._refuse(context, "polls", f"node {key[0]} already has "
                             f"{self.limits.polls_per_session} credit, round or digest calls waiting; "
                             "a node makes one at a time")
            try:
                return behavior(request, context)
            finally:
                with self._lock:
                    self._polls[key] -= 1
                    if not self._polls[key]:
                        del self._polls[key]

        return poll

    # ------------------------------------------------------------------ bookkeeping
    def _open(self, context: grpc.ServicerContext, method: str) -> _Stream:
        host = _host(context.peer() or "")
        lim = self.limits
        with self._lock:
            if method == "Session" and self._open_sessions >= lim.sessions:
                reason = ("sessions", f"the global server already has {lim.sessions} session "
                          "streams open (one per node); try again later")
            elif method != "Session" and len(self._streams) - self._open_sessions >= lim.streams:
                reason = ("streams", f"the global server already has {lim.streams} parameter "
                          "streams open; try again later")
            elif self._pending[host] >= lim.pending_per_host:
                reason = ("host", f"{host} already has {lim.pending_per_host} streams open "
                          "that have not named a node session")
            else:
                stream = _Stream(context, method, host, self.clock())
                self._streams.add(stream)
                self._pending[host] += 1
                if method == "Session":
                    self._open_sessions += 1
                    self._by_context[context] = stream
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                      name="lsgd-stream-watchdog")
                    self._watchdog.start()
                return stream
        self._refuse(context, *reason)
        raise AssertionError("unreachable")  # _refuse aborts the call

    def _bind(self, stream: _Stream, node, context: grpc.ServicerContext) -> None:  # noqa: ANN001
        key = (node.node_index, node.session)
        with self._lock:
            full = self._sessions[key] >= self.limits.streams_per_session
            if not full:
                self._unbind(stream)
                stream.session = key
                self._sessions[key] += 1
        if full:
            self._refuse(context, "session", f"node {key[0]} already has "
                         f"{self.limits.streams_per_session} parameter streams open")

    def _unbind(self, stream: _Stream) -> None:
        """Take ``stream`` off its host's or its session's count (lock held)."""
        if stream.method == "Session" and stream.session is not None:
            return  # a checked Session stream is in ``_by_node`` only
        counts, key = ((self._pending, stream.host) if stream.session is None
                       else (self._sessions, stream.session))
        counts[key] -= 1
        if not counts[key]:
            del counts[key]

    def _close(self, stream: _Stream) -> None:
        with self._lock:
            if stream.closed:
                return
            stream.closed = True
            self._streams.discard(stream)
            self._unbind(stream)
            if stream.method == "Session":
                self._open_sessions -= 1
                del self._by_context[stream.context]
                if stream.session is not None and self._by_node.get(stream.session[0]) is stream:
                    del self._by_node[stream.session[0]]

    def _refuse(self, context: grpc.ServicerContext, kind: str, message: str) -> None:
        with self._lock:
            self.refused[kind] += 1
        self._log(kind, "refused a call from %s: %s", context.peer(), message)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def note(self, what: str, kind: str) -> None:
        """Count a refusal (``what`` = "refused") or a cancellation ("cancelled") of ``kind``
        made elsewhere (the asyncio session server's own admission, ``aio_session.py``)."""
        with self._lock:
            (self.refused if what == "refused" else self.cancelled)[kind] += 1
        if kind != "replaced":  # a node's newer stream: routine, as on the synchronous server
            self._log(kind, "%s a session stream: %s", what, kind)

    def _log(self, kind: str, fmt: str, *args: object) -> None:
        """A warning, at most one per kind every 10 s (a flood must not flood the log)."""
        now = self.clock()
        with self._lock:
            if now - self._logged.get(kind, -1e9) < 10.0:
                return
            self._logged[kind] = now
        log.warning(fmt, *args)

    def _watched(self, stream: _Stream, requests: Iterator) -> Iterator:
        """``requests``, marking the time spent waiting for each one."""
        while True:
            stream.waiting_since = self.clock()
            try:
                request = next(requests)
            except StopIteration:
                return
            finally:
                stream.waiting_since = None
            yield request

    # ------------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        lim = self.limits
        step = max(0.01, min(0.25, lim.header_wait / 4, lim.idle / 4))
        while True:
            time.sleep(step)
            now = self.clock()
            expired = []
            with self._lock:
                if not self._streams:
                    self._watchdog = None  # the next stream starts another
                    return
                for s in self._streams:
                    if s.cancelled:
                        continue
                    since = s.waiting_since
                    waited = 0.0 if since is None else now - since
                    if s.session is None and s.method != "PullParams" and waited > lim.header_wait:
                        kind, s.cancelled = "header", f"no opening message within {lim.header_wait:g} s"
                    elif s.method == "Session":  # open for the node's whole run, idle between calls
                        continue
                    elif now - s.started > lim.lifetime:
                        kind, s.cancelled = "lifetime", f"open for more than {lim.lifetime:g} s"
                    elif waited > lim.idle:
                        kind, s.cancelled = "idle", f"waited more than {lim.idle:g} s for its peer"
                    else:
                        continue
                    expired.append(s)
                    self.cancelled[kind] += 1
            for s in expired:
                self._log("cancel", "cancelled a %s stream from %s: %s", s.method,
                          s.context.peer(), s.cancelled)
                s.context.cancel()  # wakes its handler, which gives its thread back


def _chain(head: list, rest: Iterator) -> Iterator:
    yield from head
    yield from rest
