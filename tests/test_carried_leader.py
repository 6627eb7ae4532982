"""A round's answer carries the leader (issue 15): a node that reports a global round with
``then_pull`` gets the round's leader whole in the answer, on the session port, in place of the
download call it would make next, and the next ``pull`` of it takes it from there. The leader's
own node is answered at once; a leader that never comes is that download's refusal, in the
answer, in the time the download would have taken; a ``then_pull`` of another buffer is refused
before it counts in the barrier; elsewhere (``PORT``'s ``Session``) it is ignored and the node
pulls, as before. Answers carry how many nodes reported, not their list (O(N) each).
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


@pytest.fixture(params=["aio", "sync"])
def served(request):
    security = Security(secret=SECRET)
    config = JobConfig(num_groups=NODES, workers=1, job_id="job", algorithm="lsgd",
                       round_timeout=2.0, g_comm=4, l_comm=4)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer, security=security, bulk_address=None,
                              session_address="127.0.0.1:0" if request.param == "aio" else None)
    yield Served(servicer, f"127.0.0.1:{port}", security, srv)
    srv.stop(grace=0.5).wait(5)


def _joined(served: Served, node: int) -> GlobalClient:
    c = GlobalClient(served.addr, "job", node, round_timeout=2.0, security=served.security)
    c.join(workers=1, param_count=N, algorithm="lsgd", num_groups=NODES, connect_timeout=5)
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


def _round(served: Served, upload: bool = True, then_pull: str | None = "global_leader"):
    """Every node reports the first global round (node 1 holds the best loss); the leader's
    node uploads its leader when ``upload``. Returns (clients, answers, seconds to each answer,
    leader vector)."""
    nodes = [_joined(served, i) for i in range(NODES)]
    rid = {}
    ts = [threading.Thread(target=lambda c=c: rid.setdefault(c.node_index, _to_round(c)))
          for c in nodes]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert len(set(rid.values())) == 1
    r = rid[0]
    v = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    answers, took = {}, {}

    def report(c: GlobalClient) -> None:
        t0 = time.monotonic()
        answers[c.node_index] = c.report_round(r, Candidate(c.node_index, 1.0 if c.node_index != 1
                                                            else 0.1), 1, then_pull=then_pull)
        took[c.node_index] = time.monotonic() - t0
        if upload and answers[c.node_index].leader_node == c.node_index:
            time.sleep(0.3)  # the others' answers wait for this upload
            c.push("global_leader", v, r)

    ts = [threading.Thread(target=report, args=(c,)) for c in nodes]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return nodes, answers, took, v, r


def test_the_answer_carries_the_leader_and_the_next_pull_takes_it(served):
    nodes, answers, took, v, r = _round(served)
    aio = served.srv.sessions is not None
    assert all(a.leader_node == 1 and a.node_count == NODES for a in answers.values())
    assert nodes[1]._carried is None and took[1] < 0.25  # the leader's node: at once
    for i in (0, 2):
        out = np.zeros(N, np.float32)
        pulls = served.servicer.calls.counts.get("PullParams", 0)
        nodes[i].pull("global_leader", out, r)
        assert np.array_equal(out, v)
        carried = served.servicer.calls.counts.get("PullParams", 0) == pulls
        assert carried == aio  # on the session port no call was made for it
        assert (took[i] >= 0.3) == aio  # its answer waited for the upload
    for c in nodes:
        c.close()


@pytest.mark.parametrize("served", ["aio"], indirect=True)  # PORT's Session: the case above
def test_a_leader_that_never_comes_is_the_downloads_refusal_in_the_answer(served):
    """The leader's node does not upload: the others' answers come when the round's exchange
    gives up on it (the round time-out) with the download's refusal, which their pull raises
    at once."""
    nodes, answers, took, v, r = _round(served, upload=False)
    for i in (0, 2):
        assert answers[i].leader_node == 1 and 1.9 < took[i] < 6
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            nodes[i].pull("global_leader", np.zeros(N, np.float32), r)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no global leader" in e.value.details()
        assert time.monotonic() - t0 < 0.2  # the refusal came with the answer
    for c in nodes:
        c.close()


def test_a_then_pull_of_another_buffer_is_refused_before_the_barrier_counts_it():
    security = Security(secret=SECRET)
    config = JobConfig(num_groups=NODES, workers=1, job_id="job", algorithm="lsgd",
                       round_timeout=2.0, g_comm=4, l_comm=4)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer, security=security, bulk_address=None,
                              session_address="127.0.0.1:0")
    try:
        served = Served(servicer, f"127.0.0.1:{port}", security, srv)
        nodes = [_joined(served, i) for i in range(NODES)]
        rid = {}
        ts = [threading.Thread(target=lambda c=c: rid.setdefault(c.node_index, _to_round(c)))
              for c in nodes]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        r = rid[0]
        req = pb.ReportRoundRequest(node=nodes[0]._node(), round_id=r, participants=1,
                                    then_pull=pb.BUFFER_KIND_CENTER)
        with pytest.raises(grpc.RpcError) as e:
            nodes[0]._on_stream("report", req, 5.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "then_pull" in e.value.details()
        assert 0 not in servicer.coord.round.reports  # the barrier did not count it
        answers = {}
        ts = [threading.Thread(target=lambda c=c: answers.setdefault(  # it may report again
            c.node_index, c.report_round(r, None, 1))) for c in nodes]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert [answers[i].node_count for i in range(NODES)] == [NODES] * NODES
        for c in nodes:
            c.close()
    finally:
        srv.stop(grace=0.5).wait(5)


def test_without_then_pull_the_answer_carries_nothing_and_the_node_pulls(served):
    nodes, answers, took, v, r = _round(served, then_pull=None)
    for i in (0, 2):
        assert nodes[i]._carried is None
        pulls = served.servicer.calls.counts.get("PullParams", 0)
        out = np.zeros(N, np.float32)
        nodes[i].pull("global_leader", out, r)
        assert np.array_equal(out, v)
        assert served.servicer.calls.counts.get("PullParams", 0) == pulls + 1
    for c in nodes:
        c.close()
