"""A node's rounds, driven without processes or gRPC: the real LocalServer with stand-in workers
(answering on its queues at once) and a stand-in global client (a real Coordinator in-process,
or canned answers). Plus one small end-to-end run for leader election (issue 9, items 9-11)."""

from __future__ import annotations

import collections
import queue
import time
import types
import uuid

import grpc
import pytest

from conftest import metric_rows
from lsgd.config import JobConfig
from lsgd.global_server.coordinator import Coordinator, Schedule
from lsgd.local_server import messages as m
from lsgd.local_server.global_client import CreditAnswer, RoundAnswer
from lsgd.local_server.rounds import readers
from lsgd.local_server.server import LocalServer
from lsgd.local_server.state import WorkerState
from lsgd.local_server.store import NodeStore, StoreLayout
from lsgd.rules.base import CENTER, GLOBAL_LEADER, LOCAL_LEADER, RoundKind

PARAMS = 8


class FakeInbox(queue.Queue):
    """The node's inbox (``inbox.Inbox``) as one queue: the fake workers share it in-process."""

    def drain(self, pid: int) -> list[object]:
        return []  # what a dead fake worker sent is already in the queue


class FakeProc:
    def __init__(self) -> None:
        self.exitcode: int | None = None
        self.pid, self.name = 0, "fake-worker"

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.exitcode = -15

    kill = terminate


class FakeWorker:
    """A worker's side of its reply queue: answers each message at once, like a worker with
    nothing else to do. A worker marked ``late`` for a round holds its Done of that round (it is
    still pulling) and everything after it until ``finish()``."""

    def __init__(self, local: int, inbox: queue.Queue) -> None:
        self.local, self.inbox = local, inbox
        self.proc = FakeProc()
        self.pulls: list[m.Pull] = []
        self.healthy = True
        self.late: set[int] = set()
        self.held: list[object] | None = None  # messages waiting while it is still pulling

    def put(self, msg: object) -> None:
        if self.held is not None:
            self.held.append(msg)
        elif isinstance(msg, m.Credits):
            self.inbox.put(m.Ask(self.local, msg.count))  # takes its steps, asks again
        elif isinstance(msg, m.RoundCall):
            self.inbox.put(m.Join(self.local, msg.round_id, 1.0 + self.local, 0, 0, self.healthy))
        elif isinstance(msg, m.Pull):
            self.pulls.append(msg)
            if msg.reset:
                self.healthy = True
            if msg.round_id in self.late:
                self.held = [m.Done(self.local, msg.round_id, {})]
            else:
                self.inbox.put(m.Done(self.local, msg.round_id, {}))
        elif isinstance(msg, m.Evaluate):
            self.inbox.put(m.EvalResult(self.local, msg.round_id, msg.iteration, {}))
        elif isinstance(msg, m.Stop):
            self.proc.exitcode = 0

    def finish(self) -> None:
        """The late pull is over: its Done goes out, then what waited behind it."""
        held, self.held = self.held or [], None
        self.inbox.put(held[0])
        for msg in held[1:]:
            self.put(msg)

    def pulled_rounds(self) -> collections.Counter:
        """How often each round's pulls reached this worker (resets included)."""
        return collections.Counter(p.round_id for p in self.pulls if p.pulls)

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset (test)"


class FakeClient:
    """The node's global client. With a Coordinator it is that server in-process; without one,
    every report gets a canned answer. Records reports and downloads; uploads go nowhere."""

    def __init__(self, cfg: JobConfig, coord: Coordinator | None = None) -> None:
        self.cfg, self.coord = cfg, coord
        self.session, self.epoch, self.last_seq = 0, 1, 0
        self.stopped = ""  # the job was never stopped (GlobalClient.stopped)
        self.lose_report: set[int] = set()  # rounds whose first report never arrives
        self.reports: list[tuple[int, object, int]] = []  # (round, best, participants) received
        self.then_pulls: list[tuple[int, str | None]] = []  # (round, then_pull) of each report
        self.then_pushes: list[tuple[int, object]] = []  # (round, (summands, weight) or None)
        self.downloads: list[tuple[str, int]] = []
        self.uploads: list[tuple[str, int]] = []  # (buffer, round): the uploads go nowhere
        self.joins = 0

    def join(self, *, workers, param_count, algorithm, num_groups, connect_timeout, resume=False,
             held=0, unreported=0, unanswered=(0, 0)):
        self.joins += 1
        node = self.coord.join(job_id=self.cfg.job_id, index=0, workers=workers,
                               algorithm=algorithm, num_groups=num_groups, now=time.monotonic(),
                               resume_session=self.session if resume else 0, held=held,
                               unreported=unreported)
        self.session = node.session
        return types.SimpleNamespace(session=node.session, epoch=self.epoch, counter=self.coord.done,
                                     round_id=node.last_round_seen, seed_center=False)

    def acquire(self, *, consumed, late, released, want, last_round_seen, max_wait, used=0.0):
        g = self.coord.acquire(0, self.session, consumed=consumed, late=late, released=released,
                               want=want, last_round_seen=last_round_seen, now=time.monotonic(),
                               used_ms=int(used * 1000) if consumed else 0)
        r = g.round
        return CreditAnswer(g.grant, r.id if r else 0, int(r.kind) if r else 0,
                            r.iteration if r else 0, self.coord.done)

    def report_round(self, round_id, best, participants, weight=0.0, then_pull=None,
                     wire="float32", then_push=None):
        if round_id in self.lose_report:
            self.lose_report.discard(round_id)
            raise Unavailable()
        self.reports.append((round_id, best, participants))
        self.then_pulls.append((round_id, then_pull))
        self.then_pushes.append((round_id, then_push and then_push[1:]))
        if self.coord is None:
            return RoundAnswer(False, best, 0 if best else None, participants, 1)
        out = self.coord.report(0, self.session, round_id, best, participants, time.monotonic())
        assert out.ready  # one node: its report closes the round
        return RoundAnswer(out.missed, out.leader, out.leader_node, out.participants, len(out.nodes),
                           out.evaluate, out.checkpoint)

    def push(self, kind, vec, round_id, *args, **kwargs) -> None:
        self.uploads.append((kind, round_id))

    def pull(self, kind, out, round_id, wire="float32") -> None:
        self.downloads.append((kind, round_id))

    def leave(self, consumed, late) -> int:
        self.coord.leave(0, self.session, consumed, late, time.monotonic())
        return self.coord.done

    def close(self) -> None:
        pass


@pytest.fixture
def node(tmp_path):
    """``make(**knobs) -> (server, fake workers)``: a node of one job, no process started."""
    made: list[LocalServer] = []

    def make(coordinated: bool, **knobs):
        cfg = JobConfig(run_dir=str(tmp_path), job_id="t" + uuid.uuid4().hex[:12],
                        **{"workers": 2, "round_timeout": 0.3, **knobs})
        srv = LocalServer(cfg, "127.0.0.1:9")
        made.append(srv)
        srv.client.close()
        coord = None
        if coordinated:
            rule = cfg.make_rule()
            coord = Coordinator(job_id=cfg.job_id, algorithm=cfg.algorithm, num_groups=1,
                                workers=cfg.workers, schedule=Schedule.for_job(
                                    num_groups=1, workers=cfg.workers, l_comm=cfg.l_comm,
                                    g_comm=cfg.g_comm, local_rounds=rule.has_local_rounds(1),
                                    max_iterations=cfg.iterations),
                                max_seconds=None, node_timeout=30, round_timeout=5,
                                join_timeout=5, now=time.monotonic())
        srv.client = FakeClient(cfg, coord)
        srv.inbox = FakeInbox()
        srv.store = NodeStore.create(StoreLayout.new(cfg.job_id, 0, PARAMS, cfg.workers,
                                                     srv.rule.node_buffers))
        srv.param_count, srv.training = PARAMS, True
        fakes = [FakeWorker(i, srv.inbox) for i in range(cfg.workers)]
        srv.workers = [WorkerState(i, i, f.proc, f, time.monotonic()) for i, f in enumerate(fakes)]
        if coordinated:
            srv.last_round_seen = srv.client.join(workers=cfg.workers, param_count=PARAMS,
                                                  algorithm=cfg.algorithm, num_groups=1,
                                                  connect_timeout=1).round_id
            for f in fakes:  # every worker asks for its first credits
                srv.inbox.put(m.Ask(f.local, 0))
        return srv, fakes

    yield make
    for srv in made:
        srv.metrics.close()
        if srv.store is not None:
            srv.store.close(unlink=True)


# ---------------------------------------------------------------- item 10
def test_readers_of_a_buffer_are_the_workers_without_done_and_not_gone():
    ws = [WorkerState(i, 10 + i, None, None, 0.0) for i in range(4)]
    ws[0].reading = frozenset({CENTER})  # pulling toward the center
    ws[1].reading = frozenset({"global_leader"})  # reading another buffer
    ws[2].reading, ws[2].gone = frozenset({CENTER}), True  # died in its pull
    assert readers(ws, CENTER) == [10]
    ws[0].reading = frozenset()  # its Done arrived
    assert readers(ws, CENTER) == []


def test_center_is_kept_while_any_worker_may_still_pull_toward_it(node):
    """EASGD: worker 0 is still pulling toward the center when worker 1, reset after a NaN,
    has finished. One Done must not stand in for another: the node keeps its copy of the
    center, also in the next round (worker 0 is still at it), until worker 0 is done."""
    srv, (w0, w1) = node(False, algorithm="easgd")
    w0.late, w1.healthy = {1}, False
    centers = lambda: [r for kind, r in srv.client.downloads if kind == CENTER]

    def run(rid: int) -> None:  # the workers waiting (pending) get the round's call
        assert srv._run_round(CreditAnswer(0, rid, int(RoundKind.GLOBAL), 8 * rid, 8 * rid)) is False

    srv.pending.extend([0, 1])
    run(1)
    assert [p.reset for p in w1.pulls] == [True] and w0.pulls[0].pulls == ((CENTER, 0.1),)
    assert centers() == []  # worker 1's Done arrived, worker 0's did not: keep the center
    run(2)  # worker 0 is still pulling (it never got round 2's call); worker 1 took part
    assert len(w1.pulls) == 2 and len(w0.pulls) == 1
    assert centers() == []
    w0.finish()
    run(3)  # worker 0's Done of round 1 arrives, it joins round 3: nobody reads the old center
    assert len(w0.pulls) == 2 and centers() == [3]


def test_late_worker_that_died_no_longer_holds_the_center(node):
    srv, (w0, w1) = node(False, algorithm="easgd", respawn=0)
    w0.late = {1}
    srv.pending.extend([0, 1])
    srv._run_round(CreditAnswer(0, 1, int(RoundKind.GLOBAL), 8, 8))
    assert srv.client.downloads == []
    w0.proc.exitcode = -9  # killed in the middle of its pull (RESPAWN=0: not started again)
    srv._check_workers()
    srv._run_round(CreditAnswer(0, 2, int(RoundKind.GLOBAL), 16, 16))
    assert srv.client.downloads == [(CENTER, 2)]


@pytest.mark.parametrize("groups, kind, buffer", [(1, RoundKind.GLOBAL, GLOBAL_LEADER),
                                                  (2, RoundKind.LOCAL, LOCAL_LEADER)])
def test_leader_buffer_is_kept_while_a_late_worker_pulls_toward_it(node, groups, kind, buffer):
    """LSGD, the same rule for the leader buffers: worker 1 still pulls toward the leader of
    round 1 when round 2 elects worker 0 with new parameters; the buffer keeps round 1's leader
    (and round 2 pulls nobody toward it) until worker 1 is done."""
    srv, (w0, w1) = node(False, algorithm="lsgd", num_groups=groups)
    w1.late = {1}
    leader = srv.store.buffer(buffer)
    srv.store.slot(0)[:] = 1.0
    srv.pending.extend([0, 1])
    srv._run_round(CreditAnswer(0, 1, int(kind), 8, 8))
    assert w1.pulls[0].pulls == ((buffer, 0.1),) and (leader == 1.0).all()
    srv.store.slot(0)[:] = 7.0  # worker 0 moved on; it leads round 2 alone
    srv._run_round(CreditAnswer(0, 2, int(kind), 16, 16))
    assert (leader == 1.0).all()  # not rewritten under worker 1's pull
    w1.finish()
    srv._run_round(CreditAnswer(0, 3, int(kind), 24, 24))
    assert (leader == 7.0).all() and w1.pulls[-1].round_id == 3
    assert w1.pulls[-1].pulls == ((buffer, 0.1),)


@pytest.mark.parametrize("algorithm, asks, sends", [("lsgd", GLOBAL_LEADER, None),
                                                   ("easgd", None, (2, 2.0))])
def test_a_global_rounds_report_names_the_transfers_that_follow_it(node, algorithm, asks, sends):
    """A global round's report names the download that follows it under a leader rule
    (``then_pull``, issue 15), and carries the node's sum (summands, weight) under a center
    rule (``then_push``), so that small ones travel with the report and its answer."""
    srv, _ = node(False, algorithm=algorithm, num_groups=2)
    srv.pending.extend([0, 1])
    srv._run_round(CreditAnswer(0, 1, int(RoundKind.GLOBAL), 8, 8))
    assert srv.client.then_pulls == [(1, asks)] and srv.client.then_pushes == [(1, sends)]


# ---------------------------------------------------------------- item 11
def test_round_handed_again_after_a_lost_report_is_reported_but_never_pulled_twice(node):
    """Round 1's report is lost after the pulls went out; the node detaches, reattaches, and
    the coordinator hands it round 1 again (the round still waits for it). The second pass
    reports the round (so it closes and the job goes on to its final round) but pulls nothing."""
    srv, fakes = node(True, algorithm="easgd", g_comm=4, l_comm=4, iterations=24)
    srv.client.lose_report = {1}
    srv._loop()  # returns after the final round (24 iterations: rounds 1, 2, then final 3)
    assert srv.client.joins == 2  # the first join and one reattach
    for f in fakes:
        assert f.pulled_rounds() == {1: 1, 2: 1}, f.pulls
    reported = [(rid, participants) for rid, _, participants in srv.client.reports]
    assert reported == [(1, 0), (2, 2), (3, 2)]  # round 1 once, without an exchange
    # the reports that exchange carry the node's sum (then_push), and the node still pushes
    # it after the answer (the client makes no call when the report carried it)
    assert srv.client.then_pushes[1:] == [(2, (2, 2.0)), (3, (2, 0.0))]
    assert [u for u in srv.client.uploads if u[0] == "sum"] == [("sum", 2), ("sum", 3)]
    assert srv.client.coord.done == 24 and srv.summary["round_id"] == 3


# ---------------------------------------------------------------- item 9
def leader_changes(run_dir) -> tuple[int, int, set[str]]:
    leaders: dict[int, str] = {}
    for r in metric_rows(run_dir / "node0" / "metrics.csv"):
        if r["kind"] == "global":
            leaders.setdefault(int(r["round"]), r["global_leader"])
    seq = [leaders[k] for k in sorted(leaders)]
    return len(seq), sum(a != b for a, b in zip(seq, seq[1:])), set(seq) - {""}


@pytest.mark.timeout(120)
def test_leadership_moves_when_avg_size_exceeds_the_steps_between_rounds(cluster):
    """1 node, 2 workers, a round every 8 steps per worker: AVG_SIZE=32 (a window that never
    fills between rounds) elects leaders as freely as AVG_SIZE=4 (issue 9: 1 change in 99
    rounds before, against 44-76 with AVG_SIZE=4)."""
    changes = {}
    for avg in (4, 32):
        knobs = dict(ENTRY="toyjob:main", PORT=0, G_COMM=8, L_COMM=8, ITERATIONS=800,
                     RUN_DIR=str(cluster.run_dir / f"avg{avg}"))
        n = cluster(0, AVG_SIZE=avg, **knobs)
        assert n.wait(60) == 0, n.output
        rounds, changes[avg], leaders = leader_changes(cluster.run_dir / f"avg{avg}")
        assert rounds == 49 and leaders == {"0", "1"}
    assert changes[32] >= 10 and changes[32] >= changes[4] / 2, changes
