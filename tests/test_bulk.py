"""The global server's bulk port (``BULK_PORT``): uploads and downloads on data connections get
the same checks and answers as the gRPC streams, a stranger or a broken peer changes nothing,
and a node falls back to gRPC when the port is not there."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.plane import bulk
from lsgd.plane.wire import _HELLO, TransferError
from lsgd.proto import lsgd_pb2 as pb
from lsgd.security import Security

N = 600_000  # 2.4 MB of float32, 1.2 MB of bfloat16: above MIN_BULK
SECRET = "bulk-test-secret-0123456789"


@pytest.fixture(params=[None, SECRET], ids=["no-secret", "secret"])
def server(request):
    yield from _server(request.param)


def _server(secret):
    config = JobConfig(num_groups=1, workers=2, job_id="job", algorithm="easgd", alpha=0.1,
                       round_timeout=1.0)
    servicer = build_servicer(config)
    security = Security(secret=secret)
    srv, port = create_server("127.0.0.1:0", servicer, security=security,
                              bulk_address="127.0.0.1:0")
    assert servicer.bulk_port and servicer.bulk_server is srv.bulk
    yield servicer, f"127.0.0.1:{port}", security
    srv.stop(grace=0).wait(5)


def counts(servicer, **want):
    """The bulk port's counts once they show ``want`` (a transfer is counted just after the
    node has its answer), within 5 s."""
    end = time.monotonic() + 5
    while True:
        got = servicer.bulk_server.counts()
        if all(got[k] == v for k, v in want.items()) or time.monotonic() > end:
            return got
        time.sleep(0.01)


def joined(addr, security, n=N):
    c = GlobalClient(addr, "job", 0, round_timeout=5.0, security=security)
    c.join(workers=2, param_count=n, algorithm="easgd", num_groups=1, connect_timeout=5)
    return c


def vector(n=N, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_a_vector_goes_up_and_comes_back_on_the_bulk_port(server):
    servicer, addr, security = server
    c = joined(addr, security)
    v = vector()
    c.push("center", v, round_id=0)  # the seed of the EASGD center
    out = np.zeros(N, np.float32)
    c.pull("center", out, round_id=0)
    assert np.array_equal(out, v)
    assert c.transfers.moved == {"bulk": 2, "grpc": 0, "session": 0}
    _, received, sent = servicer.stats.copy()
    assert received == sent == v.nbytes
    assert counts(servicer, upload=1, download=1) == {"upload": 1, "download": 1, "refused": 0,
                                                      "broken": 0, "no_request": 0,
                                                      "turned_away": 0}
    from lsgd.global_server.prom import make_registry, render

    metrics = render(make_registry(servicer)).decode()
    assert 'lsgd_bulk_transfers_total{outcome="upload"} 1.0' in metrics
    moved_in = re.search(r'lsgd_param_bytes_total\{direction="in"\} (\S+)', metrics)
    assert moved_in and float(moved_in.group(1)) == v.nbytes


def test_a_small_model_stays_off_the_bulk_port():
    """Below MIN_BULK the center's seed and a download of the newest center go on gRPC streams
    (a round's small vectors go whole on the session stream: tests/test_session_vectors.py)."""
    for servicer, addr, security in _server(None):
        c = joined(addr, security, n=1000)  # 4 KB: below MIN_BULK
        v = vector(1000)
        c.push("center", v, round_id=0)
        out = np.zeros(1000, np.float32)
        c.pull("center", out, round_id=0)
        assert np.array_equal(out, v) and c.transfers.moved == {"bulk": 0, "grpc": 2, "session": 0}


def test_bfloat16_on_the_bulk_port_rounds_as_on_grpc(server):
    pytest.importorskip("ml_dtypes")
    servicer, addr, security = server
    c = joined(addr, security)
    v = vector()
    c.push("center", v, round_id=0, wire="bfloat16")
    bulk_out, grpc_out = np.zeros(N, np.float32), np.zeros(N, np.float32)
    c.pull("center", bulk_out, round_id=0, wire="bfloat16")
    c.transfers.bulk_port = 0
    c.pull("center", grpc_out, round_id=0, wire="bfloat16")
    assert np.array_equal(bulk_out, grpc_out) and np.abs(bulk_out - v).max() < 0.05
    assert c.transfers.moved == {"bulk": 2, "grpc": 1, "session": 0}


def test_refusals_carry_the_grpc_status_and_change_nothing(server):
    servicer, addr, security = server
    c = joined(addr, security)
    with pytest.raises(grpc.RpcError) as e:  # no round is open: no sum is expected
        c.push("sum", vector(), round_id=3, summands=1)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no upload of sum" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # another model size
        c.push("center", vector(N + 1), round_id=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parameters" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # the center is not seeded yet
        c.pull("center", np.zeros(N, np.float32), round_id=0)
    assert e.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.FAILED_PRECONDITION)
    c.session += 1  # a stale session
    with pytest.raises(grpc.RpcError) as e:
        c.push("center", vector(), round_id=0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not servicer.params.center_ready and c.transfers.moved == {"bulk": 0, "grpc": 0, "session": 0}
    assert counts(servicer, refused=4)["refused"] == 4


def test_a_non_finite_value_midway_is_refused_and_said(server):
    servicer, addr, security = server
    c = joined(addr, security)
    v = vector()
    v[N - 5] = np.nan  # in the last chunk: the server refuses after taking the others
    with pytest.raises(grpc.RpcError) as e:
        c.push("center", v, round_id=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-finite" in e.value.details()
    assert not servicer.params.center_ready
    v[N - 5] = 1.0  # the seed can be tried again, and is taken whole
    c.push("center", v, round_id=0)
    out = np.zeros(N, np.float32)
    c.pull("center", out, round_id=0)
    assert np.array_equal(out, v)


def test_a_port_that_does_not_answer_is_said_once_and_grpc_carries_the_vectors(server, caplog):
    servicer, addr, security = server
    c = joined(addr, security)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    c.transfers.bulk_port = dead
    v = vector()
    with caplog.at_level(logging.WARNING):
        c.push("center", v, round_id=0)
        out = np.zeros(N, np.float32)
        c.pull("center", out, round_id=0)
    assert np.array_equal(out, v) and c.transfers.moved == {"bulk": 0, "grpc": 2, "session": 0}
    said = [r for r in caplog.records if "bulk port" in r.getMessage()]
    assert len(said) == 1 and str(dead) in said[0].getMessage()


def test_a_full_server_sends_that_transfer_over_grpc():
    for servicer, addr, security in _server(None):
        servicer.bulk_server.limits = dataclasses.replace(servicer.bulk_server.limits, streams=0)
        c = joined(addr, security)
        v = vector()
        c.push("center", v, round_id=0)
        out = np.zeros(N, np.float32)
        c.pull("center", out, round_id=0)
        assert np.array_equal(out, v) and c.transfers.moved == {"bulk": 0, "grpc": 2, "session": 0}
        assert counts(servicer, turned_away=2)["turned_away"] == 2


# ---------------------------------------------------------------------------- hostile peers
def raw(port, secret, kind, body, chunk=1 << 16, length=None, key_secret=None):
    """Open a connection and say a request; returns (socket, channel)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    ch = bulk._Channel(s, (key_secret or secret or "").encode() or None, time.monotonic() + 5)
    magic, version, nonce = _HELLO.unpack(ch.read(_HELLO.size))
    assert magic == bulk.MAGIC
    mine = os.urandom(16)
    ch.keyed(nonce + mine, bulk.LABEL)
    head = bulk._REQUEST.pack(kind, chunk, len(body) if length is None else length)
    ch.send(bulk.TO_RECEIVER, head, body, mine)
    return s, ch


def reply(ch):
    raw_reply = ch.read(bulk._REPLY.size)
    status, length, count = bulk._REPLY.unpack(raw_reply)
    reason = ch.read(length)
    ch.check(bulk.TO_SENDER, raw_reply, reason)
    return status, reason.decode(), count


def header(c, n=N, buffer=pb.BUFFER_KIND_CENTER):
    return pb.PushHeader(node=pb.NodeId(job_id="job", node_index=0, session=c.session),
                         round_id=0, buffer=buffer, param_count=n).SerializeToString()


def test_bad_requests_get_a_status_and_change_nothing(server):
    servicer, addr, security = server
    c = joined(addr, security)
    port = servicer.bulk_port
    cases = [(9, header(c), 1 << 16, "unknown kind"),
             (bulk.UPLOAD, header(c), 0, "chunk 0"),
             (bulk.UPLOAD, header(c), bulk.MAX_CHUNK + 1, "chunk"),
             (bulk.UPLOAD, b"\xff\xff\xff", 1 << 16, "does not parse"),
             (bulk.UPLOAD, header(c, buffer=pb.BUFFER_KIND_AVERAGE), 1 << 16, "cannot upload"),
             (bulk.DOWNLOAD, pb.PullParamsRequest(
                 node=pb.NodeId(job_id="job", node_index=0, session=c.session),
                 buffer=pb.BUFFER_KIND_MAIL).SerializeToString(), 1 << 16, "cannot download")]
    for kind, body, chunk, said in cases:
        s, ch = raw(port, security.secret, kind, body, chunk)
        with s:
            status, reason, _ = reply(ch)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and said in reason, (said, reason)
    assert not servicer.params.center_ready and servicer.stats.copy()[1] == 0


def test_a_chunk_out_of_order_or_forged_ends_the_upload_and_the_seed_can_come_again(server):
    servicer, addr, security = server
    c = joined(addr, security)
    port = servicer.bulk_port
    data = memoryview(vector(1 << 16).view(np.uint8))
    # out of order; and (with a secret: without one nothing can tell) other bytes than its MAC's
    for offset, tamper in ((1 << 16, False), (0, True))[:2 if security.secret else 1]:
        s, ch = raw(port, security.secret, bulk.UPLOAD, header(c))
        with s:
            assert reply(ch)[0] == 0
            if tamper:
                mac = ch._mac(bulk.TO_RECEIVER, ch.sent, (struct.pack("<QI", offset, 1 << 16),),
                              data)
                ch.sent += 1
                ch._sendall([struct.pack("<QI", offset, 1 << 16), bytes(data[:-1]) + b"\x01", mac])
            else:
                ch.send(bulk.TO_RECEIVER, struct.pack("<QI", offset, 1 << 16), bulk=data)
            s.settimeout(5)
            assert s.recv(100) == b""  # the server closed the connection: nothing said on it
    got = counts(servicer, broken=2 if security.secret else 1)
    assert got["broken"] == (2 if security.secret else 1) and got["no_request"] == 0, got
    deadline = time.monotonic() + 5
    while servicer.params._seeding and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not servicer.params.center_ready
    v = vector()
    c.push("center", v, round_id=0)  # the seed was not held by the broken uploads
    assert servicer.params.center_ready


def test_a_stranger_without_the_secret_is_not_served():
    for servicer, addr, security in _server(SECRET):
        c = joined(addr, security)
        s, ch = raw(servicer.bulk_port, SECRET, bulk.UPLOAD, header(c), key_secret="not-the-secret-at-all")
        with s:
            s.settimeout(5)
            assert s.recv(100) == b""  # its request's MAC is wrong: closed, nothing said
        assert not servicer.params.center_ready and servicer.stats.copy()[1] == 0
        assert counts(servicer, no_request=1)["no_request"] == 1


def test_a_peer_that_says_nothing_or_too_much_is_dropped(server):
    servicer, addr, security = server
    port = servicer.bulk_port
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.recv(_HELLO.size)
        assert s.recv(100) == b""  # within AUTH_WAIT
    assert time.monotonic() - t < bulk.AUTH_WAIT + 2
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.recv(_HELLO.size)
        s.sendall(bulk._REQUEST.pack(bulk.UPLOAD, 1 << 16, bulk.MAX_REQUEST + 1))
        assert s.recv(100) == b""  # a request longer than MAX_REQUEST: not read
    assert counts(servicer, no_request=2)["no_request"] == 2  # neither is a broken transfer


def test_the_node_side_refuses_what_a_server_must_not_send():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = listener.accept()
        with c, conn:
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(4))  # not lsgd's bulk protocol
            with pytest.raises(bulk.Unreached) as e:
                bulk.download(c, None, b"", np.zeros(4, np.float32), np.dtype("<f4"), 4, 5.0)
            assert e.value.foreign
    with pytest.raises(TransferError):  # a request longer than the protocol allows
        bulk.upload(socket.socket(), None, bytes(bulk.MAX_REQUEST + 1), np.zeros(4, np.float32),
                    np.dtype("<f4"), 4, 5.0)


def test_a_node_session_has_at_most_two_transfers_open_as_on_grpc(server):
    servicer, addr, security = server
    c = joined(addr, security)
    request = pb.PullParamsRequest(node=pb.NodeId(job_id="job", node_index=0, session=c.session),
                                   buffer=pb.BUFFER_KIND_CENTER).SerializeToString()
    waiting = [raw(servicer.bulk_port, security.secret, bulk.DOWNLOAD, request)
               for _ in range(2)]  # the center is not seeded: both wait for it (1 s)
    time.sleep(0.2)
    s, ch = raw(servicer.bulk_port, security.secret, bulk.DOWNLOAD, request)
    with s:
        status, reason, _ = reply(ch)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "already has 2 parameter transfers open" in reason
    for s, ch in waiting:  # their round's wait ends: not ready, said
        with s:
            assert reply(ch)[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    v = vector()  # the session's count is back to 0: its transfers go on
    c.push("center", v, round_id=0)
    assert counts(servicer, upload=1)["upload"] == 1


def test_a_wrong_size_download_is_a_value_error_as_on_grpc(server):
    servicer, addr, security = server
    c = joined(addr, security)
    c.push("center", vector(), round_id=0)
    with pytest.raises(ValueError, match="600000 elements, this node's 600001"):
        c.pull("center", np.zeros(N + 1, np.float32), round_id=0)


def test_the_listener_goes_on_after_accept_fails(server, caplog):
    servicer, addr, security = server
    port = servicer.bulk_server

    class Flaky:  # the listening socket, out of file descriptors for its next accept
        def __init__(self, sock):
            self.sock, self.failed = sock, False

        def accept(self):
            if not self.failed:
                self.failed = True
                raise OSError(24, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    real = port.sock
    port.sock = Flaky(real)
    time.sleep(0.6)  # the accept in progress times out: the next is the flaky one
    with caplog.at_level(logging.WARNING):
        c = joined(addr, security)
        v = vector()
        c.push("center", v, round_id=0)
    assert port.sock.failed and port._thread.is_alive()
    assert "could not accept a connection" in caplog.text
    assert c.transfers.moved["bulk"] == 1


def test_a_refused_upload_drains_a_socket_past_descriptor_1024():
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("fewer than 1200 file descriptors allowed")
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1100)
    a.close()
    sock = socket.socket(fileno=high)
    try:
        b.sendall(b"x" * 1000)
        b.shutdown(socket.SHUT_WR)
        t = time.monotonic()
        bulk._drain(sock)  # select() would raise ValueError here
        assert time.monotonic() - t < 1.0
        assert b.recv(10) == b""  # the server's side was shut for writing
    finally:
        sock.close()
        b.close()


def test_a_port_that_failed_is_tried_again_later(server, monkeypatch, caplog):
    from lsgd.local_server import transfer_client

    monkeypatch.setattr(transfer_client, "RETRY_FIRST", 0.3)
    servicer, addr, security = server
    c = joined(addr, security)
    real = socket.create_connection
    down = [True]

    def connect(*args, **kw):  # the link to the port is down, then back
        if down[0]:
            raise TimeoutError("timed out")
        return real(*args, **kw)

    monkeypatch.setattr(transfer_client.socket, "create_connection", connect)
    v, out = vector(), np.zeros(N, np.float32)
    with caplog.at_level(logging.WARNING):
        c.push("center", v, round_id=0)
        c.pull("center", out, round_id=0)  # within the minute: gRPC, not tried
        down[0] = False
        c.pull("center", out, round_id=0)  # still within it
        assert c.transfers.moved == {"bulk": 0, "grpc": 3, "session": 0}
        time.sleep(0.35)
        c.pull("center", out, round_id=0)  # tried again: the port answers
    assert c.transfers.moved == {"bulk": 1, "grpc": 3, "session": 0} and np.array_equal(out, v)
    assert "did not answer" in caplog.text and "answers again" in caplog.text


def test_a_job_stop_ends_a_transfer_in_progress(server):
    servicer, addr, security = server
    c = joined(addr, security)
    t = time.monotonic()
    timer = threading.Timer(0.2, c._note_stop, args=("job stopped on node 0: interrupted",))
    timer.start()
    with pytest.raises(grpc.RpcError) as e:  # the center is not seeded: it would wait 1 s
        c.pull("center", np.zeros(N, np.float32), round_id=0)
    timer.join()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t < 0.8
    assert c.stopped.startswith("job stopped")
