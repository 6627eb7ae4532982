"""The global server over real gRPC on 127.0.0.1:0: bad input gets the right status, no state change."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.params import ParamError, ParamStore
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.rules import EASGD


@pytest.fixture
def server():
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="easgd", alpha=0.1)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(grace=0.5).wait(5)


def client(address, node=0, job="job"):
    return GlobalClient(address, job, node, round_timeout=5.0)


def join(c, workers=2, params=10, algorithm="easgd", groups=2):
    return c.join(workers=workers, param_count=params, algorithm=algorithm, num_groups=groups,
                  connect_timeout=5)


def test_refused_join_changes_nothing(server):
    servicer, addr = server
    with pytest.raises(grpc.RpcError) as e:
        join(client(addr, 1), workers=3, params=999)  # wrong WORKERS: refused
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "same train.sh settings" in e.value.details()
    assert servicer.params.param_count is None and not servicer.coord.nodes
    join(client(addr, 0), params=10)  # the right node is still admitted, with its own size
    assert servicer.params.param_count == 10
    with pytest.raises(grpc.RpcError) as e:
        join(client(addr, 1), params=11)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "parameters" in e.value.details()


def test_message_for_another_job_or_session_is_refused(server):
    servicer, addr = server
    c = client(addr, 0)
    join(c)
    other = client(addr, 0, job="other")
    other.session = c.session
    with pytest.raises(grpc.RpcError) as e:
        other.heartbeat()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "other" in e.value.details()
    c.session += 1  # a stale or forged session
    with pytest.raises(grpc.RpcError) as e:
        c.acquire(consumed=5, late=0, released=0, want=1, last_round_seen=0, max_wait=0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert servicer.coord.done == 0


def test_over_report_is_invalid_argument_and_not_counted(server):
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a), join(b)
    g = a.acquire(consumed=0, late=0, released=0, want=100, last_round_seen=0, max_wait=0).grant
    with pytest.raises(grpc.RpcError) as e:
        a.acquire(consumed=g + 1, late=0, released=0, want=0, last_round_seen=0, max_wait=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.coord.done == 0 and servicer.coord.nodes[0].outstanding == g


def test_bad_uploads_are_refused(server):
    servicer, addr = server
    c = client(addr, 0)
    join(c, params=10)
    stub = pb_grpc.GlobalServerStub(grpc.insecure_channel(addr))
    with pytest.raises(grpc.RpcError) as e:  # no header
        stub.PushParams(iter([pb.PushParamsRequest(chunk=pb.ParamChunk(offset=0, data=b"abcd"))]),
                        timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:  # wrong size
        c.push("center", np.zeros(11, np.float32), round_id=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:  # not expected: no round
        c.push("sum", np.zeros(10, np.float32), round_id=3, summands=2)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    header = pb.PushHeader(node=pb.NodeId(job_id="job", node_index=0, session=c.session),
                           round_id=0, buffer=pb.BUFFER_KIND_CENTER, param_count=10)
    with pytest.raises(grpc.RpcError) as e:  # truncated: 3 bytes is not a float32
        stub.PushParams(iter([pb.PushParamsRequest(header=header),
                              pb.PushParamsRequest(chunk=pb.ParamChunk(offset=0, data=b"abc"))]),
                        timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not servicer.params.center_ready
    c.push("center", np.arange(10, dtype=np.float32), round_id=0)  # a good seed still works
    out = np.zeros(10, np.float32)
    c.pull("center", out, round_id=0)
    np.testing.assert_array_equal(out, np.arange(10))


def test_a_broken_seed_upload_lets_the_next_node_seed():
    store = ParamStore(EASGD(alpha=0.1))
    store.set_param_count(4)

    def broken():
        yield 0, np.ones(2, np.float32).tobytes()
        raise ConnectionError("node died mid-upload")

    with pytest.raises(ConnectionError):
        store.push(0, 0, "center", 4, 0, broken())
    assert not store.center_ready
    store.push(1, 0, "center", 4, 0, iter([(0, np.full(4, 2.0, np.float32).tobytes())]))
    assert store.center_ready
    with pytest.raises(ParamError) as e:
        store.push(0, 0, "center", 4, 0, iter([(0, np.zeros(4, np.float32).tobytes())]))
    assert e.value.code == "ALREADY_EXISTS"
    np.testing.assert_array_equal(store.buffers["center"], 2.0)


def test_easgd_exchange_over_grpc_moves_the_center(server):
    """Two nodes upload their sums; the center moves by beta toward the mean; both download it."""
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a, params=3), join(b, params=3)
    a.push("center", np.zeros(3, np.float32), round_id=0)
    held = {0: 0, 1: 0}
    rnd = None
    for _ in range(200):  # take and use credits until the first round opens
        for c, i in ((a, 0), (b, 1)):
            ans = c.acquire(consumed=held[i], late=0, released=0, want=100, last_round_seen=0,
                            max_wait=0)
            held[i] = ans.grant
            rnd = rnd or (ans.round_id or None)
        if rnd:
            break
    assert rnd == 1 and servicer.coord.done == 2 * 2 * 64  # g_comm boundary of the total
    results = {}

    def node(c, i, vec):
        results[i] = c.report_round(rnd, None, participants=2)
        c.push("sum", vec, rnd, summands=2)
        out = np.zeros(3, np.float32)
        c.pull("center", out, rnd)
        results[f"c{i}"] = out

    threads = [threading.Thread(target=node, args=(a, 0, np.array([2, 4, 6], np.float32))),
               threading.Thread(target=node, args=(b, 1, np.array([6, 4, 2], np.float32)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # mean of 4 participants = [2, 2, 2]; beta = alpha * 4 = 0.4; center 0 -> 0.8
    np.testing.assert_allclose(results["c0"], [0.8, 0.8, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(results["c0"], results["c1"])
    assert results[0].participants == 4 and results[0].node_count == 2


@pytest.mark.parametrize("offset, size", [(0, 0), (5, 3), (300, 200), (1 << 40, 1)])
def test_hand_framed_chunks_match_protobuf(offset, size):
    """The client's hand-written framing is the protobuf encoding of lsgd.proto's messages."""
    from lsgd.local_server.transfer_client import _parse_chunk
    from lsgd.wire import varint as _varint

    data = np.arange(size, dtype=np.float32).tobytes()
    msg = pb.ParamChunk(offset=offset, data=data).SerializeToString()
    got_offset, start, nbytes = _parse_chunk(msg + b"\x18\x07")  # plus an unknown varint field
    assert (got_offset, msg[start:start + nbytes]) == (offset, data)
    inner = b"\x08" + _varint(offset) + b"\x12" + _varint(len(data))
    framed = b"\x12" + _varint(len(inner) + len(data)) + inner + data
    parsed = pb.PushParamsRequest.FromString(framed)
    assert parsed.chunk.offset == offset and parsed.chunk.data == data


def test_evaluation_round_averages_sums_and_the_leader_need_not_wait_for_them():
    from lsgd.rules import LSGD
    from lsgd.rules.base import RoundKind

    store = ParamStore(LSGD(0.1, 0.1, 0.0, 0.0, 1, 1))
    store.set_param_count(4)
    store.begin(5, RoundKind.GLOBAL, leader_node=1, reports={0: 2, 1: 2}, timeout=10.0, average=True)

    def chunks(v):
        return iter([(0, np.full(4, v, np.float32).tobytes())])

    store.push(1, 5, "global_leader", 4, 0, chunks(7.0))
    # the leader is downloadable while the nodes' sums are still missing (no deadlock with a
    # node that downloads the leader before it uploads its sum)
    got = b"".join(part for _, part in store.pull(5, "global_leader", 1 << 20, timeout=0.5))
    np.testing.assert_array_equal(np.frombuffer(got, np.float32), 7.0)
    with pytest.raises(ParamError):
        list(store.pull(5, "average", 1 << 20, timeout=0.2))  # sums missing: not ready
    store.push(0, 5, "sum", 4, 2, chunks(2.0))
    store.push(1, 5, "sum", 4, 2, chunks(6.0))
    got = b"".join(part for _, part in store.pull(5, "average", 1 << 20, timeout=0.5))
    np.testing.assert_array_equal(np.frombuffer(got, np.float32), 2.0)  # (2 + 6) / 4 workers


def test_non_finite_uploads_are_refused_and_change_no_buffer():
    store = ParamStore(EASGD(alpha=0.1))
    store.set_param_count(4)
    bad = np.array([1.0, np.nan, 2.0, 3.0], np.float32)
    with pytest.raises(ParamError, match="non-finite values at element 1") as e:
        store.push(0, 0, "center", 4, 0, iter([(0, bad.tobytes())]))
    assert e.value.code == "INVALID_ARGUMENT" and not store.center_ready
    assert not store.buffers["center"].any()
