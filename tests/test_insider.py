"""A buggy or hostile node holding the secret: every count bounded, every refusal changes nothing
(issue 9, items 13, 15, 16 and the resume part of 17; restarts are in test_server_restart.py).
Servers on 127.0.0.1 port 0, driven by a client that speaks the protocol directly."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.coordinator import Coordinator, CoordinatorError, Schedule
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient
from lsgd.local_server.recovery import RecoveryMixin
from lsgd.local_server.state import NodeError, Report
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.rules.base import RoundKind

U64_MAX = 2**64 - 1


def _state(servicer) -> str:
    """Counter, rounds, membership, outstanding credits, param count and buffers."""
    c = servicer.coord
    with servicer.cond:
        state = c.state(0.0) | {"outstanding": {i: n.outstanding for i, n in c.nodes.items()},
                                "alive": {i: n.alive for i, n in c.nodes.items()},
                                "round": (c.round.id, c.round.closed) if c.round else None,
                                "params": servicer.params.param_count}
        bufs = b"".join(np.ascontiguousarray(b).tobytes() for b in servicer.params.buffers.values())
    return json.dumps(state, sort_keys=True, default=str) + hashlib.sha1(bufs).hexdigest()


@pytest.fixture
def server():
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="easgd", alpha=0.1,
                       l_comm=4, g_comm=4)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(grace=0.5).wait(5)


def client(address, node=0):
    return GlobalClient(address, "job", node, round_timeout=5.0)


def join(c, params=10, timeout=5.0, **kw):
    return c.join(workers=2, param_count=params, algorithm="easgd", num_groups=2,
                  connect_timeout=timeout, **kw)


def refused(servicer, call, code, *words):
    """``call`` fails with ``code`` (and a message naming ``words``) and changes nothing."""
    before = _state(servicer)
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    for w in words:
        assert w in e.value.details(), e.value.details()
    assert _state(servicer) == before
    return e.value.details()


def raw_stub(address):
    return pb_grpc.GlobalServerStub(grpc.insecure_channel(address))


# ---------------------------------------------------------------------- item 13: model size
def test_a_model_beyond_the_servers_memory_is_refused_before_anything_changes(server):
    servicer, addr = server
    a = client(addr, 0)
    msg = refused(servicer, lambda: join(a, params=10**12), grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "1000000000000 parameters", "needs 12.0 TB", "available")
    assert servicer.params.param_count is None and not servicer.coord.nodes, msg
    servicer.params.memory = lambda: 1000  # a small machine: 3 x 4 x 100 bytes do not fit
    refused(servicer, lambda: join(a, params=100), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "needs 1.2 kB", "1.0 kB is available")
    servicer.params.memory = lambda: None
    assert join(a, params=10).session and servicer.params.param_count == 10
    servicer._journaled = None  # the state is saved without error (it crashed the server)
    json.dumps(servicer.state_dump())


def test_node_0_decides_the_model_size(server):
    servicer, addr = server
    stub = raw_stub(addr)
    early = pb.JoinRequest(node=pb.NodeId(job_id="job", node_index=1), num_workers=2,
                           param_count=10**8, algorithm="easgd", num_groups=2)
    refused(servicer, lambda: stub.Join(early, timeout=5), grpc.StatusCode.UNAVAILABLE,
            "waiting for node 0")
    assert servicer.params.param_count is None and not servicer.coord.nodes
    join(client(addr, 0), params=10)
    assert servicer.params.param_count == 10
    refused(servicer, lambda: stub.Join(early, timeout=5), grpc.StatusCode.FAILED_PRECONDITION,
            "same model")


def test_a_node_ready_before_node_0_waits_for_it_and_joins(server):
    """A normal 2-node start where node 1's workers are ready first: its client retries."""
    servicer, addr = server
    got = {}
    t = threading.Thread(target=lambda: got.update(r=join(client(addr, 1), params=10, timeout=20)))
    t.start()
    time.sleep(0.6)
    assert not servicer.coord.nodes  # node 1 is still waiting
    join(client(addr, 0), params=10)
    t.join(15)
    assert got["r"].session and sorted(servicer.coord.nodes) == [0, 1]


class _Node(RecoveryMixin):
    """The parts of a LocalServer that _reattach uses."""

    def __init__(self, client, fate=None):
        self.cfg = JobConfig(num_groups=2, workers=2, algorithm="easgd", reconnect_timeout=60)
        self.client, self.global_fate = client, (lambda: fate)
        self.detached_since, self.next_reattach, self.reattach_delay = time.monotonic(), 0.0, 0.2
        self.pool, self.workers, self.report, self.unanswered = 0, [], Report(), (0, 0)
        self.param_count, self.heartbeat = 10, None

    def _live(self):
        return []


# ---------------------------------------------------------------------- item 15: counts
def test_counts_beyond_what_a_node_can_have_done_are_refused(server):
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a), join(b)
    g = a.acquire(consumed=0, late=0, released=0, want=100, last_round_seen=0, max_wait=0).grant
    assert g > 0
    stub = raw_stub(addr)
    nid = pb.NodeId(job_id="job", node_index=0, session=a.session)
    for fields in (dict(late_consumed=U64_MAX), dict(consumed=U64_MAX), dict(released=U64_MAX),
                   dict(late_consumed=1), dict(consumed=g, released=1)):
        req = pb.AcquireCreditsRequest(node=nid, seq=a.last_seq + 1, **fields)
        refused(servicer, lambda: stub.AcquireCredits(req, timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT, "node 0")
    leave = pb.LeaveRequest(node=nid, consumed=0, late_consumed=U64_MAX)
    refused(servicer, lambda: stub.Leave(leave, timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
    # a reattach: uncounted steps and held credits bounded by what it held and may do detached
    for held, unreported in ((0, 10**9), (U64_MAX, 0), (10**6, 0), (0, U64_MAX)):
        req = pb.JoinRequest(node=nid, num_workers=2, param_count=10, algorithm="easgd",
                             num_groups=2, resume_session=a.session, held_credits=held,
                             unreported=unreported, seq=a.last_seq + 1)
        refused(servicer, lambda: stub.Join(req, timeout=5), grpc.StatusCode.INVALID_ARGUMENT,
                "node 0")
    # what it can have done is accepted: its credits, and a detached period of its own
    period = servicer.coord.schedule.global_period
    before = servicer.coord.done
    join(a, resume=True, held=0, unreported=g + period)
    assert servicer.coord.done == before + g + period
    a.acquire(consumed=0, late=0, released=0, want=0, last_round_seen=0, max_wait=0)


def test_a_sum_of_more_vectors_than_the_node_reported_is_refused(server):
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a), join(b)
    held, rnd = {0: 0, 1: 0}, None
    while rnd is None:  # a global (EASGD center) round
        for i, c in ((0, a), (1, b)):
            ans = c.acquire(consumed=held[i], late=0, released=0, want=100, last_round_seen=0,
                            max_wait=0)
            held[i] = ans.grant
            rnd = rnd or (ans.round_id or None)
    threads = [threading.Thread(target=c.report_round, args=(rnd, None, 1)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sums = np.ones(10, np.float32)
    refused(servicer, lambda: a.push("sum", sums, rnd, summands=2),
            grpc.StatusCode.INVALID_ARGUMENT, "1..1")
    refused(servicer, lambda: a.push("sum", sums, rnd, summands=2**32 - 1),
            grpc.StatusCode.INVALID_ARGUMENT)
    a.push("sum", sums, rnd, summands=1)


def test_a_detached_node_takes_at_most_one_global_period_of_its_own():
    from lsgd.local_server import server as ls
    from lsgd.local_server import messages as m
    from lsgd.local_server.view import NodeView

    cfg = JobConfig(num_groups=2, workers=2, g_comm=4, l_comm=4, algorithm="easgd")
    node = ls.LocalServer.__new__(ls.LocalServer)
    node.cfg, node.detached_since, node.share, node.own_credits = cfg, None, 3, 0
    node.view = NodeView(cfg)  # what the progress line shows (a wait while detached)
    node.workers = [SimpleNamespace(local=i, gone=False) for i in range(2)]
    sent = []
    node._send = lambda w, msg: sent.append(msg.count if isinstance(msg, m.Credits) else msg)
    node._reattach = lambda: False
    node._detach("test")
    node.pending = deque()
    for _ in range(20):  # the workers keep asking
        node.pending.extend(i for i in (0, 1) if i not in node.pending)
        node._serve_pending()
    assert sum(sent) == 2 * 2 * 4  # NUM_GROUPS*WORKERS*G_COMM, then they wait
    assert len(node.pending) == 2


# ---------------------------------------------------------------------- item 16: sequence
def test_a_credit_request_numbered_ahead_is_refused_and_cannot_wedge_the_node(server):
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a), join(b)
    a.acquire(consumed=0, late=0, released=0, want=100, last_round_seen=0, max_wait=0)
    stub = raw_stub(addr)
    nid = pb.NodeId(job_id="job", node_index=0, session=a.session)
    for seq in (a.last_seq + 2, 10**6, U64_MAX):
        req = pb.AcquireCreditsRequest(node=nid, seq=seq, want=1)
        refused(servicer, lambda: stub.AcquireCredits(req, timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT, f"expected {a.last_seq + 1}")
    # the real node goes on numbering as before
    a.acquire(consumed=0, late=0, released=0, want=0, last_round_seen=0, max_wait=0)
    assert servicer.coord.nodes[0].last_seq == a.last_seq


def test_a_join_numbered_below_the_last_request_ends_the_node_instead_of_looping(server):
    servicer, addr = server
    a, b = client(addr, 0), client(addr, 1)
    join(a), join(b)
    for _ in range(3):
        a.acquire(consumed=0, late=0, released=0, want=0, last_round_seen=0, max_wait=0)
    stub = raw_stub(addr)
    req = pb.JoinRequest(node=pb.NodeId(job_id="job", node_index=0, session=a.session),
                         num_workers=2, param_count=10, algorithm="easgd", num_groups=2,
                         resume_session=a.session, seq=2)
    refused(servicer, lambda: stub.Join(req, timeout=5), grpc.StatusCode.FAILED_PRECONDITION,
            "older than its request 3")


def test_a_node_waiting_for_node_0_says_so(server):
    servicer, addr = server
    with pytest.raises(Exception) as e:
        join(client(addr, 1), timeout=1.0)
    assert "node 0 did not join" in str(e.value) and "IP_ADDR" not in str(e.value)


def test_minutes_end_the_job_over_grpc_while_a_node_sits_on_its_credits():
    config = JobConfig(num_groups=2, workers=2, job_id="job", algorithm="easgd", alpha=0.1,
                       l_comm=100, g_comm=100, iterations=None, minutes=0.01, round_timeout=0.5)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    addr = f"127.0.0.1:{port}"
    try:
        a, b = client(addr, 0), client(addr, 1)
        join(a), join(b)
        assert b.acquire(consumed=0, late=0, released=0, want=50, last_round_seen=0,
                         max_wait=0).grant == 50  # held, never reported
        end, final = time.monotonic() + 10, None
        while time.monotonic() < end and final is None:
            b.heartbeat()
            ans = a.acquire(consumed=0, late=0, released=0, want=0, last_round_seen=0,
                            max_wait=0.2)
            if ans.round_id and ans.round_kind == RoundKind.FINAL:
                final = ans
        assert final is not None, "the final round never opened"
        assert time.monotonic() - (end - 10) < 0.6 + 0.5 + 3  # minutes + round_timeout + slack
        b.acquire(consumed=50, late=0, released=0, want=0, last_round_seen=final.round_id,
                  max_wait=0)  # its steps arrive later: counted as late
        assert servicer.coord.done == 50
    finally:
        srv.stop(grace=0.5).wait(5)


def _coord(seconds=None, **kw):
    sched = Schedule.for_job(num_groups=1, workers=2, l_comm=100, g_comm=100, local_rounds=False,
                             max_iterations=kw.pop("iters", None))
    return Coordinator(job_id="j", algorithm="lsgd", num_groups=1, workers=2, schedule=sched,
                       max_seconds=seconds, node_timeout=5.0, round_timeout=10.0,
                       join_timeout=30.0, now=0.0, **kw)


def test_minutes_always_end_the_job_even_when_a_node_sits_on_its_credits():
    c = _coord(seconds=60)
    s = c.join(job_id="j", index=0, workers=2, algorithm="lsgd", num_groups=1, now=0).session
    assert c.acquire(0, s, consumed=0, late=0, released=0, want=50, last_round_seen=0,
                     now=1).grant == 50
    for t in range(55, 70):  # it heartbeats but never reports its 50 credits
        c.heartbeat(0, s, now=t)
        c.tick(now=t)
    assert c.stop_reason == "time budget reached" and c.round is None  # waits round_timeout
    c.heartbeat(0, s, now=70)
    c.tick(now=70)  # round_timeout (10 s) after the stop
    assert c.round is not None and c.round.kind == RoundKind.FINAL and c.round.iteration == 0
    # its steps on the forfeited credits arrive later: counted (as late), the rest refused
    c.acquire(0, s, consumed=30, late=0, released=20, want=0, last_round_seen=c.round.id, now=72)
    assert c.done == 30
    # at most the 20 released credits + one last step per worker (2) past the end
    with pytest.raises(CoordinatorError) as e:
        c.acquire(0, s, consumed=0, late=23, released=0, want=0, last_round_seen=1, now=72)
    assert e.value.code == "INVALID_ARGUMENT" and c.done == 30
    c.acquire(0, s, consumed=0, late=22, released=0, want=0, last_round_seen=1, now=72)
    assert c.done == 52


# ---------------------------------------------------------------------- item 17: resume
def test_a_resume_that_matches_no_node_is_refused(server):
    servicer, addr = server
    a = client(addr, 0)
    join(a)
    stub = raw_stub(addr)
    for session in (a.session + 2, 12345):  # a stale or forged session; node 1 never joined
        for idx in (0, 1):
            req = pb.JoinRequest(node=pb.NodeId(job_id="job", node_index=idx), num_workers=2,
                                 param_count=10, algorithm="easgd", num_groups=2,
                                 resume_session=session, seq=1)
            refused(servicer, lambda: stub.Join(req, timeout=5),
                    grpc.StatusCode.FAILED_PRECONDITION, "cannot reattach", "train.sh")
    assert sorted(servicer.coord.nodes) == [0]


def test_a_node_whose_session_is_unknown_ends_with_one_line(server):
    servicer, addr = server
    a = client(addr, 0)
    join(a)
    a.session += 2  # the server does not know it (e.g. restarted from an older state)
    node = _Node(a)
    with pytest.raises(NodeError) as e:
        node._reattach()
    assert "cannot reattach" in str(e.value) and "FAILED_PRECONDITION" in str(e.value)
    assert len(servicer.coord.nodes) == 1
