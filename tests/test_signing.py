"""Signed calls without TLS: the secret never crosses the network, and a captured call is useless."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.security import Security
from lsgd.signing import (MAX_SKEW, SIGNATURE_KEY, NonceMemory, Signer, Verifier, derive_key,
                          sign)

SECRET = "correct-horse-battery-staple-" + "7" * 20
JOIN = "/lsgd.v1.GlobalServer/Join"
BODY = pb.JoinRequest(node=pb.NodeId(job_id="job", node_index=0), num_workers=1,
                      param_count=4, algorithm="lsgd", num_groups=2).SerializeToString()


# ------------------------------------------------------------------ the rule, with a clock
class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_signed_call_is_accepted_once_and_its_replay_refused():
    clock = Clock()
    v = Verifier(SECRET, clock)
    sig = sign(derive_key(SECRET), JOIN, BODY, clock())
    assert v.check(sig, JOIN, BODY) is None
    clock.t += 5
    assert "replayed" in v.check(sig, JOIN, BODY)
    assert len(v.nonces) == 1


@pytest.mark.parametrize("case, why", [
    ("no signature", "missing or malformed"),
    ("malformed", "missing or malformed"),
    ("wrong secret", "does not match"),
    ("other request", "does not match"),
    ("other method", "does not match"),
    ("other time", "does not match"),
])
def test_a_signature_that_does_not_fit_the_call_is_refused(case, why):
    clock = Clock()
    v = Verifier(SECRET, clock)
    key = derive_key("w" * 40 if case == "wrong secret" else SECRET)
    sig = sign(key, JOIN, BODY, clock())
    method, body = JOIN, BODY
    if case == "no signature":
        sig = None
    elif case == "malformed":
        sig = SECRET  # e.g. an old node that sends the secret itself
    elif case == "other request":
        other = pb.JoinRequest.FromString(BODY)
        other.node.node_index = 1  # another node, under node 0's signature
        body = other.SerializeToString()
    elif case == "other method":
        method = "/lsgd.v1.GlobalServer/Leave"
    elif case == "other time":
        v_, ms, nonce, mac = sig.split(".")
        sig = ".".join((v_, str(int(ms) + 1000), nonce, mac))
    assert why in v.check(sig, method, body)
    assert len(v.nonces) == 0  # a refused call leaves nothing behind


def test_a_timestamp_outside_the_clock_window_is_refused():
    clock = Clock()
    v = Verifier(SECRET, clock)
    key = derive_key(SECRET)
    for off in (-MAX_SKEW - 1, MAX_SKEW + 1):
        why = v.check(sign(key, JOIN, BODY, clock() + off), JOIN, BODY)
        assert why and "NTP" in why and ("behind" if off < 0 else "ahead of") in why
    for off in (-MAX_SKEW + 1, MAX_SKEW - 1):
        assert v.check(sign(key, JOIN, BODY, clock() + off), JOIN, BODY) is None


def test_the_nonce_memory_is_bounded_and_never_forgets_a_replayable_call():
    clock = Clock()
    v = Verifier(SECRET, clock, limit=8)
    key = derive_key(SECRET)
    sigs = []
    for i in range(20):  # 20 calls within the window, 8 remembered
        sigs.append(sign(key, JOIN, BODY, clock() + i * 0.01))
        assert v.check(sigs[-1], JOIN, BODY) is None
        assert len(v.nonces) <= 8
    for sig in sigs:  # forgotten early or remembered: every replay is refused
        assert v.check(sig, JOIN, BODY) is not None
    assert v.check(sign(key, JOIN, BODY, clock() + 1), JOIN, BODY) is None  # new calls pass
    clock.t += 2 * MAX_SKEW + 1  # once out of the window, nonces are forgotten
    assert v.check(sign(key, JOIN, BODY, clock()), JOIN, BODY) is None
    assert len(v.nonces) == 1


def test_nonce_memory_forgets_by_time():
    m = NonceMemory(limit=4)
    assert m.add("a", 10.0, oldest=0.0) is None and m.add("b", 20.0, oldest=0.0) is None
    assert m.add("a", 10.0, oldest=0.0) is not None
    assert m.add("c", 30.0, oldest=15.0) is None and len(m) == 2  # "a" expired
    assert m.floor == float("-inf")


# ------------------------------------------------------------------ over the network
class Tap:
    """A TCP forwarder that records what the client sends (one connection)."""

    def __init__(self, port: int) -> None:
        self.sent = bytearray()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self._listen.accept()
        server = socket.create_connection(("127.0.0.1", self._target))
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if record:
                self.sent.extend(data)
            dst.sendall(data)

    def close(self) -> None:
        self._listen.close()


@pytest.fixture
def server():
    servicer = build_servicer(JobConfig(num_groups=2, workers=1, job_id="job"))
    srv, port = create_server("127.0.0.1:0", servicer, security=Security(secret=SECRET))
    yield servicer, port
    srv.stop(grace=0.2).wait(5)


def _join(addr: str, node: int = 0, secret: str = SECRET) -> GlobalClient:
    c = GlobalClient(addr, "job", node, round_timeout=2.0, security=Security(secret=secret))
    c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=2, connect_timeout=5)
    return c


def _replay(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send captured client bytes on a new connection; what the server answered."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(0.2)
        got, end = b"", time.monotonic() + timeout
        while b"grpc-status" not in got and time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break
            got += chunk
    return got


def _capture(port: int) -> tuple[bytes, int]:
    """A node's Join and Heartbeat as they cross a plaintext link; (bytes sent, session)."""
    tap = Tap(port)
    c = _join(f"127.0.0.1:{tap.port}")
    c.heartbeat()
    c.close()
    tap.close()
    captured = bytes(tap.sent)
    assert b"GlobalServer/Join" in captured  # the tap did see the calls, in clear
    return captured, c.session


def test_a_plaintext_capture_does_not_contain_the_secret(server):
    captured, _ = _capture(server[1])
    assert SECRET.encode() not in captured
    assert derive_key(SECRET) not in captured and derive_key(SECRET).hex().encode() not in captured


def test_a_captured_connection_replayed_changes_nothing(server):
    servicer, port = server
    captured, session = _capture(port)
    # the node leaves; replaying the captured connection (its Join) must not bring it back
    c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=2.0,
                     security=Security(secret=SECRET))
    c.session = session
    c.leave(0, 0)
    c.close()
    before = servicer.coord.snapshot()
    answer = _replay(port, captured)
    assert b"grpc-status" in answer  # the server did answer the replayed call
    assert servicer.calls.counts["Join"] == 2
    assert servicer.coord.nodes[0].left and servicer.coord.nodes[0].session == session
    assert servicer.coord.snapshot() == before


class Recorder(grpc.UnaryUnaryClientInterceptor):
    """Records the metadata a call leaves the client with (placed below the Signer)."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, str]] = []

    def intercept_unary_unary(self, continuation, details, request):
        self.metadata = list(details.metadata or ())
        return continuation(details, request)


def test_the_client_sends_a_signature_and_not_the_secret(server):
    _, port = server
    rec = Recorder()
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), Signer(SECRET), rec)
    join = channel.unary_unary(JOIN, request_serializer=None,
                               response_deserializer=pb.JoinResponse.FromString)
    assert join(BODY, timeout=5).session > 0
    channel.close()
    keys = [k for k, _ in rec.metadata]
    assert keys == [SIGNATURE_KEY]
    assert not any(SECRET in v or derive_key(SECRET).hex() in v for _, v in rec.metadata)


def _raw_join(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, channel.unary_unary(JOIN, request_serializer=None,
                                        response_deserializer=pb.JoinResponse.FromString)


def test_a_tampered_request_under_a_genuine_signature_is_refused(server):
    servicer, port = server
    channel, join = _raw_join(port)
    sig = sign(derive_key(SECRET), JOIN, BODY)
    tampered = pb.JoinRequest.FromString(BODY)
    tampered.param_count = 10**6
    with pytest.raises(grpc.RpcError) as e:
        join(tampered.SerializeToString(), metadata=((SIGNATURE_KEY, sig),), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "does not match" in e.value.details()
    assert not servicer.coord.nodes and servicer.params.param_count is None
    # the same signature over the request it was made for is genuine (and still unused)
    assert join(BODY, metadata=((SIGNATURE_KEY, sig),), timeout=5).session > 0
    assert servicer.params.param_count == 4
    channel.close()


def test_a_replayed_or_stale_signed_request_is_refused(server):
    servicer, port = server
    channel, join = _raw_join(port)
    sig = sign(derive_key(SECRET), JOIN, BODY)
    first = join(BODY, metadata=((SIGNATURE_KEY, sig),), timeout=5)
    before = servicer.coord.snapshot()
    for md in (sig, sign(derive_key(SECRET), JOIN, BODY, time.time() - 2 * MAX_SKEW)):
        with pytest.raises(grpc.RpcError) as e:
            join(BODY, metadata=((SIGNATURE_KEY, md),), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "NTP" in e.value.details()
    assert servicer.coord.snapshot() == before and servicer.coord.nodes[0].session == first.session
    channel.close()


def test_an_upload_header_is_signed(server):
    servicer, port = server
    c = _join(f"127.0.0.1:{port}", node=0)
    header = pb.PushParamsRequest(header=pb.PushHeader(
        node=pb.NodeId(job_id="job", node_index=0, session=c.session), round_id=1,
        buffer=pb.BUFFER_KIND_NODE_SUM, param_count=4, summands=1)).SerializeToString()
    chunk = pb.PushParamsRequest(chunk=pb.ParamChunk(
        offset=0, data=np.ones(4, np.float32).tobytes())).SerializeToString()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    push = channel.stream_unary("/lsgd.v1.GlobalServer/PushParams", request_serializer=None,
                                response_deserializer=pb.PushParamsResponse.FromString)
    other = pb.PushParamsRequest.FromString(header)
    other.header.summands = 2  # the header changed under its signature
    sig = sign(derive_key(SECRET), "/lsgd.v1.GlobalServer/PushParams", header)
    with pytest.raises(grpc.RpcError) as e:
        push(iter([other.SerializeToString(), chunk]), metadata=((SIGNATURE_KEY, sig),), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "does not match" in e.value.details()
    assert not servicer.params.buffers["sum"].any()
    # the header it was made for passes the check and reaches the handler (which has no round
    # 1 to take it for: no round was run in this test)
    with pytest.raises(grpc.RpcError) as e:
        push(iter([header, chunk]), metadata=((SIGNATURE_KEY, sig),), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    channel.close()
    c.close()


@pytest.mark.timeout(120)
def test_a_job_with_a_secret_over_plaintext_loopback_trains(cluster, tmp_path):
    (tmp_path / "secret").write_text(SECRET + "\n")
    knobs = dict(ENTRY="toyjob:main", NUM_GROUPS=2, ITERATIONS=2000, JOIN_TIMEOUT=20,
                 SECRET_FILE=tmp_path / "secret")
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n0.wait(90) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    assert n0.summary()["counter"] == 2000
