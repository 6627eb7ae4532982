"""The asyncio server of the nodes' Session streams (issue 15, design-scale.md step 4).

``tests/test_session_stream.py`` runs the stream's behaviours on both servers; this file covers
what only the second port has: the nodes find it through Join, a long-poll on it wakes on the
servicer's news (not on a timer), an opening signed for one port is not replayed on the other,
a node that cannot reach the port uses PORT, and stopping the server ends the open streams
with a status the node understands.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time

import grpc
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.rules.base import RoundKind
from lsgd.security import Security
from lsgd.signing import SESSION_METHOD, SIGNATURE_KEY, derive_key, sign

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


def _open(addr: str, opening: pb.SessionRequest, signature: str | None):
    channel = grpc.insecure_channel(addr)
    out: queue.SimpleQueue = queue.SimpleQueue()
    out.put(opening)
    md = [(SIGNATURE_KEY, signature)] if signature else []
    replies = pb_grpc.GlobalServerStub(channel).Session(iter(out.get, None), metadata=md)
    return out, replies, channel


def test_openings_need_the_secret_and_one_signed_for_a_port_is_not_replayed_on_the_other():
    security = Security(secret=SECRET)
    servicer, srv, addr = _server(security)
    streams = f"127.0.0.1:{servicer.session_port}"
    try:
        a, b = _joined(addr, 0, security), _joined(addr, 1, security)
        opening = pb.SessionRequest(n=0, node=a._node(), nonce=b"n" * 16)
        body = opening.SerializeToString()
        for signature in (None, sign(derive_key("w" * 40), SESSION_METHOD, body)):
            out, replies, ch = _open(streams, opening, signature)
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "secret" in e.value.details()
            out.put(None), ch.close()
        # One genuine signature: the first port to see it takes it, the other refuses it.
        signature = sign(derive_key(SECRET), SESSION_METHOD, body)
        key = derive_key(SECRET)
        from lsgd.signing import ACQUIRE_FIELD, session_mac

        call = pb.AcquireCreditsRequest(node=a._node(), want=4, seq=1).SerializeToString()
        first = pb.SessionRequest(n=1, acquire=call,
                                  mac=session_mac(key, b"n" * 16, 1, ACQUIRE_FIELD, call))
        out, replies, ch = _open(streams, opening, signature)
        out.put(first)
        assert next(replies).acquire.grant > 0
        out.put(None), ch.close()
        out, replies, ch = _open(addr, opening, signature)  # the same, on PORT
        out.put(first)
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "replay" in e.value.details() or "seen" in e.value.details()
        out.put(None), ch.close()
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


class _Silent(pb_grpc.GlobalServerServicer):
    """A server that takes session messages and never answers."""

    def Session(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return iter(())


def test_a_node_that_cannot_reach_the_session_port_uses_port_and_says_so(caplog, monkeypatch):
    from concurrent import futures

    from lsgd.local_server import global_client

    monkeypatch.setattr(global_client, "PORT_PROBE", 1.0)
    servicer, srv, addr = _server()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    silent = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GlobalServerServicer_to_server(_Silent(), silent)
    mute = silent.add_insecure_port("127.0.0.1:0")
    silent.start()
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
        # 2. It connects but never answers: the first call's deadline, then PORT for good.
        caplog.clear()
        monkeypatch.setattr(global_client, "RPC_TIMEOUT", 1.0)
        srv.stop(0.5).wait(5)
        servicer, srv, addr = _server()  # a job of its own
        servicer.session_port = mute
        c = _joined(addr, 0)
        assert c._session_port == mute
        with caplog.at_level(logging.WARNING):
            with pytest.raises(grpc.RpcError) as e:  # this call is lost, as to a server gone
                c.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0,
                          max_wait=0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        lines = [r.getMessage() for r in caplog.records if "session port" in r.getMessage()]
        assert len(lines) == 1 and str(mute) in lines[0]
        c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5,
               resume=True, unanswered=(c.last_seq, 0))
        assert c._session_port == 0  # the same server: it stays on PORT
        c.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
        c.close()
    finally:
        silent.stop(0).wait(5)
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


def test_garbage_and_fuzzed_messages_on_the_session_port_get_a_status_and_change_nothing():
    """Raw bytes on the port, and streams of arbitrary messages (truncated, oversized, several
    calls, none, numbers out of order, calls that do not parse): each gets a reply or a status,
    no refused call changes the state, and a real node is served afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from lsgd.wire import MAX_MESSAGE

    servicer, srv, addr = _server()
    port = servicer.session_port
    try:
        a, b = _joined(addr, 0), _joined(addr, 1)
        for junk in (b"\x00" * 100, b"GET / HTTP/1.1\r\n\r\n",
                     b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(junk)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        raw = channel.stream_stream("/lsgd.v1.GlobalServer/Session", request_serializer=None,
                                    response_deserializer=pb.SessionReply.FromString)
        opening = pb.SessionRequest(n=0, node=a._node(), nonce=b"x" * 16).SerializeToString()
        body = st.one_of(st.binary(max_size=64), st.just(b"\x0a\xff\xff\xff\x0f"),
                         st.builds(lambda s: pb.AcquireCreditsRequest(
                             node=pb.NodeId(job_id="job", node_index=s % 3, session=s),
                             consumed=s, want=4).SerializeToString(), st.integers(0, 2**63)))
        message = st.one_of(
            st.binary(max_size=80),
            st.builds(lambda n, f, x: pb.SessionRequest(n=n, **{f: x}).SerializeToString(),
                      st.integers(0, 5), st.sampled_from(["acquire", "report", "digest", "pull", "push"]), body),
            st.builds(lambda n, x, y: pb.SessionRequest(n=n, acquire=x, report=y).SerializeToString(),
                      st.integers(0, 3), body, body))
        before = (servicer.coord.done, {i: n.outstanding for i, n in servicer.coord.nodes.items()})

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(first=st.one_of(st.just(opening), st.binary(max_size=40)),
               rest=st.lists(message, max_size=4))
        def stream_of(first, rest):
            call = raw(iter([first, *rest]), timeout=5)
            try:
                for reply in call:  # every reply numbered: an answer, or a refusal's code
                    assert reply.n >= 1
                    assert reply.code or any(reply.HasField(f) for f in (
                        "acquire", "report", "digest", "pull", "push"))
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.CANCELLED), exc

        stream_of()
        from lsgd.global_server.aio_session import MAX_MESSAGE as SESSION_MAX

        from lsgd.wire import SMALL_VECTOR

        limit = SMALL_VECTOR + SESSION_MAX  # a call beside a small vector: read nothing bigger
        assert limit < MAX_MESSAGE
        with pytest.raises(grpc.RpcError) as e:  # an opening is small: refused before its hash
            list(raw(iter([b"\x00" * (SESSION_MAX + 1)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "opening" in e.value.details()
        for big in ([b"\x00" * (limit + 1)], [opening, b"\x00" * (limit + 1)]):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(iter(big), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
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


def test_refused_streams_are_counted_and_an_unsigned_one_is_refused_at_once():
    security = Security(secret=SECRET)
    servicer, srv, addr = _server(security)
    streams = f"127.0.0.1:{servicer.session_port}"
    try:
        a, b = _joined(addr, 0, security), _joined(addr, 1, security)
        # a stream with no signature that sends nothing: refused at once, not held until its
        # opening is due (5 s)
        ch = grpc.insecure_channel(streams)
        silent: queue.SimpleQueue = queue.SimpleQueue()
        replies = pb_grpc.GlobalServerStub(ch).Session(iter(silent.get, None))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - t0 < 2.0
        silent.put(None), ch.close()
        assert servicer.stats.copy()[0] == {("Session", "UNAUTHENTICATED"): 1}
        a.close(), b.close()
    finally:
        srv.stop(0.5).wait(5)


def test_a_replaced_stream_waiting_in_a_barrier_gives_its_place_back_at_once():
    servicer, srv, addr = _server(round_timeout=20.0)
    try:
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
        waiting.start()  # its barrier waits for node 1, which does not report
        time.sleep(0.3)
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
