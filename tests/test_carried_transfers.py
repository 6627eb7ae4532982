"""Transfers that travel with a round's report and answer (issue 15), on the session port.

- ``then_pull``: a node that reports a global round gets the round's leader whole in the
  answer, in place of the download call it would make next, and the next ``pull`` of it takes
  it from there. The leader's own node is answered at once; a leader that never comes is that
  download's refusal, in the answer, in the time the download would have taken.
- ``then_push``: a node's report carries its sum, taken once the round closes; the answer says
  so (or why not), and the node's next push of that sum is that upload.
- A malformed one refuses the report before it counts in the barrier, and changes nothing;
  elsewhere (``PORT``'s ``Session``) both are ignored and the node transfers as before.
- Answers carry how many nodes reported, not their list (O(N) each).
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.leader import Candidate
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.rules.base import RoundKind
from lsgd.security import Security
from tests.test_session_stream import SECRET, Served

N = 1000  # elements: 4 KB, a small vector
NODES = 3


def _serve(transport: str, algorithm: str = "lsgd"):
    security = Security(secret=SECRET)
    config = JobConfig(num_groups=NODES, workers=1, job_id="job", algorithm=algorithm,
                       round_timeout=2.0, g_comm=4, l_comm=4)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer, security=security, bulk_address=None,
                              session_address="127.0.0.1:0" if transport == "aio" else None)
    return Served(servicer, f"127.0.0.1:{port}", security, srv)


@pytest.fixture(params=["aio", "sync"])
def served(request):
    s = _serve(request.param)
    yield s
    s.srv.stop(grace=0.5).wait(5)


@pytest.fixture(params=["aio", "sync"])
def easgd(request):
    s = _serve(request.param, "easgd")
    yield s
    s.srv.stop(grace=0.5).wait(5)


def _joined(served: Served, node: int) -> GlobalClient:
    c = GlobalClient(served.addr, "job", node, round_timeout=2.0, security=served.security)
    c.join(workers=1, param_count=N, algorithm=served.servicer.coord.algorithm,
           num_groups=NODES, connect_timeout=5)
    return c


def _to_round(c: GlobalClient) -> int:
    """Use credits until the first global round; its id."""
    consumed, seen = 0, 0
    for _ in range(200):
        g = c.acquire(consumed=consumed, late=0, released=0, want=64, last_round_seen=seen,
                      max_wait=0.5)
        consumed = g.grant
        if g.round_id > seen and g.round_kind == int(RoundKind.GLOBAL):
            return g.round_id
        seen = max(seen, g.round_id)
    raise AssertionError("no global round")


def _all(fn, nodes: list[GlobalClient]) -> None:
    """``fn(node)`` for every node at once (a barrier needs them all)."""
    ts = [threading.Thread(target=fn, args=(c,)) for c in nodes]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)


def _at_round(served: Served) -> tuple[list[GlobalClient], int]:
    """Every node joined and at the first global round: (clients, its id)."""
    nodes = [_joined(served, i) for i in range(NODES)]
    rid: dict[int, int] = {}
    _all(lambda c: rid.setdefault(c.node_index, _to_round(c)), nodes)
    assert len(rid) == NODES and len(set(rid.values())) == 1
    return nodes, rid[0]


def _round(served: Served, upload: bool = True, then_pull: str | None = "global_leader"):
    """Every node reports the first global round (node 1 holds the best loss); the leader's
    node uploads its leader 0.3 s after its answer when ``upload``. Returns (clients, answers,
    when each answer came and, under "up", when the upload started (monotonic), the leader
    vector, the round)."""
    nodes, r = _at_round(served)
    v = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    answers, at = {}, {}

    def report(c: GlobalClient) -> None:
        answers[c.node_index] = c.report_round(r, Candidate(c.node_index, 1.0 if c.node_index != 1
                                                            else 0.1), 1, then_pull=then_pull)
        at[c.node_index] = time.monotonic()
        if upload and answers[c.node_index].leader_node == c.node_index:
            time.sleep(0.3)  # the others' answers wait for this upload
            at["up"] = time.monotonic()
            c.push("global_leader", v, r)

    _all(report, nodes)
    return nodes, answers, at, v, r


def test_the_answer_carries_the_leader_and_the_next_pull_takes_it(served):
    nodes, answers, at, v, r = _round(served)
    aio = served.srv.sessions is not None
    assert all(a.leader_node == 1 and a.node_count == NODES for a in answers.values())
    assert nodes[1]._carried is None  # the leader's node: answered before it uploads
    for i in (0, 2):
        out = np.zeros(N, np.float32)
        pulls = served.servicer.calls.counts.get("PullParams", 0)
        nodes[i].pull("global_leader", out, r)
        assert np.array_equal(out, v)
        carried = served.servicer.calls.counts.get("PullParams", 0) == pulls
        assert carried == aio  # on the session port no call was made for it
        assert (at[i] >= at["up"]) == aio  # its answer waited for the upload
        assert not aio or at[i] - at["up"] < 0.5  # and came with the store's news of it
    for c in nodes:
        c.close()


@pytest.mark.parametrize("served", ["aio"], indirect=True)  # PORT's Session: the case above
def test_a_leader_that_never_comes_is_the_downloads_refusal_in_the_answer(served):
    """The leader's node does not upload: the others' answers come when the round's exchange
    gives up on it (the round time-out) with the download's refusal, which their pull raises
    at once."""
    nodes, answers, at, v, r = _round(served, upload=False)
    for i in (0, 2):  # the leader's node is answered at the close; the others 2 s later
        assert answers[i].leader_node == 1 and 1.5 < at[i] - at[1] < 10
        sent: list[str] = []
        nodes[i]._on_stream = lambda field, req, timeout: sent.append(field)
        nodes[i].transfers.pull = lambda *a, **k: sent.append("PullParams")
        with pytest.raises(grpc.RpcError) as e:
            nodes[i].pull("global_leader", np.zeros(N, np.float32), r)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no global leader" in e.value.details()
        assert sent == []  # the refusal came with the answer: no call was made
    for c in nodes:
        c.close()


def _sum_upload(c: GlobalClient, r: int, vec: np.ndarray, **header) -> pb.SessionUpload:
    h = pb.PushHeader(node=c._node(), round_id=r, buffer=pb.BUFFER_KIND_NODE_SUM,
                      param_count=vec.size, summands=1)
    for k, v in header.items():
        setattr(h, k, v) if k != "node" else h.node.CopyFrom(v)
    return pb.SessionUpload(header=h, data=vec.tobytes())


BAD = {
    "then_pull of the center": lambda c, r, v: dict(then_pull=pb.BUFFER_KIND_CENTER),
    "then_push of the leader": lambda c, r, v: dict(then_push=_sum_upload(
        c, r, v, buffer=pb.BUFFER_KIND_GLOBAL_LEADER)),
    "then_push of another round": lambda c, r, v: dict(then_push=_sum_upload(c, r + 1, v)),
    "then_push of another node": lambda c, r, v: dict(then_push=_sum_upload(
        c, r, v, node=pb.NodeId(job_id="job", node_index=2, session=c.session))),
    "then_push not finite": lambda c, r, v: dict(then_push=_sum_upload(
        c, r, np.where(np.arange(N) == 7, np.nan, v).astype(np.float32))),
    "then_push of another size": lambda c, r, v: dict(then_push=_sum_upload(c, r, v[:-1])),
    "then_pull in an unknown format": lambda c, r, v: dict(
        then_pull=pb.BUFFER_KIND_GLOBAL_LEADER, then_pull_wire=7),
    "then_push in an unknown format": lambda c, r, v: dict(then_push=_sum_upload(
        c, r, v, wire_format=7)),
    "then_push of no summands": lambda c, r, v: dict(then_push=_sum_upload(c, r, v, summands=0)),
    "then_push of more summands than participants": lambda c, r, v: dict(
        then_push=_sum_upload(c, r, v, summands=2)),
    "then_push of a weight out of range": lambda c, r, v: dict(then_push=_sum_upload(
        c, r, v, weight=1e9)),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_malformed_carried_transfer_refuses_the_report_before_it_counts(bad):
    """Each is INVALID_ARGUMENT for the report: the barrier does not count it, no sum is taken,
    and the node may report again (and is then counted)."""
    served = _serve("aio", "easgd")
    try:
        nodes, r = _at_round(served)
        v = np.ones(N, np.float32)
        req = pb.ReportRoundRequest(node=nodes[0]._node(), round_id=r, participants=1,
                                    **BAD[bad](nodes[0], r, v))
        with pytest.raises(grpc.RpcError) as e:
            nodes[0]._on_stream("report", req, 5.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "then_" in e.value.details() or "upload" in e.value.details(), e.value.details()
        assert 0 not in served.servicer.coord.round.reports
        answers = {}
        _all(lambda c: answers.setdefault(c.node_index, c.report_round(r, None, 1)), nodes)
        assert [answers[i].node_count for i in range(NODES)] == [NODES] * NODES
        for c in nodes:
            c.close()
    finally:
        served.srv.stop(grace=0.5).wait(5)


def _sums(r: int) -> list[np.ndarray]:
    return [np.full(N, float(i + 1), np.float32) for i in range(NODES)]


def test_the_report_carries_the_sum_and_the_next_push_is_it(easgd):
    """EASGD: every node's report carries its sum; on the session port the answer says it was
    taken and the node's push of it makes no call; the exchange settles with every sum."""
    nodes, r = _at_round(easgd)
    sums, answers, sent = _sums(r), {}, []
    for c in nodes:  # what each report carried
        c._on_stream = (lambda call: lambda field, req, timeout: (
            field == "report" and sent.append(req.HasField("then_push")),
            call(field, req, timeout))[1])(c._on_stream)
    _all(lambda c: answers.setdefault(c.node_index, c.report_round(
        r, None, 1, then_push=(sums[c.node_index], 1, 0.0))), nodes)
    aio = easgd.srv.sessions is not None
    assert sent == [aio] * NODES  # PORT's Session would ignore it: not sent there
    taken = easgd.servicer.params.exchange.summands  # before any node pushed
    assert taken == (NODES if aio else 0)
    pushes = easgd.servicer.calls.counts.get("PushParams", 0)
    _all(lambda c: c.push("sum", sums[c.node_index], r, summands=1), nodes)
    made = easgd.servicer.calls.counts.get("PushParams", 0) - pushes
    assert made == (0 if aio else NODES)
    ex = easgd.servicer.params.exchange
    assert ex.round_id == r and ex.settled and ex.sums_ok and ex.summands == NODES
    assert all(c.transfers.moved["session"] == 1 for c in nodes)
    for c in nodes:
        c.close()


@pytest.mark.parametrize("served", ["aio"], indirect=True)
def test_a_carried_sum_the_round_does_not_take_is_refused_in_the_answer(served):
    """An LSGD global round takes no sums: the answer says why, and the node's push of that
    sum raises it at once (as the push itself would have been refused)."""
    nodes, r = _at_round(served)
    sums, answers = _sums(r), {}
    _all(lambda c: answers.setdefault(c.node_index, c.report_round(
        r, None, 1, then_push=(sums[c.node_index], 1, 0.0))), nodes)
    calls = dict(served.servicer.calls.counts)
    for c in nodes:
        with pytest.raises(grpc.RpcError) as e:
            c.push("sum", sums[c.node_index], r, summands=1)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no upload of sum" in e.value.details()
        c.close()
    assert served.servicer.calls.counts == calls  # the refusal came with the answer


def test_without_then_pull_the_answer_carries_nothing_and_the_node_pulls(served):
    nodes, answers, at, v, r = _round(served, then_pull=None)
    for i in (0, 2):
        assert nodes[i]._carried is None
        pulls = served.servicer.calls.counts.get("PullParams", 0)
        out = np.zeros(N, np.float32)
        nodes[i].pull("global_leader", out, r)
        assert np.array_equal(out, v)
        assert served.servicer.calls.counts.get("PullParams", 0) == pulls + 1
    for c in nodes:
        c.close()


@pytest.mark.parametrize("served", ["aio"], indirect=True)
def test_a_leader_without_a_route_is_taken_on_the_loop_not_in_the_pool(served):
    """A leader that waits for no digest (no PLANE=chain route) is taken on the event loop,
    as a sum is; only one that came down a route waits in the pool (test_session_vectors'
    digest test). Here the pool refuses work: the round completes all the same."""

    class NoPool:
        def submit(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            raise AssertionError("the leader went to the pool")

        def shutdown(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            pass

    served.srv.sessions._pool = NoPool()
    nodes, answers, at, v, r = _round(served)
    out = np.zeros(N, np.float32)
    nodes[0].pull("global_leader", out, r)
    assert np.array_equal(out, v)
    for c in nodes:
        c.close()


def test_a_carried_sum_in_a_format_the_server_cannot_read_leaves_the_report_alone(monkeypatch):
    """A server without ml_dtypes cannot read bfloat16: the report still counts (only the sum
    fails, as its own push would), and the node's push of it is refused by the server."""
    pytest.importorskip("ml_dtypes")
    from lsgd.global_server import transfers
    from lsgd.global_server.params import ParamError

    real = transfers._wire_dtype

    def no_bfloat16(wire: str):  # noqa: ANN202
        if wire == "bfloat16":
            raise ParamError("UNIMPLEMENTED", "this server cannot use the bfloat16 wire format")
        return real(wire)

    monkeypatch.setattr(transfers, "_wire_dtype", no_bfloat16)
    served = _serve("aio", "easgd")
    try:
        nodes, r = _at_round(served)
        sums, answers = _sums(r), {}
        _all(lambda c: answers.setdefault(c.node_index, c.report_round(
            r, None, 1, wire="bfloat16", then_push=(sums[c.node_index], 1, 0.0))), nodes)
        assert [answers[i].node_count for i in range(NODES)] == [NODES] * NODES
        for c in nodes:
            with pytest.raises(grpc.RpcError) as e:
                c.push("sum", sums[c.node_index], r, summands=1, wire="bfloat16")
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            c.close()
    finally:
        served.srv.stop(grace=0.5).wait(5)


def test_at_a_round_close_answers_that_carry_the_leader_wait_for_it_not_for_the_round():
    """The nodes whose answers carry the leader have nothing to do before it is in: the
    round's close wakes the leader's node (and nodes carrying nothing), and the store's news
    of the leader wakes the rest, so that the loop reads the leader's upload first."""
    import asyncio

    from lsgd.global_server.admission import Limits
    from lsgd.global_server.aio_session import SessionServer
    from lsgd.global_server.session_calls import PARAMS, ROUNDS

    servicer = build_servicer(JobConfig(num_groups=4, workers=1, job_id="job", algorithm="lsgd"))
    servicer.params.set_param_count(N)
    servicer.params.begin(3, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1, 3: 1}, 5.0)
    assert servicer.params.leader_pending() == 3
    sessions = SessionServer(servicer, Limits.for_job(4, 5.0))
    heard: list[tuple[int, str]] = []

    async def main() -> None:
        sessions._loop = asyncio.get_running_loop()
        news = {"round": None}

        async def barrier(node: int, carries: int) -> None:
            await sessions._wait(ROUNDS, 5.0, node, carries)
            heard.append((node, news["round"]))

        tasks = [asyncio.create_task(barrier(n, c)) for n, c in ((0, 3), (1, 0), (2, 3), (3, 3))]
        await asyncio.sleep(0.01)
        news["round"] = "round closed"
        sessions._fire((ROUNDS,))
        await asyncio.sleep(0.05)
        assert sorted(heard) == [(1, "round closed"), (2, "round closed")]
        news["round"] = "leader in"
        sessions._fire((PARAMS,))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    asyncio.run(main())
    assert sorted(heard) == [(0, "leader in"), (1, "round closed"), (2, "round closed"),
                             (3, "leader in")]
    leader = np.ones(N, np.float32).tobytes()
    servicer.params.push(2, 3, "global_leader", N, 0, iter(((0, leader),)))
    assert servicer.params.leader_pending() == 0  # in: nothing to wait for


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16384, 300_000])
def test_an_answer_encoded_around_the_leader_parses_as_protobuf_encodes_it(size):
    """The answer that carries the leader is encoded by hand around the leader's bytes (shared
    by every node's answer, not copied through protobuf): it must read back as the message
    protobuf would have made, whatever the sizes of its parts."""
    from lsgd.global_server.session_calls import _with_download

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    answer = pb.ReportRoundResponse(has_leader=True, leader_node=3, participants=17,
                                    node_count=512, evaluate=True)
    answer.leader.worker_id, answer.leader.loss = 24, 0.25
    want = pb.SessionReply(n=300, report=answer)
    want.report.download.data = data
    got = pb.SessionReply.FromString(b"".join(_with_download(300, answer, data)))
    assert got == want and got.report.download.data == data
