"""Stopping a job from node 0 (issue 9, items 1-3): the coordinator's decision driven by hand
with an injected clock, the same over real gRPC, and how a node classifies its own end."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import grpc
import pytest

from lsgd import exitcodes
from lsgd.config import JobConfig
from lsgd.global_server.coordinator import CoordinatorError
from lsgd.global_server.server import build_servicer, create_server, stop_linger
from lsgd.leader import Candidate
from lsgd.local_server.ending import EndingMixin, JobStopped
from lsgd.local_server.global_client import GlobalClient, stop_reason_of
from lsgd.local_server.state import NodeError
from lsgd.rules.base import Exchange, RoundKind
from test_coordinator import acq, drain, join_all, make


def running(c):
    """Two nodes in a job, node 1 holding credits."""
    s = join_all(c, 2)
    assert acq(c, s, 1).grant > 0
    return s


def test_a_stop_from_node_0_is_recorded_and_every_later_answer_carries_it():
    c = make(iters=10**6)
    s = running(c)
    held = c.nodes[1].outstanding
    mine = acq(c, s, 0).grant  # node 0 steps on credits too
    assert mine > 0
    c.stop_job(0, s[0], "interrupted", consumed=mine, late=0, now=1.0)
    assert c.stopped == c.stop_reason == "job stopped on node 0: interrupted"
    assert c.nodes[0].left and c.done == mine  # node 0's last steps are counted
    assert c.stopped_for(1) == c.stopped and 1 in c.told
    g = acq(c, s, 1, consumed=held, now=1.1)  # steps are still counted; nothing more granted
    assert (g.grant, g.round, g.wait) == (0, None, False) and c.done == mine + held
    assert c.round is None  # no round opens after a stop, though the counter moved
    for resume in (0, s[1]):  # a fresh join and a reattach: refused, naming the reason
        with pytest.raises(CoordinatorError) as e:
            c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=1.2,
                   resume_session=resume)
        assert e.value.code == "FAILED_PRECONDITION" and str(e.value) == c.stopped


def test_a_stop_closes_the_open_round_and_its_waiters_are_told():
    c = make(iters=10**6)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    while rnd.kind != RoundKind.GLOBAL:
        for i in (0, 1):
            c.report(i, s[i], rnd.id, None, 2, now=0.0)
        rnd, _ = drain(c, s, [0, 1])
    c.report(1, s[1], rnd.id, Candidate(2, 0.5), 2, now=0.0)  # node 1 waits for node 0
    assert not c.round.closed
    c.stop_job(0, s[0], "interrupted", consumed=0, late=0, now=0.5)
    assert c.round.closed and c.outcome(1, rnd.id).ready  # the waiting report returns now


def test_the_server_may_exit_once_every_live_node_was_told_or_the_linger_passed():
    c = make(num_groups=3)
    s = join_all(c, 3)
    assert not c.stop_settled(0.0, linger=3.0)  # nothing stopped
    c.stop_job(0, s[0], "interrupted", consumed=0, late=0, now=10.0)
    assert not c.stop_settled(10.1, linger=3.0)
    c.stopped_for(1)
    assert not c.stop_settled(10.2, linger=3.0)  # node 2 has not heard yet
    assert c.stop_settled(13.0, linger=3.0)  # ... but the server does not wait for ever
    c.stopped_for(2)
    assert c.stop_settled(10.3, linger=3.0)


@pytest.mark.parametrize("who, session, consumed, code", [
    (1, None, 0, "PERMISSION_DENIED"),  # only node 0 may stop the job
    (0, 12345, 0, "FAILED_PRECONDITION"),  # a stale or forged session
    (0, None, 10**9, "INVALID_ARGUMENT"),  # more consumed than it holds
])
def test_a_refused_stop_changes_nothing(who, session, consumed, code):
    def state(c):  # a refused call of a member still shows it is alive (last_seen)
        snap = c.snapshot()
        for n in snap["nodes"].values():
            n.pop("last_seen")
        return snap

    c = make()
    s = running(c)
    before = state(c)
    with pytest.raises(CoordinatorError) as e:
        c.stop_job(who, session or s[who], "x", consumed=consumed, late=0, now=1.0)
    assert e.value.code == code
    assert state(c) == before and c.stopped is None and not c.nodes[0].left


def test_a_stop_reason_is_bounded_and_a_finished_job_is_not_stopped():
    c = make()
    s = running(c)
    c.stop_job(0, s[0], "x" * 10_000, consumed=0, late=0, now=1.0)
    assert len(c.stopped) < 600
    done = make(iters=8)
    s = join_all(done, 2)
    rnd, _ = drain(done, s, [0, 1])
    for i in (0, 1):
        done.report(i, s[i], rnd.id, None, 2, now=0.0)
    assert done.finished and not done.halt("too late", now=1.0) and done.stopped is None


def test_over_grpc_a_stop_reaches_the_other_node_and_its_rejoin(tmp_path):
    config = JobConfig(num_groups=2, workers=2, job_id="job", run_dir=str(tmp_path))
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    try:
        clients = [GlobalClient(f"127.0.0.1:{port}", "job", i, round_timeout=5.0) for i in (0, 1)]
        for c in clients:
            c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        assert clients[1].heartbeat() == 0 and clients[1].stopped == ""
        with pytest.raises(grpc.RpcError) as e:  # node 1 cannot stop the job
            clients[1].leave(0, 0, stop_job="me")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and servicer.coord.stopped is None
        clients[0].leave(0, 0, stop_job="interrupted")
        clients[1].heartbeat()
        assert clients[1].stopped == "job stopped on node 0: interrupted"
        answer = clients[1].acquire(consumed=0, late=0, released=0, want=5, last_round_seen=0,
                                    max_wait=0.0)
        assert answer.grant == 0
        late = GlobalClient(f"127.0.0.1:{port}", "job", 1, round_timeout=5.0)
        with pytest.raises(grpc.RpcError) as e:
            late.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        assert stop_reason_of(e.value) == "job stopped on node 0: interrupted"
    finally:
        srv.stop(grace=0.5).wait(5)
    assert 1 < stop_linger(config) <= 4.0  # three beats (one may be skipped) and a margin


class FakeNode(EndingMixin):
    """Just what ``EndingMixin`` reads of a ``LocalServer``."""

    def __init__(self, workers, rounds=0, healthy=0, elected=0, exchange=Exchange.LEADER,
                 **summary):
        self.workers = workers
        self.ending = {"rounds": rounds, "healthy": healthy, "elected": elected}
        self.rule = SimpleNamespace(exchange=exchange)
        self.cfg = SimpleNamespace(node_index=1, round_timeout=30.0)
        self.client = SimpleNamespace(stopped="", session=1)
        stats = summary.pop("async_stats", None)
        self.async_node = None if stats is None else SimpleNamespace(stats=lambda: stats)
        self.summary = summary


def worker(wid, error=None, reported=False, exitcode=0):
    return SimpleNamespace(worker_id=wid, error=error, reported=reported,
                           proc=SimpleNamespace(exitcode=exitcode))


@pytest.mark.parametrize("node, code, words", [
    (FakeNode([worker(0), worker(1)], rounds=5, healthy=10, elected=5), exitcodes.OK, "job finished"),
    (FakeNode([worker(0), worker(1, "RuntimeError: bug", reported=True, exitcode=1)], 5, 9, 5),
     exitcodes.DEGRADED, "worker 1 failed (RuntimeError: bug) and was not restarted"),
    (FakeNode([worker(0), worker(1, "process exited with code -9", exitcode=-9)], 5, 9, 5),
     exitcodes.DEGRADED, "worker 1 failed (process exited with code -9)"),
    (FakeNode([worker(0), worker(1, "its training loop ended")], 5, 9, 5), exitcodes.OK,
     "job finished"),  # a loop that ended by itself did not fail
    (FakeNode([worker(0)], rounds=5, healthy=0), exitcodes.DEGRADED, "every loss was non-finite"),
    (FakeNode([worker(0)], rounds=5, healthy=5, elected=0), exitcodes.DEGRADED,
     "no leader was ever elected"),
    (FakeNode([worker(0)], rounds=5, healthy=5, elected=0, exchange=Exchange.CENTER),
     exitcodes.OK, "job finished"),
    (FakeNode([worker(0)], rounds=1, healthy=1, elected=1, exchange=Exchange.CENTER,
              deltas_lost=True), exitcodes.DEGRADED,  # an asynchronous rule's last deltas
     "last center deltas or mail did not reach the global server within ROUND_TIMEOUT (30 s)"),
    (FakeNode([worker(0)], 1, 1, 1, Exchange.CENTER, async_stats={"rule_failures": 2}),
     exitcodes.DEGRADED, "the rule failed in 2 exchange(s)"),
    (FakeNode([worker(0)], 1, 1, 1, Exchange.CENTER, async_stats={"deltas_refused": 1}),
     exitcodes.DEGRADED, "refused 1 center delta(s) of this node, which were dropped"),
    (FakeNode([worker(0)], 1, 1, 1, Exchange.LEADER, async_stats={"mail_refused": 3}),
     exitcodes.OK, "job finished"),  # refused mail stays on the node: nothing is lost
])
def test_a_finished_node_says_whether_its_result_can_be_trusted(node, code, words):
    got, reason = node._ended(None)
    assert got == code and words in reason


def test_how_a_node_names_every_other_end():
    node = FakeNode([worker(0)])
    assert node._ended(JobStopped("job stopped on node 0: interrupted")) == (
        exitcodes.STOPPED, "job stopped on node 0: interrupted")
    assert node._ended(KeyboardInterrupt(signal.SIGINT)) == (exitcodes.INTERRUPTED, "interrupted")
    assert node._ended(KeyboardInterrupt(signal.SIGTERM)) == (exitcodes.TERMINATED, "terminated")
    assert node._ended(NodeError("no worker left")) == (exitcodes.FAILED, "no worker left")
    code, reason = node._ended(ValueError("oops"))
    assert code == exitcodes.FAILED and reason == "internal error: ValueError: oops"
    node.client.stopped = "job stopped on node 0: terminated"
    with pytest.raises(JobStopped):
        node._check_stopped()


def test_a_global_server_told_to_stop_tells_the_nodes_first(tmp_path):
    # SIGTERM to the global server alone (serve(): the first one halts the job this way)
    config = JobConfig(num_groups=2, workers=2, job_id="job", run_dir=str(tmp_path))
    servicer = build_servicer(config)
    assert not servicer.halt("terminated")  # no node: nothing to stop, nobody to tell
    srv, port = create_server("127.0.0.1:0", servicer)
    try:
        node0 = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
        node0.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        c = GlobalClient(f"127.0.0.1:{port}", "job", 1, round_timeout=5.0)
        c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        assert servicer.halt("terminated")
        c.heartbeat()
        assert c.stopped == "job stopped: the global server was terminated"
        assert not servicer.coord.stop_settled(servicer.clock(), linger=60.0)  # node 0 not told
        node0.heartbeat()
        assert servicer.coord.stop_settled(servicer.clock(), linger=60.0)  # all told: exit now
    finally:
        srv.stop(grace=0.5).wait(5)


def test_a_leaving_node_may_report_late_steps_on_credits_it_still_held():
    # A stuck worker's credits are released on the node, and its late steps come in before the
    # release reached the server: the stop's Leave (which carries no release) still counts them.
    c = make(iters=10**6)
    s = running(c)
    mine = acq(c, s, 0).grant
    assert mine >= 2
    c.stop_job(0, s[0], "interrupted", consumed=0, late=mine, now=1.0)
    assert c.stopped and c.done == mine
    held = c.nodes[1].outstanding
    c.leave(1, s[1], consumed=0, late=held, now=1.1)  # the same for a node told of the stop
    assert c.done == mine + held


def test_a_restarted_server_keeps_a_stopped_job_stopped():
    c = make(iters=10**6)
    s = running(c)
    c.stop_job(0, s[0], "interrupted", consumed=0, late=0, now=1.0)
    saved = c.state(1.0)
    again = make(iters=10**6, now=2.0)  # the restarted server process
    again.restore(saved, now=2.0)
    assert again.stopped == again.stop_reason == "job stopped on node 0: interrupted"
    with pytest.raises(CoordinatorError) as e:  # node 1 reattaches: told, not admitted
        again.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=2.1,
                   resume_session=s[1], seq=1)
    assert str(e.value) == again.stopped and 1 in again.told
    assert again.round is None and again.stop_settled(2.1, linger=60.0)  # all told: it may exit


def test_a_node_that_learns_of_the_stop_while_reattaching_ends_as_stopped():
    from test_insider import _Node

    class Refusing:
        session, epoch = 5, 1

        def join(self, **_):
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, "job stopped on node 0: interrupted")

    with pytest.raises(JobStopped) as e:
        _Node(Refusing())._reattach()
    assert str(e.value) == "job stopped on node 0: interrupted"


class _Status(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details
