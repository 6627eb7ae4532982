"""Small vectors on the Session stream (issue 15): a vector of less than 1 MiB on the wire
moves whole in one message on the node's stream, on both servers, instead of a PullParams or
PushParams stream of its own. A download waits for its round as PullParams does (on the asyncio
server without holding a thread); only a round's leader or sum is uploaded there (the other
uploads may wait); each is refused when too large, and its MAC covers its own call field.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.buffers import ParamError
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.security import Security
from lsgd.rules.base import RoundKind
from lsgd.signing import ACQUIRE_FIELD, PULL_FIELD, PUSH_FIELD, derive_key, session_mac
from tests.test_session_stream import SECRET, Served

N = 1000  # elements: 4 KB, far below the bulk port's and the session's bounds


@pytest.fixture(params=["sync", "aio"])
def transport(request):
    return request.param


@pytest.fixture(params=["plain", "secret"])
def server(request, transport):
    security = Security(secret=SECRET) if request.param == "secret" else Security()
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="easgd",
                       round_timeout=1.5)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer, security=security, bulk_address=None,
                              session_address="127.0.0.1:0" if transport == "aio" else None)
    yield Served(servicer, f"127.0.0.1:{port}", security, srv)
    srv.stop(grace=0.5).wait(5)


def _joined(addr: str, security: Security, node: int, n: int = N) -> GlobalClient:
    c = GlobalClient(addr, "job", node, round_timeout=1.5, security=security)
    c.join(workers=2, param_count=n, algorithm="easgd", num_groups=2, connect_timeout=5)
    return c


def _vector(n: int = N) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(n).astype(np.float32)


def test_a_rounds_download_comes_whole_on_the_stream_once_it_is_ready(server):
    """Round 5's leader is not uploaded yet: the download waits (another node's calls are
    answered meanwhile), and comes whole once the leader's node uploads it."""
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 1, {0: 2, 1: 2}, 5.0)
    v, out, got = _vector(), np.zeros(N, np.float32), {}

    def pull() -> None:
        t0 = time.monotonic()
        a.pull("global_leader", out, round_id=5)
        got["s"] = time.monotonic() - t0

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting for the leader
    t0 = time.monotonic()
    b.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
    assert time.monotonic() - t0 < 0.5  # the wait holds up nobody else
    b.push("global_leader", v, round_id=5)
    t.join(5)
    assert not t.is_alive() and np.array_equal(out, v) and got["s"] >= 0.3
    assert a.transfers.moved == {"bulk": 0, "grpc": 0, "session": 1}
    assert servicer.calls.counts["PullParams"] == 1 and servicer.calls.counts["Session"] == 2
    assert servicer.stats.copy()[2] == v.nbytes  # bytes sent
    a.close(), b.close()


def test_a_download_never_ready_is_deadline_exceeded_and_the_stream_goes_on(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 1, {0: 2, 1: 2}, 60.0)  # settles after the wait
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        a.pull("global_leader", np.zeros(N, np.float32), round_id=5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "not" in e.value.details()
    assert 1.4 < time.monotonic() - t0 < 5  # the round time-out, 1.5 s
    stream = a._stream
    assert a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0,
                     max_wait=0).grant > 0
    assert a._stream is stream  # refused a call, not the stream
    a.close(), b.close()


def test_bfloat16_comes_whole_rounded_as_on_a_pull_stream(server):
    pytest.importorskip("ml_dtypes")
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 1, {0: 2, 1: 2}, 5.0)
    v = _vector()
    b.push("global_leader", v, round_id=5, wire="bfloat16")
    whole, streamed = np.zeros(N, np.float32), np.zeros(N, np.float32)
    a.pull("global_leader", whole, round_id=5, wire="bfloat16")
    a.transfers.pull(a._node(), "global_leader", streamed, 5, "bfloat16")  # a PullParams stream
    assert np.array_equal(whole, streamed) and np.abs(whole - v).max() < 0.05
    assert a.transfers.moved == {"bulk": 0, "grpc": 1, "session": 1}
    a.close(), b.close()


def test_a_newest_vector_is_downloaded_on_its_own_stream(server):
    """Round 0 (the newest center or leader, e.g. an asynchronous rule's own thread) may wait
    for a seed: it does not hold the node loop's stream meanwhile."""
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    v = _vector()
    b.push("center", v, round_id=0)
    out = np.zeros(N, np.float32)
    a.pull("center", out, round_id=0)
    assert np.array_equal(out, v) and a.transfers.moved == {"bulk": 0, "grpc": 1, "session": 0}
    a.close(), b.close()


def test_a_large_vector_or_mail_asked_on_the_stream_is_refused_and_the_node_streams_it(server):
    """1 MiB or more does not come on a session message: refused (INVALID_ARGUMENT) when asked
    for there; the node's own ``pull`` sends such a vector on PullParams (no bulk port here)."""
    servicer, addr, security = server
    n = (1 << 20) // 4  # 1 MiB of float32
    a, b = _joined(addr, security, 0, n), _joined(addr, security, 1, n)
    v = _vector(n)
    b.push("center", v, round_id=0)
    for buffer, why in ((pb.BUFFER_KIND_CENTER, "too large"), (pb.BUFFER_KIND_MAIL, "mail")):
        with pytest.raises(grpc.RpcError) as e:
            a._on_stream("pull", pb.PullParamsRequest(node=a._node(), buffer=buffer), 5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    out = np.zeros(n, np.float32)
    a.pull("center", out, round_id=0)
    assert np.array_equal(out, v) and a.transfers.moved == {"bulk": 0, "grpc": 1, "session": 0}
    assert servicer.stats.copy()[0].get(("PullParams", "INVALID_ARGUMENT")) == 2
    a.close(), b.close()


def test_a_download_while_another_call_holds_the_stream_goes_on_its_own_stream(server):
    """A round's download made while another call waits on the stream does not queue behind
    that call."""
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 1, {0: 2, 1: 2}, 5.0)
    v = _vector()
    b.push("global_leader", v, round_id=5)
    out = np.zeros(N, np.float32)
    with a._call_lock:  # as a long-poll of the loop would hold it
        t = threading.Thread(target=a.pull, args=("global_leader", out, 5))
        t.start()
        t.join(5)
    assert not t.is_alive() and np.array_equal(out, v)
    assert a.transfers.moved == {"bulk": 0, "grpc": 1, "session": 0}
    a.close(), b.close()


def _one_signed(server, node: pb.NodeId, call: str, body: bytes, mac_field: int):
    """Open a stream for ``node`` and send one ``call`` whose MAC was made for ``mac_field``:
    the reply, or the ``grpc.RpcError`` that ended the stream."""
    nonce, key = os.urandom(16), derive_key(SECRET)
    out, replies, ch = server.raw(pb.SessionRequest(n=0, node=node, nonce=nonce))
    out.put(pb.SessionRequest(n=1, mac=session_mac(key, nonce, 1, mac_field, body),
                              **{call: body}))
    try:
        return next(replies)
    except grpc.RpcError as exc:
        return exc
    finally:
        out.put(None)
        ch.close()


@pytest.mark.parametrize("server", ["secret"], indirect=True)  # MACs need a job secret
def test_a_download_message_needs_the_mac_of_its_own_field(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    b.push("center", _vector(), round_id=0)
    body = pb.PullParamsRequest(node=a._node(), buffer=pb.BUFFER_KIND_CENTER).SerializeToString()
    refused = _one_signed(server, a._node(), "pull", body, ACQUIRE_FIELD)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "MAC" in refused.details()
    reply = _one_signed(server, a._node(), "pull", body, PULL_FIELD)
    assert reply.code == 0 and len(reply.pull.data) == 4 * N
    a.close(), b.close()


def test_a_rounds_leader_and_sums_go_up_whole_and_its_average_comes_down(server):
    """A final round (node 0's leader, both nodes' sums): every upload and download on the
    streams, and the average is the sums' over their summands."""
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 0, {0: 2, 1: 2}, 5.0)
    leader, sa, sb = _vector(), np.full(N, 2.0, np.float32), np.full(N, 6.0, np.float32)
    a.push("global_leader", leader, 5)
    a.push("sum", sa, 5, summands=2)
    b.push("sum", sb, 5, summands=2)
    got_leader, got_average = np.zeros(N, np.float32), np.zeros(N, np.float32)
    b.pull("global_leader", got_leader, 5)
    b.pull("average", got_average, 5)
    assert np.array_equal(got_leader, leader) and np.allclose(got_average, 2.0)
    assert a.transfers.moved == {"bulk": 0, "grpc": 0, "session": 2}
    assert b.transfers.moved == {"bulk": 0, "grpc": 0, "session": 3}
    assert servicer.calls.counts["PushParams"] == 3 and servicer.calls.counts["Session"] == 2
    assert servicer.stats.copy()[1] == 3 * 4 * N  # bytes received
    a.close(), b.close()


def test_refused_uploads_change_nothing_and_the_stream_goes_on(server):
    """Non-finite values, a wrong size, a buffer that is not a round's own, another node's
    header, a vector too large: each is refused with its one line before it is taken (the
    round's exchange does not fail), and the round still takes the real uploads."""
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(6, RoundKind.FINAL, 0, {0: 2, 1: 2}, 5.0)

    def header(node, buffer=pb.BUFFER_KIND_NODE_SUM, count=N):
        return pb.PushHeader(node=node, round_id=6, buffer=buffer, param_count=count, summands=2)

    nan = np.full(N, np.nan, np.float32).tobytes()
    cases = [
        (pb.SessionUpload(header=header(a._node()), data=nan),
         grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
        (pb.SessionUpload(header=header(a._node()), data=bytes(4 * N - 4)),
         grpc.StatusCode.INVALID_ARGUMENT, "the job's model has"),
        (pb.SessionUpload(header=header(a._node(), count=N + 1), data=bytes(4 * N + 4)),
         grpc.StatusCode.INVALID_ARGUMENT, "the job's model has"),
        (pb.SessionUpload(header=header(a._node(), pb.BUFFER_KIND_CENTER), data=bytes(4 * N)),
         grpc.StatusCode.INVALID_ARGUMENT, "leader or sum"),
        (pb.SessionUpload(header=header(b._node()), data=bytes(4 * N)),
         grpc.StatusCode.PERMISSION_DENIED, "this stream is node 0"),
        (pb.SessionUpload(header=header(a._node(), count=1 << 18), data=bytes(1 << 20)),
         grpc.StatusCode.INVALID_ARGUMENT, "too large"),
    ]
    for upload, code, why in cases:
        with pytest.raises(grpc.RpcError) as e:
            a._on_stream("push", upload, 5)
        assert e.value.code() == code and why in e.value.details(), (why, e.value.details())
        ex = servicer.params.exchange  # refused before it was taken: nothing changed
        assert not ex.failed and (0, "sum") in ex.expected and not ex.in_flight
    stream = a._stream
    a.push("global_leader", _vector(), 6)  # the same stream takes the genuine uploads
    a.push("sum", np.ones(N, np.float32), 6, summands=2)
    b.push("sum", np.ones(N, np.float32), 6, summands=2)
    assert a._stream is stream and servicer.params.exchange.settled
    assert not servicer.params.exchange.failed
    a.close(), b.close()


@pytest.mark.parametrize("server", ["secret"], indirect=True)
def test_an_upload_message_needs_the_mac_of_its_own_field(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    servicer.params.begin(5, RoundKind.FINAL, 0, {0: 2, 1: 2}, 5.0)
    body = pb.SessionUpload(header=pb.PushHeader(
        node=a._node(), round_id=5, buffer=pb.BUFFER_KIND_NODE_SUM, param_count=N, summands=2),
        data=np.ones(N, np.float32).tobytes()).SerializeToString()
    refused = _one_signed(server, a._node(), "push", body, PULL_FIELD)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "MAC" in refused.details()
    assert (0, "sum") in servicer.params.exchange.expected  # nothing taken
    reply = _one_signed(server, a._node(), "push", body, PUSH_FIELD)
    assert reply.code == 0 and reply.HasField("push")
    assert (0, "sum") not in servicer.params.exchange.expected
    a.close(), b.close()


def test_at_a_round_close_the_leaders_node_hears_first():
    """The other nodes' downloads wait for the leader's upload: its node's barrier is answered
    before theirs, whatever order they reported in."""
    import asyncio

    from lsgd.global_server.aio_session import SessionServer
    from lsgd.global_server.session_calls import ROUNDS
    from lsgd.global_server.admission import Limits

    servicer = build_servicer(JobConfig(num_groups=4, workers=1, job_id="job", algorithm="lsgd"))
    servicer.params.set_param_count(N)
    servicer.params.begin(3, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1, 3: 1}, 5.0)
    sessions = SessionServer(servicer, Limits.for_job(4, 5.0))
    heard: list[int] = []

    async def main() -> None:
        sessions._loop = asyncio.get_running_loop()

        async def barrier(node: int) -> None:
            await sessions._wait(ROUNDS, 5.0, node)
            heard.append(node)

        tasks = [asyncio.create_task(barrier(n)) for n in (0, 1, 3, 2)]
        await asyncio.sleep(0.01)  # all four wait
        sessions._fire((ROUNDS,))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    asyncio.run(main())
    assert heard[0] == 2 and sorted(heard) == [0, 1, 2, 3]


def test_a_leader_that_waits_for_its_digest_holds_up_no_other_node(server, monkeypatch):
    """PLANE=chain: the server takes a leader only with its source's digest, and waits a while
    for it. That wait must not stop the asyncio server's other streams."""
    from lsgd.global_server import digests

    monkeypatch.setattr(digests, "WAIT", 1.0)
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    b.acquire(consumed=0, late=0, released=0, want=1, last_round_seen=0, max_wait=0)
    # node 0 feeds the server the leader that came down the route (FINAL: expected on EASGD)
    servicer.params.begin(5, RoundKind.FINAL, 1, {0: 1, 1: 1}, 30.0, leader_uploader=0)
    errors: list[grpc.RpcError] = []

    def up() -> None:
        try:
            a.push("global_leader", _vector(), 5)
        except grpc.RpcError as exc:
            errors.append(exc)

    t = threading.Thread(target=up)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    b.acquire(consumed=0, late=0, released=0, want=1, last_round_seen=0, max_wait=0)
    assert time.monotonic() - t0 < 0.5
    t.join(10)
    assert errors and errors[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "registered no digest" in errors[0].details()
    a.close(), b.close()


def test_only_news_for_a_download_wakes_the_downloads():
    """A sum that leaves the round open is no news for a download (with N nodes waiting for
    the center that would be N wake-ups per upload); the upload that settles it is."""
    from lsgd.global_server.params import ParamStore

    store = ParamStore(JobConfig(algorithm="easgd").make_rule())
    store.set_param_count(N)
    heard = []
    store.on_change = lambda: heard.append(1)
    store.push(0, 0, "center", N, 0, [(0, _vector().tobytes())])  # the seed
    assert len(heard) == 1
    store.begin(3, RoundKind.GLOBAL, None, {0: 1, 1: 1, 2: 1}, 5.0)
    assert len(heard) == 2
    for node in (0, 1):
        store.push(node, 3, "sum", N, 1, [(0, np.ones(N, np.float32).tobytes())])
    assert len(heard) == 2
    store.push(2, 3, "sum", N, 1, [(0, np.ones(N, np.float32).tobytes())])
    assert store.exchange.settled and len(heard) >= 3


def test_a_rounds_leader_is_encoded_once_for_every_download_and_never_outlives_it():
    """Every node's small download of a round's leader gets the same bytes, read once (at 512
    nodes, 511 downloads of each leader); the next round's leader, the other wire format and a
    download outside a round are each read on their own."""
    from lsgd.global_server.params import ParamStore

    store = ParamStore(JobConfig(algorithm="lsgd").make_rule())
    store.set_param_count(N)
    first, second = _vector(), _vector() * 2
    store.begin(3, RoundKind.GLOBAL, 0, {0: 1, 1: 1, 2: 1}, 5.0)
    store.push(0, 3, "global_leader", N, 0, [(0, first.tobytes())])
    a = store.pull_whole(3, "global_leader", 1.0)
    b = store.pull_whole(3, "global_leader", 1.0)
    assert a is b and a == first.tobytes()
    assert store.pull_whole(0, "global_leader", 1.0) == first.tobytes()  # the newest, read anew
    if importlib.util.find_spec("ml_dtypes") is not None:
        half = store.pull_whole(3, "global_leader", 1.0, wire="bfloat16")
        assert len(half) == N * 2 and store.pull_whole(3, "global_leader", 1.0) is a
    store.begin(4, RoundKind.GLOBAL, 0, {0: 1, 1: 1, 2: 1}, 5.0)
    with pytest.raises(ParamError, match="round 3 is over"):
        store.pull_whole(3, "global_leader", 0.0)
    store.push(0, 4, "global_leader", N, 0, [(0, second.tobytes())])
    c = store.pull_whole(4, "global_leader", 1.0)
    assert c == second.tobytes() and c is not a


def test_a_stable_download_chunk_is_a_copy_that_a_write_meanwhile_leaves_alone():
    """The bulk port with a secret sends each chunk from a copy (``stable``): a write to the
    vector between a chunk's MAC and its send must not change the chunk (the node would take
    the mismatch for a forgery); the download then ends ABORTED, as every download does."""
    from lsgd.global_server.params import ParamStore

    store = ParamStore(JobConfig(algorithm="lsgd").make_rule())
    store.set_param_count(N)
    first, second = _vector(), _vector() * 2
    store.begin(3, RoundKind.GLOBAL, 0, {0: 1, 1: 1}, 5.0)
    store.push(0, 3, "global_leader", N, 0, [(0, first.tobytes())])
    for stable in (True, False):
        chunks = store.pull(0, "global_leader", N // 4, 1.0, views=True, stable=stable)
        _, view = next(chunks)
        before = bytes(view)
        assert before == first[: N // 4].tobytes()
        store.begin(4 if stable else 5, RoundKind.GLOBAL, 0, {0: 1, 1: 1}, 5.0)
        store.push(0, 4 if stable else 5, "global_leader", N, 0, [(0, second.tobytes())])
        assert (bytes(view) == before) is stable  # a view of the vector itself changes
        with pytest.raises(ParamError, match="changed during the download"):
            list(chunks)
        first, second = second, first
