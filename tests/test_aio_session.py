"""The session port: the nodes' session streams on a plain socket, on one event loop (issue 15,
design-scale.md steps 4 and 6).

``tests/test_session_stream.py`` runs the stream's behaviours on both servers; this file covers
what only the session port has: the nodes find it through Join, a long-poll on it wakes on the
servicer's news (not on a timer), an opening's MAC is good on its own connection only, a node
that cannot reach the port uses PORT, garbage and fuzzed frames change nothing, and stopping
the server ends the open streams with a status the node understands.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.rules.base import RoundKind
from lsgd.security import Security
from lsgd.plane import session_wire
from lsgd.signing import ACQUIRE_FIELD, derive_key, session_mac
from tests.test_session_stream import _replies

SECRET = "a" * 40


def _server(security: Security | None = None, **config):
    cfg = JobConfig(**({"num_groups": 2, "workers": 2, "job_id": "job", "algorithm": "lsgd",
                        "l_comm": 4, "g_comm": 8} | config))
    servicer = build_servicer(cfg)
    srv, port = create_server("127.0.0.1:0", servicer, security=security,
                              session_address="127.0.0.1:0")
    return servicer, srv, f"127.0.0.1:{port}"


def _joined(addr: str, index: int, security: Security | None = None) -> GlobalClient:
    c = GlobalClient(addr, "job", index, round_timeout=5.0, security=security)
    c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
    return c


def test_nodes_learn_the_session_port_at_join_and_their_calls_go_there():
    servicer, srv, addr = _server()
    try:
        assert servicer.session_port and str(servicer.session_port) != addr.rsplit(":", 1)[1]
        a, b = _joined(addr, 0), _joined(addr, 1)
        assert a._session_port == servicer.session_port
        g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant > 0 and servicer.coord.nodes[0].outstanding == g.grant
        assert srv.sessions.open_sessions == 1 and srv.server is not None
        assert servicer.admission.open_sessions == 0  # none on the synchronous server
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_a_round_barrier_on_the_loop_is_answered_when_the_last_report_closes_it(monkeypatch):
    """Both nodes use their credits up to the global round; node 0's report waits on the
    loop, and node 1's report ends the wait: the servicer's news, not a timer. (The barrier's
    own tick is made longer than the round here, so a wait that missed the news would last
    until the round's deadline.)"""
    from lsgd.global_server import polls

    monkeypatch.setattr(polls, "BARRIER_TICK", 60.0)
    servicer, srv, addr = _server(round_timeout=10.0)
    try:
        nodes = [_joined(addr, 0), _joined(addr, 1)]
        answers: dict[int, pb.ReportRoundResponse] = {}
        rounds: dict[int, int] = {}

        def run(c: GlobalClient) -> None:
            consumed, seen = 0, 0
            for _ in range(50):
                g = c.acquire(consumed=consumed, late=0, released=0, want=64,
                              last_round_seen=seen, max_wait=0.5)
                consumed = g.grant
                if g.round_id > seen and g.round_kind == int(RoundKind.GLOBAL):
                    rounds[c.node_index] = g.round_id
                    answers[c.node_index] = c.report_round(g.round_id, None, 2)
                    return
                seen = max(seen, g.round_id)

        t0 = threading.Thread(target=run, args=(nodes[0],))
        t0.start()
        deadline = time.monotonic() + 10
        while 0 not in rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 in rounds  # node 0 now waits in its barrier (node 1 has not reported)
        time.sleep(0.2)
        assert 0 not in answers
        started = time.monotonic()
        run(nodes[1])
        t0.join(5)
        waited = time.monotonic() - started
        assert answers[0].participants == answers[1].participants == 4
        assert waited < 5.0, f"the barrier took {waited:.2f} s: it missed the news"
        for c in nodes:
            c.close()
    finally:
        srv.stop(0.5).wait(5)


def _hello(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < session_wire.HELLO_SIZE:
        part = sock.recv(session_wire.HELLO_SIZE - len(data))
        assert part, "the server closed the connection before its hello"
        data += part
    return session_wire.read_hello(data)


def test_an_opening_needs_the_secret_and_its_mac_is_good_on_its_connection_only():
    security = Security(secret=SECRET)
    servicer, srv, addr = _server(security)
    port = servicer.session_port
    try:
        a, b = _joined(addr, 0, security), _joined(addr, 1, security)
        opening = pb.SessionRequest(n=0, node=a._node(), nonce=b"n" * 16)
        body = opening.SerializeToString()
        key = derive_key(SECRET)
        call = pb.AcquireCreditsRequest(node=a._node(), want=4, seq=1).SerializeToString()
        first = pb.SessionRequest(n=1, acquire=call,
                                  mac=session_mac(key, b"n" * 16, 1, ACQUIRE_FIELD, call))
        for mac in (bytes(32), None):  # none, and the wrong secret's
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                nonce = _hello(sock)
                mac = mac or session_wire.opening_mac(derive_key("w" * 40), nonce, body)
                sock.sendall(session_wire.frame(mac + body))
                with pytest.raises(grpc.RpcError) as e:
                    next(_replies(sock))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "secret" in e.value.details()
        # A genuine opening and its first message, then both again on another connection:
        # that connection's hello had another nonce, so the opening is refused.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            genuine = session_wire.opening_mac(key, _hello(sock), body)
            sock.sendall(session_wire.frame(genuine + body))
            sock.sendall(session_wire.frame(first.SerializeToString()))
            assert next(_replies(sock)).acquire.grant > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            _hello(sock)
            sock.sendall(session_wire.frame(genuine + body))
            sock.sendall(session_wire.frame(first.SerializeToString()))
            with pytest.raises(grpc.RpcError) as e:
                next(_replies(sock))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.coord.nodes[0].outstanding > 0 and servicer.coord.done == 0
        assert servicer.stats.copy()[0] == {("Session", "UNAUTHENTICATED"): 3}
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


class _Mute(threading.Thread):
    """A session port that says hello to the first connection (a node's look at it, at its
    join) and is silent on every later one."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self.conns:
                conn.sendall(session_wire.hello()[0])
            self.conns.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_node_that_cannot_reach_the_session_port_uses_port_and_says_so(caplog, monkeypatch):
    from lsgd.local_server import global_client

    monkeypatch.setattr(global_client, "PORT_PROBE", 1.0)
    servicer, srv, addr = _server()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    silent = _Mute()
    silent.start()
    mute = silent.port
    try:
        # 1. Nothing listens there: the join's probe finds out (within PORT_PROBE), once.
        servicer.session_port = closed
        with caplog.at_level(logging.WARNING):
            a, b = _joined(addr, 0), _joined(addr, 1)
        lines = [r.getMessage() for r in caplog.records if "session port" in r.getMessage()]
        assert len(lines) == 2 and str(closed) in lines[0] and addr in lines[0]
        assert a._session_port == 0
        g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant > 0 and servicer.admission.open_sessions == 1  # on PORT
        a.close(), b.close()
        # 2. It answered the join's look, then no hello: nothing was sent there, so the first
        # call goes to PORT (after the hello's wait), and so does every later one.
        caplog.clear()
        monkeypatch.setattr(global_client, "RPC_TIMEOUT", 1.0)
        srv.stop(0.5).wait(5)
        servicer, srv, addr = _server()  # a job of its own
        servicer.session_port = mute
        c = _joined(addr, 0)
        assert c._session_port == mute
        with caplog.at_level(logging.WARNING):
            g = c.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant >= 0 and c._session_port == 0 and servicer.admission.open_sessions == 1
        lines = [r.getMessage() for r in caplog.records if "session port" in r.getMessage()]
        assert len(lines) == 1 and str(mute) in lines[0] and "no hello" in lines[0]
        assert c._unreachable == (c.epoch, mute)  # a later join to this server stays on PORT
        c.acquire(consumed=g.grant, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert c._session_port == 0 and len(silent.conns) == 2  # the look, and one call
        c.close()
    finally:
        silent.stop()
        srv.stop(0.5).wait(5)


def test_a_session_port_lost_mid_job_costs_no_call_and_a_server_gone_is_no_port_problem(caplog):
    servicer, srv, addr = _server()
    with socket.socket() as s:  # a port nothing listens on (the session port "lost")
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    try:
        a, b = _joined(addr, 0), _joined(addr, 1)
        a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        a._end_stream()
        with a._stream_lock:
            a._use_session_port(closed)  # its next stream finds nothing there
        with caplog.at_level(logging.WARNING):
            g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant >= 0 and a._session_port == 0  # answered on PORT: no reattach needed
        assert len([r for r in caplog.records if "session port" in r.getMessage()]) == 1
        a.close(), b.close()
        # The whole server goes away (a restart): the node does not blame the session port.
        servicer2, srv2, addr2 = _server()
        d, e = _joined(addr2, 0), _joined(addr2, 1)
        d.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        port = d._session_port
        srv2.stop(0).wait(5)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(grpc.RpcError) as err:
                d.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert d._session_port == port and not [
            r for r in caplog.records if "session port" in r.getMessage()]
        # A restarted server answers on PORT before this node reattached, its session port not
        # there yet: the node does not blame that port either (it did, once the first PORT
        # answered: a new-user try saw the warning after a restart), and reattaches.
        d._end_stream()
        cfg = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="lsgd", l_comm=4, g_comm=8)
        srv3, _ = create_server(addr2, build_servicer(cfg))  # a new epoch, the same PORT
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                with pytest.raises(grpc.RpcError) as err:
                    d.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0,
                              max_wait=0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert d._session_port == port and not [
                r for r in caplog.records if "session port" in r.getMessage()]
        finally:
            srv3.stop(0).wait(5)
        d.close(), e.close()
    finally:
        srv.stop(0.5).wait(5)


def test_stopping_the_server_ends_open_streams_with_unavailable():
    servicer, srv, addr = _server()
    a, b = _joined(addr, 0), _joined(addr, 1)
    a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
    stream = a._stream
    srv.stop(0.5).wait(5)
    assert not any(t.name == "lsgd-session-server" for t in threading.enumerate())
    with pytest.raises(grpc.RpcError) as e:
        stream.call("acquire", pb.AcquireCreditsRequest(node=a._node(), seq=2).SerializeToString(),
                    timeout=5)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    a.close(), b.close()


def _stream_of(port: int, first: bytes, rest: list[bytes], frame_first: bool = True):
    """Send ``first`` (framed, unless not ``frame_first``) and ``rest`` as frames; the replies
    until the stream ends (its status raised as a ``grpc.RpcError``) or 5 s pass."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        _hello(sock)
        try:
            sock.sendall(session_wire.frame(first) if frame_first else first)
            for m in rest:
                sock.sendall(session_wire.frame(m))
        except OSError:
            pass  # ended already: the status says why
        replies = []
        try:
            for reply in _replies(sock):
                replies.append(reply)
                if len(replies) == len(rest):
                    break
        except socket.timeout:
            pass  # waiting for a message that never came (a truncated frame)
        return replies


def test_garbage_and_fuzzed_messages_on_the_session_port_get_a_status_and_change_nothing():
    """Raw bytes on the port, and streams of arbitrary frames (truncated, oversized, several
    calls, none, numbers out of order, calls that do not parse): each gets a reply or a status,
    no refused call changes the state, and a real node is served afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from lsgd.wire import SMALL_VECTOR

    servicer, srv, addr = _server()
    port = servicer.session_port
    try:
        a, b = _joined(addr, 0), _joined(addr, 1)
        for junk in (b"\x00" * 100, b"GET / HTTP/1.1\r\n\r\n",
                     b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(junk)
        opening = bytes(32) + pb.SessionRequest(n=0, node=a._node(),
                                                nonce=b"x" * 16).SerializeToString()
        body = st.one_of(st.binary(max_size=64), st.just(b"\x0a\xff\xff\xff\x0f"),
                         st.builds(lambda s: pb.AcquireCreditsRequest(
                             node=pb.NodeId(job_id="job", node_index=s % 3, session=s),
                             consumed=s, want=4).SerializeToString(), st.integers(0, 2**63)))
        message = st.one_of(
            st.binary(max_size=80),
            st.builds(lambda n, f, x: pb.SessionRequest(n=n, **{f: x}).SerializeToString(),
                      st.integers(0, 5), st.sampled_from(["acquire", "report", "digest", "pull",
                                                          "push"]), body),
            st.builds(lambda n, x, y: pb.SessionRequest(n=n, acquire=x, report=y).SerializeToString(),
                      st.integers(0, 3), body, body))
        before = (servicer.coord.done, {i: n.outstanding for i, n in servicer.coord.nodes.items()})

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(first=st.one_of(st.just(opening), st.binary(max_size=40)),
               rest=st.lists(message, max_size=4))
        def stream_of(first, rest):
            try:
                for reply in _stream_of(port, first, rest):  # each numbered: an answer, or a refusal
                    assert reply.n >= 1
                    assert reply.code or any(reply.HasField(f) for f in (
                        "acquire", "report", "digest", "pull", "push"))
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.UNAUTHENTICATED,
                                      grpc.StatusCode.UNAVAILABLE), exc

        stream_of()
        limit = SMALL_VECTOR + 64 * 1024  # a call beside a small vector: read nothing bigger
        for first, rest, what in (((1 << 17).to_bytes(4, "big"), [], "an opening"),
                                  (opening, [], None),
                                  ((limit + 1).to_bytes(4, "big"), [], "an opening")):
            if what is None:  # a genuine opening, then a message over the limit
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    _hello(sock)
                    sock.sendall(session_wire.frame(opening) + (limit + 1).to_bytes(4, "big"))
                    with pytest.raises(grpc.RpcError) as e:
                        next(_replies(sock))
                    what = "a message"
            else:
                with pytest.raises(grpc.RpcError) as e:
                    _stream_of(port, first, rest, frame_first=False)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details().startswith(what)
        # no call for another node or session went through, and nothing else changed anything
        assert (servicer.coord.done, {i: n.outstanding for i, n in
                                      servicer.coord.nodes.items()}) == before
        g = b.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant >= 0 and b._stream.port == servicer.session_port
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_a_session_port_in_use_is_one_clear_error_and_leaves_nothing_listening():
    cfg = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="lsgd")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as e:
            create_server("127.0.0.1:0", build_servicer(cfg),
                          session_address=f"127.0.0.1:{port}")
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "SESSION_PORT" in msg and "\n" not in msg
    assert not any(t.name == "lsgd-session-server" for t in threading.enumerate())


def test_refused_streams_are_counted_and_an_unsigned_opening_is_refused_at_once():
    security = Security(secret=SECRET)
    servicer, srv, addr = _server(security)
    try:
        a, b = _joined(addr, 0, security), _joined(addr, 1, security)
        with socket.create_connection(("127.0.0.1", servicer.session_port), timeout=5) as sock:
            _hello(sock)
            opening = pb.SessionRequest(n=0, node=a._node(), nonce=b"n" * 16).SerializeToString()
            t0 = time.monotonic()
            sock.sendall(session_wire.frame(bytes(32) + opening))
            with pytest.raises(grpc.RpcError) as e:
                next(_replies(sock))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - t0 < 2.0
        assert servicer.stats.copy()[0] == {("Session", "UNAUTHENTICATED"): 1}
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def _waiting_in_a_barrier(addr: str):
    """Nodes 0 and 1 joined; node 0's report waits in its global round's barrier (node 1 does
    not report), in a thread that expects the call to fail: (a, b, that thread, round seen)."""
    a, b = _joined(addr, 0), _joined(addr, 1)
    consumed, seen = 0, 0
    while True:  # node 0 takes its credits up to the global round
        g = a.acquire(consumed=consumed, late=0, released=0, want=64, last_round_seen=seen,
                      max_wait=0.5)
        consumed, seen = g.grant, max(seen, g.round_id)
        if g.round_kind == int(RoundKind.GLOBAL) and g.round_id:
            break
    waiting = threading.Thread(target=lambda: pytest.raises(
        grpc.RpcError, a.report_round, g.round_id, None, 2))
    waiting.start()
    time.sleep(0.3)
    return a, b, waiting, seen


def test_a_replaced_stream_waiting_in_a_barrier_gives_its_place_back_at_once():
    servicer, srv, addr = _server(round_timeout=20.0)
    try:
        a, b, waiting, seen = _waiting_in_a_barrier(addr)
        assert srv.sessions.open_sessions == 1
        a2 = GlobalClient(addr, "job", 0, round_timeout=5.0)  # the node's newer stream
        a2.session, a2._seq = a.session, a.last_seq
        a2._use_session_port(servicer.session_port)
        a2.acquire(consumed=0, late=0, released=0, want=1, last_round_seen=seen, max_wait=0)
        waiting.join(5)
        assert not waiting.is_alive()  # the old stream's call ended (CANCELLED)
        deadline = time.monotonic() + 2
        while srv.sessions.open_sessions != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.sessions.open_sessions == 1  # not 2 until the round's 20 s deadline
        t0 = time.monotonic()
        srv.stop(0.5).wait(5)  # a stream waiting (none here now) would not hold the stop
        assert time.monotonic() - t0 < 2.0
        a.close(), a2.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_digest_questions_waiting_for_their_source_do_not_queue_behind_each_other():
    servicer, srv, addr = _server(num_groups=10)
    servicer.digest_wait = 1.0  # nobody registers: each question waits the whole second
    try:
        clients = [GlobalClient(addr, "job", i, round_timeout=5.0) for i in range(10)]
        for c in clients:
            c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=10, connect_timeout=5)
        took: list[float] = []

        def ask(c: GlobalClient) -> None:
            t0 = time.monotonic()
            assert c.digest(5) == b""
            took.append(time.monotonic() - t0)

        threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(took) == 10 and max(took) < 2.5, took  # in a pool of 2 threads: 5 s
        for c in clients:
            c.close()
    finally:
        srv.stop(0.5).wait(5)


def test_a_stream_that_does_not_wait_for_its_replies_is_ended():
    """A node makes one call at a time: a connection that pours frames in is ended (so that
    neither its frames nor its replies pile up in the server)."""
    servicer, srv, addr = _server()
    try:
        a, b = _joined(addr, 0), _joined(addr, 1)
        with socket.create_connection(("127.0.0.1", servicer.session_port), timeout=5) as sock:
            _hello(sock)
            opening = pb.SessionRequest(n=0, node=a._node(), nonce=b"n" * 16)
            calls = [pb.SessionRequest(n=n, acquire=pb.AcquireCreditsRequest(
                node=a._node(), want=1, seq=n).SerializeToString()) for n in range(1, 9)]
            sock.sendall(session_wire.frame(bytes(32) + opening.SerializeToString())
                         + b"".join(session_wire.frame(c.SerializeToString()) for c in calls))
            with pytest.raises(grpc.RpcError) as e:
                for _ in _replies(sock):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "one call at a time" in e.value.details()
        # none of the calls it poured in was made (nor was its opening taken)
        assert servicer.coord.nodes[0].outstanding == 0 and servicer.coord.done == 0
        g = b.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant >= 0  # the server goes on
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_connections_that_send_no_opening_cannot_keep_a_node_from_its_stream():
    """Strangers holding connections open without an opening (no secret needed for that) fill
    their host's room for them; a new connection takes the place of the oldest, so a node's
    stream still opens."""
    servicer, srv, addr = _server()
    held = []
    try:
        a, b = _joined(addr, 0), _joined(addr, 1)
        room = srv.sessions.limits.pending_per_host
        for _ in range(room):
            sock = socket.create_connection(("127.0.0.1", servicer.session_port), timeout=5)
            _hello(sock)
            held.append(sock)
        g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        assert g.grant > 0 and a._stream.port == servicer.session_port
        assert servicer.admission.cancelled["crowded-host"] == 1
        with pytest.raises(grpc.RpcError) as e:  # the oldest was told, and closed
            next(_replies(held[0]))
        assert e.value.code() == grpc.StatusCode.CANCELLED
        a.close(), b.close()
    finally:
        for sock in held:
            sock.close()
        srv.stop(0.5).wait(5)


def test_a_node_gone_while_its_stream_waits_in_a_barrier_gives_its_place_back_at_once():
    servicer, srv, addr = _server(round_timeout=20.0)
    try:
        a, b, waiting, seen = _waiting_in_a_barrier(addr)
        assert srv.sessions.open_sessions == 1
        a._stream.close()  # its connection goes (a node killed mid-round)
        waiting.join(5)
        assert not waiting.is_alive()
        deadline = time.monotonic() + 2
        while srv.sessions.open_sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.sessions.open_sessions == 0  # not at the round's 20 s deadline
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_a_stream_turned_away_before_its_opening_counted_is_opened_again(monkeypatch):
    """Many nodes joining at once from one address: the session port keeps at most
    ``pending_per_host`` connections from a host without their opening, and a newer one takes
    the place of the oldest. A node whose new stream was turned away so (nothing it sent was
    taken) opens another and its call goes through, not a CANCELLED call."""
    from lsgd.global_server.admission import Limits
    from lsgd.local_server import session_socket

    cfg = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="lsgd", l_comm=4, g_comm=8)
    servicer = build_servicer(cfg)
    srv, port = create_server("127.0.0.1:0", servicer, session_address="127.0.0.1:0",
                              limits=Limits.for_job(2, 5.0, pending_per_host=1))
    newer: list[socket.socket] = []
    real_mac = session_socket.sw.opening_mac

    def crowded(*args):  # right before the node's opening: a newer connection from its host
        if not newer:
            s = socket.create_connection(("127.0.0.1", servicer.session_port), timeout=5)
            session_wire.read_hello(s.recv(session_wire.HELLO_SIZE, socket.MSG_WAITALL))
            newer.append(s)  # accepted: the node's stream, older, was turned away
        return real_mac(*args)

    try:
        a, b = _joined(f"127.0.0.1:{port}", 0), _joined(f"127.0.0.1:{port}", 1)
        deadline = time.monotonic() + 5  # the joins' looks at the port, gone on its side too
        while srv.sessions._pending and time.monotonic() < deadline:  # (else one more evicted)
            time.sleep(0.01)
        assert not srv.sessions._pending
        monkeypatch.setattr(session_socket.sw, "opening_mac", crowded)
        g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        # turned away twice: the node's first stream, then the newer connection (the oldest
        # then) when the node's second stream came
        assert newer and servicer.admission.cancelled["crowded-host"] == 2
        assert g.grant > 0 and servicer.coord.nodes[0].outstanding == g.grant
        assert srv.sessions.open_sessions == 1
        a.close(), b.close()
    finally:
        for s in newer:
            s.close()
        srv.stop(0.5).wait(5)
