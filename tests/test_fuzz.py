"""Bad input: every handler fuzzed with hypothesis; garbage on the port. Bounded."""

from __future__ import annotations

import hashlib
import json
import socket

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.wire import MAX_MESSAGE

U64 = st.integers(0, 2**64 - 1)
SMALL = st.integers(0, 40)


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code = code


class Context:
    """The parts of grpc.ServicerContext the handlers use."""

    def abort(self, code, details):
        assert isinstance(code, grpc.StatusCode) and details
        raise Aborted(code, details)

    def is_active(self):
        return True

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:5555"


def _state(servicer) -> str:
    """Everything a refused call must leave as it was (not the nodes' last-seen times)."""
    c = servicer.coord
    with servicer.cond:
        state = c.state(0.0) | {"outstanding": {i: n.outstanding for i, n in c.nodes.items()},
                                "round": (c.round.id, c.round.closed, sorted(c.round.reports))
                                if c.round else None}
        bufs = b"".join(np.ascontiguousarray(b).tobytes() for b in servicer.params.buffers.values())
    return json.dumps(state, sort_keys=True, default=str) + hashlib.sha1(bufs).hexdigest()


def _setup():
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="easgd", alpha=0.1,
                       round_timeout=0.05, l_comm=2, g_comm=2, iterations=200)
    servicer = build_servicer(config)
    servicer.digest_wait = 0.01  # Digest's question: answered at once
    from lsgd.plane.messages import leader_route  # a route whose source (node 1) may register

    servicer.routes.current = leader_route(1, [0, 1], 1, {0: "127.0.0.1:1", 1: "127.0.0.1:2"})
    sessions = []
    for i in (0, 1):
        resp = servicer.Join(pb.JoinRequest(node=pb.NodeId(job_id="job", node_index=i),
                                            num_workers=2, param_count=8, algorithm="easgd",
                                            num_groups=2), Context())
        sessions.append(resp.session)
    return servicer, sessions


def node_ids(sessions):
    return st.builds(lambda job, idx, s: pb.NodeId(job_id=job, node_index=idx, session=s),
                     st.sampled_from(["job", "job", "other", ""]), st.sampled_from([0, 1, 2, 7]),
                     st.one_of(st.sampled_from(sessions), U64))


def requests(sessions):
    nid = node_ids(sessions)
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    chunk = st.builds(lambda off, vals: pb.ParamChunk(offset=off, data=np.array(vals, np.float32).tobytes()),
                      st.one_of(SMALL, U64), st.lists(floats, max_size=12))
    raw_chunk = st.builds(lambda off, data: pb.ParamChunk(offset=off, data=data), SMALL, st.binary(max_size=40))
    header = st.builds(lambda n, r, b, c, s, w: pb.PushHeader(node=n, round_id=r, buffer=b, param_count=c,
                                                              summands=s, wire_format=w),
                       nid, SMALL, st.integers(0, 6), st.sampled_from([0, 8, 9, 2**40]),
                       st.integers(0, 2**32 - 1), st.integers(0, 3))
    return st.one_of(
        st.builds(lambda n, w, c, a, g, r, h, u, d: ("Join", pb.JoinRequest(
            node=n, num_workers=w, param_count=c, algorithm=a, num_groups=g, resume_session=r,
            held_credits=h, unreported=u, data_address=d)), nid, st.integers(0, 5),
            st.sampled_from([0, 8, 9, 2**50]),
            st.sampled_from(["easgd", "lsgd", ""]), st.integers(0, 5),
            st.one_of(st.just(0), st.sampled_from(sessions), U64), st.one_of(SMALL, U64),
            st.one_of(SMALL, U64),
            st.sampled_from(["", "127.0.0.1:5000", "10.0.0.1:1", "x", "127.0.0.1:0",
                             "[::1]:5", "127.0.0.1:" + "9" * 300, "\u00e9:1"])),
        st.builds(lambda n, r, e, s, w, red: ("Bypass", pb.BypassRequest(
            node=n, round_id=r, epoch=e, stalled=s, why=w, reduce=red)),
            nid, SMALL, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
            st.text(max_size=300), st.booleans()),
        st.builds(lambda n: ("Heartbeat", pb.HeartbeatRequest(node=n)), nid),
        st.builds(lambda n, r, d: ("Digest", pb.DigestRequest(
            node=n, round_id=r, sha256=d)), nid, SMALL,
            st.one_of(st.just(b""), st.binary(min_size=32, max_size=32), st.binary(max_size=80))),
        st.builds(lambda n, c, l, r, w, s, q, u: ("AcquireCredits", pb.AcquireCreditsRequest(
            node=n, consumed=c, late_consumed=l, released=r, want=w, last_round_seen=s,
            max_wait_ms=0, seq=q, used_ms=u)), nid, st.one_of(SMALL, U64),
            st.one_of(SMALL, U64), st.one_of(SMALL, U64), st.one_of(SMALL, U64), SMALL,
            st.one_of(SMALL, U64), st.one_of(SMALL, st.integers(0, 2**32 - 1))),
        st.builds(lambda n, r, w, loss, has, p, wt: ("ReportRound", pb.ReportRoundRequest(
            node=n, round_id=r, best=pb.Candidate(worker_id=w, loss=loss), has_best=has,
            participants=p, weight=wt)), nid, SMALL, st.integers(0, 9), st.floats(allow_nan=True),
            st.booleans(), st.integers(0, 2**32 - 1),
            st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True))),
        st.builds(lambda h, parts: ("PushParams", [pb.PushParamsRequest(header=h)] +
                                    [pb.PushParamsRequest(chunk=c) for c in parts]),
                  header, st.lists(st.one_of(chunk, raw_chunk), max_size=3)),
        st.builds(lambda parts: ("PushParams", [pb.PushParamsRequest(chunk=c) for c in parts]),
                  st.lists(chunk, max_size=2)),
        st.builds(lambda n, r, b, c, w: ("PullParams", pb.PullParamsRequest(
            node=n, round_id=r, buffer=b, chunk_elements=c, wire_format=w)),
            nid, st.sampled_from([0, 1, 2, 99]), st.integers(0, 6),
            st.one_of(SMALL, st.integers(0, 2**32 - 1)), st.integers(0, 3)),
        st.builds(lambda n, c, l: ("Leave", pb.LeaveRequest(node=n, consumed=c, late_consumed=l)),
                  nid, st.one_of(SMALL, U64), st.one_of(SMALL, U64)),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_handlers_answer_every_message_with_a_result_or_a_status_and_refusals_change_nothing(data):
    servicer, sessions = _setup()
    calls = data.draw(st.lists(requests(sessions), min_size=1, max_size=12))
    for method, request in calls:
        before = _state(servicer)
        try:
            out = getattr(servicer, method)(iter(request) if method == "PushParams" else request,
                                            Context())
            if method == "PullParams":
                for part in out:
                    assert isinstance(part, pb.ParamChunk)
        except Aborted as exc:
            assert exc.code != grpc.StatusCode.UNKNOWN
            if method != "PushParams":  # a broken upload may fail its round's exchange
                assert _state(servicer) == before, (method, request, exc)
        c = servicer.coord
        assert 0 <= c.done and all(n.outstanding >= 0 for n in c.nodes.values())
        for buf in servicer.params.buffers.values():
            assert np.isfinite(buf).all()


@pytest.fixture
def server():
    config = JobConfig(num_groups=1, workers=1, job_id="job")
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    yield servicer, port
    srv.stop(grace=0.2).wait(5)


def _still_serves(port: int, node: int = 0) -> None:
    c = GlobalClient(f"127.0.0.1:{port}", "job", node, round_timeout=2.0)
    try:
        assert c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=1,
                      connect_timeout=5).session > 0
    finally:
        c.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(st.binary(min_size=1, max_size=2048),
                      st.just(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64),  # preface + junk
                      st.just(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x7f\xff\xff\x00\x00\x00\x00\x00\x01")))
def test_garbage_on_the_port_leaves_the_server_serving(server, junk):
    servicer, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(junk)
        s.settimeout(0.2)
        try:
            s.recv(1024)
        except (socket.timeout, ConnectionError):
            pass
    assert not servicer.coord.nodes  # nothing got in


def test_after_garbage_a_real_node_still_joins(server):
    servicer, port = server
    for junk in (b"\x00" * 100, b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\xff"):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(junk)
    _still_serves(port)


def test_truncated_and_oversized_messages_get_a_status(server):
    servicer, port = server
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    raw = channel.unary_unary("/lsgd.v1.GlobalServer/Join", request_serializer=None,
                              response_deserializer=None)
    good = pb.JoinRequest(node=pb.NodeId(job_id="job"), num_workers=1, param_count=4,
                          algorithm="lsgd", num_groups=1).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        raw(good[: len(good) // 2], timeout=5)  # truncated protobuf
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x0a" + b"\xff" * 9 + b"\x01", timeout=5)  # a length that runs off the end
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    big = channel.unary_unary("/lsgd.v1.GlobalServer/Heartbeat", request_serializer=None,
                              response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        big(b"\x00" * (MAX_MESSAGE + 1024), timeout=10)  # over the explicit message limit
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()
    assert not servicer.coord.nodes
    _still_serves(port)
