"""Idle or hostile parameter streams cannot starve the global server (issue 9, item 14).

A client that holds the secret speaks the protocol directly to a real server on 127.0.0.1:0.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.admission import Admission, Limits
from lsgd.global_server.server import build_servicer, create_server, serve
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.security import Security
from lsgd.signing import SIGNATURE_KEY, derive_key, sign

SECRET = "admission-test-secret-0123456789"
SEC = Security(secret=SECRET)
PUSH = "/lsgd.v1.GlobalServer/PushParams"


def _signed_empty_stream() -> tuple:
    """The metadata a holder of the secret sends with an upload that never sends its header:
    a genuine signature (over no header, as ``Signer`` makes for an empty stream)."""
    return ((SIGNATURE_KEY, sign(derive_key(SECRET), PUSH, b"")),)


class _Ready:
    """Stands in for the pipe end ``serve`` reports its port on."""

    def __init__(self) -> None:
        self.port = None
        self.event = threading.Event()

    def send(self, msg) -> None:  # noqa: ANN001
        self.port = msg[1] if msg[0] == "ready" else None
        self.event.set()


def _client(port: int, node: int) -> GlobalClient:
    return GlobalClient(f"127.0.0.1:{port}", "job", node, round_timeout=5.0, security=SEC)


def _join(c: GlobalClient, params: int = 1000) -> None:
    c.join(workers=1, param_count=params, algorithm="lsgd", num_groups=2, connect_timeout=10)


def _nothing(release: threading.Event):
    """A request stream that sends nothing until ``release``."""
    release.wait(60)
    return
    yield  # noqa: unreachable - makes this a generator


def _node_loop(c: GlobalClient, stop: threading.Event, latencies: list, errors: list) -> None:
    """What a node does between rounds: heartbeats and credit calls, timed."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            c.heartbeat()
            c.acquire(consumed=0, late=0, released=0, want=0, last_round_seen=0, max_wait=0)
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        latencies.append(time.monotonic() - t0)
        stop.wait(0.2)


@pytest.mark.timeout(90)
def test_fifty_idle_uploads_cannot_starve_heartbeats_or_credits(tmp_path):
    """The reproduction of item 14 against the real server process main (``serve``): 50
    PushParams streams with the secret that send nothing. Nodes keep answering, nobody is
    dropped, the idle streams are refused or cancelled within the header bound, and a normal
    upload works afterwards."""
    config = JobConfig(num_groups=2, workers=1, job_id="job", port=0, run_dir=str(tmp_path),
                       node_timeout=2.0, iterations=None, minutes=5, state_every=0.5)
    limits = Limits.for_job(2, config.round_timeout)
    stop_server, ready = threading.Event(), _Ready()
    server = threading.Thread(target=serve, args=(config,),
                              kwargs=dict(ready=ready, stop_event=stop_server, security=SEC))
    server.start()
    release, stop_nodes = threading.Event(), threading.Event()
    channels, loops = [], []
    try:
        assert ready.event.wait(20) and ready.port
        nodes = [_client(ready.port, i) for i in (0, 1)]
        for c in nodes:
            _join(c)
        latencies, errors = {0: [], 1: []}, []
        for i, c in enumerate(nodes):
            loops.append(threading.Thread(target=_node_loop, args=(c, stop_nodes, latencies[i], errors)))
            loops[-1].start()
        time.sleep(0.5)
        channels = [grpc.insecure_channel(f"127.0.0.1:{ready.port}") for _ in range(5)]
        opened = time.monotonic()
        calls = [pb_grpc.GlobalServerStub(channels[k % 5]).PushParams.future(
            _nothing(release), timeout=60, metadata=_signed_empty_stream()) for k in range(50)]
        bound = limits.header_wait + 2.0  # the header bound, the watchdog's tick, a loaded CPU
        codes = []
        for call in calls:
            exc = call.exception(timeout=max(0.1, opened + bound - time.monotonic()))
            codes.append(exc.code() if exc is not None else None)
        ended = time.monotonic() - opened
        time.sleep(0.5)
        stop_nodes.set()
        for t in loops:
            t.join(15)
        assert not errors, errors[:5]  # no call failed: nobody was dropped or starved
        for i in (0, 1):
            assert len(latencies[i]) >= 10 and max(latencies[i]) < 2.0, (i, max(latencies[i]))
        refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        cancelled = codes.count(grpc.StatusCode.CANCELLED)
        assert refused + cancelled == 50, codes
        assert refused >= 50 - limits.pending_per_host and ended < bound
        # a normal upload and download still work
        nodes[0].push("center", np.arange(1000, dtype=np.float32), round_id=0)
        out = np.zeros(1000, np.float32)
        nodes[1].pull("center", out, round_id=0)
        np.testing.assert_array_equal(out, np.arange(1000))
    finally:
        release.set()
        stop_nodes.set()
        stop_server.set()
        server.join(20)
        for ch in channels:
            ch.close()
    summary = json.loads((tmp_path / "global" / "summary.json").read_text())
    assert summary["refused"]["host"] >= 50 - limits.pending_per_host
    assert summary["cancelled"]["header"] == 50 - refused


@pytest.fixture
def small():
    """A server with short bounds: 1 s for a header, 1 s of waiting on the peer."""
    config = JobConfig(num_groups=2, workers=1, job_id="job", round_timeout=3.0)
    servicer = build_servicer(config)
    limits = Limits.for_job(2, config.round_timeout, header_wait=1.0, idle=1.0, lifetime=6.0)
    srv, port = create_server("127.0.0.1:0", servicer, security=SEC, limits=limits)
    yield servicer, port, limits
    srv.stop(grace=0.2).wait(5)


def _header(c: GlobalClient, params: int, round_id: int = 0, buffer=pb.BUFFER_KIND_CENTER):
    return pb.PushParamsRequest(header=pb.PushHeader(
        node=pb.NodeId(job_id="job", node_index=c.node_index, session=c.session),
        round_id=round_id, buffer=buffer, param_count=params))


def _chunk(offset: int, values: np.ndarray):
    return pb.PushParamsRequest(chunk=pb.ParamChunk(offset=offset, data=values.tobytes()))


def test_an_upload_that_stalls_mid_way_is_cancelled_and_the_next_one_seeds(small):
    servicer, port, limits = small
    c = _client(port, 0)
    _join(c, params=8)
    release = threading.Event()

    def stalls():
        yield _header(c, 8)
        yield _chunk(0, np.ones(4, np.float32))
        release.wait(30)

    stub = pb_grpc.GlobalServerStub(SEC.channel(f"127.0.0.1:{port}", []))
    t0 = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.PushParams(stalls(), timeout=30)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert 0.9 < time.monotonic() - t0 < limits.idle + 1.5
    finally:
        release.set()
    assert servicer.admission.cancelled["idle"] == 1 and not servicer.params.center_ready
    end = time.monotonic() + 5
    while servicer.admission.open_streams and time.monotonic() < end:
        time.sleep(0.02)
    assert servicer.admission.open_streams == 0  # its thread is back
    c.push("center", np.full(8, 3.0, np.float32), round_id=0)  # the seed is free again
    assert servicer.params.center_ready


def test_a_download_nobody_reads_is_cancelled(small):
    servicer, port, limits = small
    n = 1 << 24  # 64 MB: more than the transport buffers hold (16 MB fitted in them once, in
    # a full CI run: HTTP/2 windows grown by BDP probing plus loopback socket buffers)
    c = _client(port, 0)
    _join(c, params=n)
    c.push("center", np.ones(n, np.float32), round_id=0)
    stub = pb_grpc.GlobalServerStub(SEC.channel(f"127.0.0.1:{port}", []))
    stream = stub.PullParams(pb.PullParamsRequest(
        node=pb.NodeId(job_id="job", node_index=0, session=c.session), round_id=0,
        buffer=pb.BUFFER_KIND_CENTER, chunk_elements=1 << 16), timeout=30)
    next(stream)  # then never read again
    end = time.monotonic() + limits.idle + 3.0
    while not servicer.admission.cancelled["idle"] and time.monotonic() < end:
        time.sleep(0.05)
    assert servicer.admission.cancelled["idle"] == 1
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED


def test_streams_are_capped_per_session_with_a_clear_status(small):
    servicer, port, limits = small
    c = _client(port, 0)
    _join(c, params=8)
    release = threading.Event()

    def seed_then_wait():
        yield _header(c, 8)
        release.wait(30)

    channel = SEC.channel(f"127.0.0.1:{port}", [])
    stub = pb_grpc.GlobalServerStub(channel)
    try:
        # two seeds of node 0 in progress: one receiving, one waiting for it
        held = [stub.PushParams.future(seed_then_wait(), timeout=10)
                for _ in range(limits.streams_per_session)]
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as e:
            stub.PushParams(seed_then_wait(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "node 0 already has 2 parameter streams open" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # downloads count too
            c.pull("center", np.zeros(8, np.float32), round_id=0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = _client(port, 1)
        _join(other, params=8)  # another node is not held back by node 0's cap
        out = np.zeros(8, np.float32)
        with pytest.raises(grpc.RpcError) as e:
            other.pull("center", out, round_id=0)  # admitted: it waits for the seed, then times out
        assert e.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in held:  # both end within the bounds (idle; the second seed after the first)
            assert call.exception(timeout=limits.idle + 3.0) is not None
    finally:
        release.set()
        channel.close()
    assert servicer.admission.refused["session"] == 2


class _Aborted(Exception):
    pass


class _Context:
    def peer(self):
        return "ipv4:10.0.0.9:4242"

    def abort(self, code, details):
        raise _Aborted(code, details)


class _Details:
    method = "/lsgd.v1.GlobalServer/ReportRound"


def test_long_polls_are_capped_per_session():
    adm = Admission(Limits.for_job(1, 3.0))
    gate = threading.Event()
    handler = adm.intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(lambda req, ctx: gate.wait(10)), _Details())
    mine = pb.ReportRoundRequest(node=pb.NodeId(node_index=0, session=5))
    waiting = [threading.Thread(target=handler.unary_unary, args=(mine, _Context()))
               for _ in range(adm.limits.polls_per_session)]
    for t in waiting:
        t.start()
    time.sleep(0.2)
    try:
        with pytest.raises(_Aborted) as e:
            handler.unary_unary(mine, _Context())
        assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "node 0 already has 2 credit, round or digest calls waiting" in e.value.args[1]
        gate.set()  # the waiting ones answer; another session was never limited by them
        other = pb.ReportRoundRequest(node=pb.NodeId(node_index=1, session=6))
        assert handler.unary_unary(other, _Context()) is True
    finally:
        gate.set()
        for t in waiting:
            t.join(5)
    assert handler.unary_unary(mine, _Context()) is True  # slots given back
    assert adm.refused == {"polls": 1}
