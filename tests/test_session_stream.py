"""The Session stream (issue 15): a node's credit and round calls on one stream per session.

A refused call refuses that call and the stream goes on; a forged, altered, replayed or
reordered message ends the stream and changes nothing; a reply that does not come within the
call's deadline is a DEADLINE_EXCEEDED, and the next call opens a new stream.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server import session_stream
from lsgd.plane import session_wire
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.security import Security
from lsgd.signing import ACQUIRE_FIELD, derive_key, session_mac

SECRET = "s" * 40


@pytest.fixture(params=["sync", "aio"])
def transport(request):
    """Where the streams go: the synchronous server's own port, or the asyncio session
    server's (``aio_session.py``); every behaviour here holds on both."""
    return request.param


@pytest.fixture(params=["plain", "secret"])
def server(request, transport):
    security = Security(secret=SECRET) if request.param == "secret" else Security()
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="lsgd")
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer, security=security,
                              session_address="127.0.0.1:0" if transport == "aio" else None)
    addr = f"127.0.0.1:{port}"
    yield Served(servicer, addr, security, srv)
    srv.stop(grace=0.5).wait(5)


class Served:
    def __init__(self, servicer, addr, security, srv) -> None:
        self.servicer, self.addr, self.security, self.srv = servicer, addr, security, srv
        # where a hand-driven stream goes: the session port where there is one
        port = servicer.session_port
        self.streams = f"127.0.0.1:{port}" if port else addr

    def __iter__(self):
        return iter((self.servicer, self.addr, self.security))

    def raw(self, opening: pb.SessionRequest):
        """A hand-driven stream opened with ``opening`` where the node's streams go: (send,
        replies, closer); ``send.put(None)`` ends it."""
        if self.servicer.session_port:
            return _raw_socket(self.streams, self.security, opening)
        return _raw_stream(self.addr, self.security, opening)

    @property
    def open_sessions(self) -> int:
        sessions = self.srv.sessions
        return sessions.open_sessions if sessions else self.servicer.admission.open_sessions


def _joined(addr: str, security: Security, node: int = 0) -> GlobalClient:
    c = GlobalClient(addr, "job", node, round_timeout=5.0, security=security)
    c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
    return c


def _acquire(c: GlobalClient, consumed: int = 0, want: int = 4):
    return c.acquire(consumed=consumed, late=0, released=0, want=want, last_round_seen=0,
                     max_wait=0)


def test_the_loops_calls_share_one_stream_and_a_refused_call_does_not_end_it(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    g = _acquire(a).grant
    assert g > 0
    with pytest.raises(grpc.RpcError) as e:  # a report of a round never opened: refused
        a.report_round(99, None, 2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.coord.done == 0 and servicer.coord.nodes[0].outstanding == g
    assert _acquire(a, consumed=g).grant >= 0  # the same stream answers the next call
    assert servicer.coord.done == g
    _acquire(b)
    counts = servicer.calls.counts
    assert counts["Session"] == 2  # one stream per node, however many calls
    assert counts["AcquireCredits"] == 3 and counts["ReportRound"] == 0
    assert servicer.stats.copy()[0] == {("ReportRound", "INVALID_ARGUMENT"): 1}
    a.close(), b.close()


def test_a_new_session_opens_a_new_stream_and_a_stale_one_is_refused(server):
    servicer, addr, security = server
    a = _joined(addr, security, 0)
    _acquire(a)
    forged = GlobalClient(addr, "job", 0, round_timeout=5.0, security=security)
    forged.session = a.session + 1  # a stale or forged session: its stream cannot open
    with pytest.raises(grpc.RpcError) as e:
        _acquire(forged)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    first = a._stream
    _acquire(a)  # the real session's stream is untouched
    assert a._stream is first and servicer.calls.counts["Session"] == 2
    a.session = 0  # as after a new Join: the next call opens a stream for the new session
    with pytest.raises(grpc.RpcError):
        _acquire(a)
    assert a._stream is not first and first.broken
    assert servicer.calls.counts["Session"] == 3
    a.close(), forged.close()


def _raw_stream(addr: str, security: Security, opening: pb.SessionRequest):
    """A hand-driven Session stream opened with ``opening``: (send, replies, channel). The
    opening is queued first: the channel signs the first message before the call starts."""
    channel = security.channel(addr, [])
    out: queue.SimpleQueue = queue.SimpleQueue()
    out.put(opening)

    def requests():
        while (m := out.get()) is not None:
            yield m

    replies = pb_grpc.GlobalServerStub(channel).Session(requests())
    return out, replies, channel


class _Sender:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def put(self, msg: pb.SessionRequest | None) -> None:
        if msg is None:
            self.sock.close()
            return
        try:
            self.sock.sendall(session_wire.frame(msg.SerializeToString()))
        except OSError:
            pass  # the server ended the stream: the next read says how


def _replies(sock: socket.socket):
    """The replies on a session-port connection; its end raises the status (a ``CallError``)."""
    from lsgd.local_server.session_stream import CODES, CallError

    def read(n: int) -> bytes:
        out = b""
        while len(out) < n:
            part = sock.recv(n - len(out))
            if not part:
                raise CallError(grpc.StatusCode.UNAVAILABLE, "the connection closed")
            out += part
        return out

    while True:
        reply = pb.SessionReply.FromString(read(int.from_bytes(read(4), "big")))
        if reply.n == 0 and reply.code:
            raise CallError(CODES[reply.code], reply.details)
        yield reply


def _raw_socket(addr: str, security: Security, opening: pb.SessionRequest, mac: bytes | None = None):
    """A hand-driven stream on the session port (``session_wire.py``): (send, replies, closer),
    as ``_raw_stream``; the opening's MAC is made with the job secret unless ``mac`` is given."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    hello = b""
    while len(hello) < session_wire.HELLO_SIZE:
        part = sock.recv(session_wire.HELLO_SIZE - len(hello))
        assert part, "the server closed the connection before its hello"
        hello += part
    body = opening.SerializeToString()
    key = derive_key(security.secret) if security.secret else None
    if mac is None:
        mac = session_wire.opening_mac(key, session_wire.read_hello(hello), body)
    sock.sendall(session_wire.frame(mac + body))
    return _Sender(sock), _replies(sock), sock


def _acquire_body(node: pb.NodeId, seq: int, consumed: int = 0) -> bytes:
    return pb.AcquireCreditsRequest(node=node, consumed=consumed, want=4, seq=seq).SerializeToString()


@pytest.mark.parametrize("server", ["secret"], indirect=True)  # MACs need a job secret
def test_forged_replayed_reordered_or_moved_messages_end_the_stream_and_change_nothing(server):
    servicer, addr, security = server
    c, other = _joined(addr, security, 0), _joined(addr, security, 1)  # the job starts
    node = c._node()
    key = derive_key(SECRET)
    cases = {
        "no mac": lambda nonce, n, body: b"",
        "wrong secret": lambda nonce, n, body: session_mac(derive_key("w" * 40), nonce, n,
                                                           ACQUIRE_FIELD, body),
        "another stream's": lambda nonce, n, body: session_mac(key, os.urandom(16), n,
                                                               ACQUIRE_FIELD, body),
        "another number's": lambda nonce, n, body: session_mac(key, nonce, n + 1,
                                                               ACQUIRE_FIELD, body),
        "another call's": lambda nonce, n, body: session_mac(key, nonce, n, ACQUIRE_FIELD,
                                                             _acquire_body(node, 1, 3)),
    }
    for why, mac in cases.items():
        nonce = os.urandom(16)
        out, replies, ch = server.raw(pb.SessionRequest(n=0, node=node, nonce=nonce))
        body = _acquire_body(node, 1)
        out.put(pb.SessionRequest(n=1, acquire=body, mac=mac(nonce, 1, body)))
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
        assert "MAC" in e.value.details(), why
        out.put(None)
        ch.close()
    assert servicer.coord.nodes[0].outstanding == 0 and servicer.coord.done == 0
    # A genuine message sent twice: the copy's number is out of order.
    nonce = os.urandom(16)
    out, replies, ch = server.raw(pb.SessionRequest(n=0, node=node, nonce=nonce))
    body = _acquire_body(node, 1)
    msg = pb.SessionRequest(n=1, acquire=body, mac=session_mac(key, nonce, 1, ACQUIRE_FIELD, body))
    out.put(msg)
    first = next(replies)
    assert first.code == 0 and first.acquire.grant > 0
    out.put(msg)
    with pytest.raises(grpc.RpcError) as e:
        next(replies)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in e.value.details()
    assert servicer.coord.nodes[0].outstanding == first.acquire.grant
    out.put(None)
    ch.close()
    c.close(), other.close()


def test_bad_openings_and_calls_for_another_node_are_refused(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    key = derive_key(SECRET) if security.secret else None
    for opening in (pb.SessionRequest(n=0, node=a._node()),  # no nonce
                    pb.SessionRequest(n=1, node=a._node(), nonce=os.urandom(16))):
        out, replies, ch = server.raw(opening)
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        out.put(None)
        ch.close()
    # Node 0's stream carrying node 1's call: that call is refused, the stream goes on.
    nonce = os.urandom(16)
    out, replies, ch = server.raw(pb.SessionRequest(n=0, node=a._node(),
                                                                     nonce=nonce))
    for n, who in ((1, b), (2, a)):
        body = _acquire_body(who._node(), 1)
        mac = session_mac(key, nonce, n, ACQUIRE_FIELD, body) if key else b""
        out.put(pb.SessionRequest(n=n, acquire=body, mac=mac))
    r1, r2 = next(replies), next(replies)
    assert r1.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "node 1" in r1.details
    assert r2.code == 0 and r2.acquire.grant > 0
    assert servicer.coord.nodes[1].outstanding == 0
    out.put(None)
    ch.close()
    a.close(), b.close()


def test_a_newer_stream_of_a_node_replaces_its_older_one(server):
    servicer, addr, security = server
    a = _joined(addr, security, 0)
    _acquire(a)
    old = a._stream
    a._stream = None  # as a node whose stream the network lost would: it opens another
    _acquire(a)
    deadline = time.monotonic() + 5
    while servicer.admission.cancelled["replaced"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servicer.admission.cancelled["replaced"] == 1
    with pytest.raises(grpc.RpcError):  # the replaced stream is over
        old.call("acquire", _acquire_body(a._node(), a.last_seq + 1), timeout=5)
    old.close()
    _acquire(a)
    assert server.open_sessions == 1
    # The node starts again as a new session (its process restarted): the old session's
    # stream is cancelled too, so a node holds one thread however often it comes back.
    restarted = GlobalClient(addr, "job", 0, round_timeout=5.0, security=security)
    restarted.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5,
                   replaces=a.session)
    _acquire(restarted)
    deadline = time.monotonic() + 5
    while servicer.admission.cancelled["replaced"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servicer.admission.cancelled["replaced"] == 2
    assert server.open_sessions == 1
    a.close(), restarted.close()


class _Silent(pb_grpc.GlobalServerServicer):
    """A server that takes session messages and never answers."""

    def Session(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return iter(())


def test_an_overdue_reply_is_deadline_exceeded_and_the_next_call_opens_a_new_stream():
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_GlobalServerServicer_to_server(_Silent(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=1.0)
        c.session = 7
        session_stream_timeout = 0.4
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c._on_stream("acquire", pb.AcquireCreditsRequest(node=c._node()),
                         session_stream_timeout)
        took = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert session_stream_timeout <= took < session_stream_timeout + 1.0
        first = c._stream
        assert first.broken
        with pytest.raises(grpc.RpcError):
            c._on_stream("acquire", pb.AcquireCreditsRequest(node=c._node()), 0.2)
        assert c._stream is not first
        # Closing the client (a node stopping) ends a call in progress at once.
        errors = []

        def waiting_call():
            try:
                c._on_stream("acquire", pb.AcquireCreditsRequest(node=c._node()), 30.0)
            except grpc.RpcError as exc:
                errors.append(exc.code())

        t = threading.Thread(target=waiting_call)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        c.close()
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 2.0
        assert errors == [grpc.StatusCode.CANCELLED]
        # The watchdog's thread ends once nothing waits.
        deadline = time.monotonic() + 2
        while session_stream.WATCHDOG._thread is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_stream.WATCHDOG._thread is None
        assert not [t for t in threading.enumerate() if t.name == "lsgd-session-watchdog"]
    finally:
        srv.stop(0).wait(5)


def test_session_streams_are_capped_and_a_stream_without_an_opening_is_cancelled(transport):
    from lsgd.global_server.admission import Limits

    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="lsgd")
    servicer = build_servicer(config)
    limits = Limits.for_job(2, config.round_timeout, sessions=1, header_wait=0.5)
    srv, port = create_server("127.0.0.1:0", servicer, limits=limits,
                              session_address="127.0.0.1:0" if transport == "aio" else None)
    addr = f"127.0.0.1:{port}"
    served = Served(servicer, addr, Security(), srv)
    try:
        a, b = _joined(addr, Security(), 0), _joined(addr, Security(), 1)
        _acquire(a)
        with pytest.raises(grpc.RpcError) as e:  # the one session stream is a's
            _acquire(b)
        # UNAVAILABLE: the node loop detaches and tries again, as for a server it cannot reach
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refused a session stream" in e.value.details() and "session streams" in e.value.details()
        a.close()
        deadline = time.monotonic() + 5
        while served.open_sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        # As the node loop does after a failed call: reattach, naming the unanswered request.
        b.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5,
               resume=True, unanswered=(b.last_seq, 0))
        _acquire(b)  # a's stream was given back: b's opens
        assert b._session_port == servicer.session_port  # a full server is no reason to leave
        b.close()
        # A stream that never sends its opening message holds its place for header_wait only.
        t0 = time.monotonic()
        if transport == "aio":
            sock = socket.create_connection(("127.0.0.1", servicer.session_port), timeout=10)
            replies = _replies(sock)
            sock.recv(session_wire.HELLO_SIZE)
        else:
            channel = grpc.insecure_channel(served.streams)
            silent: queue.SimpleQueue = queue.SimpleQueue()
            replies = pb_grpc.GlobalServerStub(channel).Session(iter(silent.get, None))
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 3.0
        assert servicer.admission.cancelled["header"] == 1
        if transport == "aio":
            sock.close()
        else:
            silent.put(None)
            channel.close()
    finally:
        srv.stop(grace=0.5).wait(5)


@pytest.mark.parametrize("server", ["secret"], indirect=True)
def test_a_digest_question_rides_the_stream_under_its_own_mac(server):
    """PLANE=chain's Digest calls go on the node's stream, like its credit and round calls; a
    MAC made for another call field does not pass for a digest."""
    from lsgd.signing import DIGEST_FIELD

    servicer, addr, security = server
    servicer.digest_wait = 0.05
    c, other = _joined(addr, security, 0), _joined(addr, security, 1)
    assert c.digest(3) == b""  # no leader route here: nothing registered
    assert c._stream is not None and server.open_sessions == 1
    assert servicer.calls.counts["Digest"] == 1
    node, key, nonce = c._node(), derive_key(SECRET), os.urandom(16)
    body = pb.DigestRequest(node=node, round_id=3).SerializeToString()
    out, replies, ch = server.raw(pb.SessionRequest(n=0, node=node, nonce=nonce))
    out.put(pb.SessionRequest(n=1, digest=body, mac=session_mac(key, nonce, 1, ACQUIRE_FIELD, body)))
    with pytest.raises(grpc.RpcError) as e:
        next(replies)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "MAC" in e.value.details()
    out.put(None)
    ch.close()
    nonce = os.urandom(16)
    out, replies, ch = server.raw(pb.SessionRequest(n=0, node=node, nonce=nonce))
    out.put(pb.SessionRequest(n=1, digest=body, mac=session_mac(key, nonce, 1, DIGEST_FIELD, body)))
    reply = next(replies)
    assert reply.code == 0 and reply.HasField("digest") and reply.digest.sha256 == b""
    out.put(None)
    ch.close()
    c.close(), other.close()
