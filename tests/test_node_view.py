"""A node's view of its job, pure: metrics rows, answers and a clock in; snapshots, heartbeat
reports, progress lines and the end-of-job lines out (issue 10, items 1 and 7)."""

from __future__ import annotations

import logging
import math
import os
import time

import pytest

from lsgd.config import JobConfig
from lsgd.leader import Candidate
from lsgd.local_server import view as view_mod
from lsgd.local_server.heartbeat import MAX_EVALUATIONS, node_report
from lsgd.local_server.progress import Progress, choose_mode, duration, progress_line
from lsgd.local_server.summary import budget_reason, final_lines, status_page, where_to_look
from lsgd.local_server.view import NodeView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(node=1, groups=2, workers=2, **knobs) -> tuple[NodeView, Clock]:
    clock = Clock()
    cfg = JobConfig(node_index=node, num_groups=groups, workers=workers, port=50051, **knobs)
    return NodeView(cfg, clock=clock), clock


def row(rid, wid, loss, kind="global", **cols) -> dict:
    return {"round": rid, "kind": kind, "iteration": 64 * rid, "time_s": 1.0, "worker_id": wid,
            "worker_iterations": 32 * rid, "loss": loss, **cols}


def test_rows_give_each_workers_loss_distance_and_target():
    v, _ = make()  # node 1: workers 2 and 3
    v.on_rows([row(4, 2, 0.5, local_leader=3, global_leader=0, pull_local=0.25, pull_global=0.75),
               row(4, 3, 0.4, local_leader=3, global_leader=0, pull_global=0.5, reset="center")])
    w2, w3 = v.snapshot().workers
    # the global leader is preferred over the local leader as the distance's target
    assert (w2.loss, w2.distance, w2.distance_to, w2.round_id) == (0.5, 0.75, "global_leader", 4)
    assert (w3.distance, w3.distance_to, w3.resets, w3.iterations) == (0.5, "global_leader", 1, 128)
    v.on_rows([row(5, 2, 0.3, kind="local", local_leader=2, pull_center=1.5, pull_local=2.0),
               row(5, 3, 0.6, kind="local", local_leader=2)])
    s = v.snapshot()
    w2, w3 = s.workers
    assert (w2.distance, w2.distance_to) == (1.5, "center")  # center before local leader
    assert (w3.distance, w3.distance_to, w3.loss) == (0.5, "global_leader", 0.6)  # no pull: kept
    assert (s.local_leader.worker_id, s.local_leader.loss, s.local_leader.node) == (2, 0.3, 1)
    v.on_rows([row(6, 2, 0.2, local_leader=2, global_leader=2)])  # the leader itself: distance 0
    assert v.snapshot().workers[0].distance == 0.0
    v.on_rows([row(7, 9, 0.1)])  # a worker of another node is never taken in
    assert [w.worker_id for w in v.snapshot().workers] == [2, 3]


def test_workers_state_rounds_and_the_counter():
    v, _ = make()
    v.set_workers([(2, 500, True, 0), (3, 300, False, 2)])
    v.on_counter(4000)
    v.on_counter(3900)  # a stale answer never moves the counter back
    v.on_round(1, "local", Candidate(3, 0.4), 1)  # a local round's answer: not the global leader
    v.on_round(2, "global", Candidate(0, 0.2), 0)
    s = v.snapshot()
    assert (s.steps, s.counter, s.workers_training) == (800, 4000, 1)
    assert s.workers[1].respawns == 2 and not s.workers[1].training
    assert s.rounds == {"local": 1, "global": 1, "final": 0} and s.round_id == 2
    assert (s.leader.worker_id, s.leader.node, s.leader.loss) == (0, 0, 0.2)


def test_leader_changes_are_counted_and_a_stale_heartbeat_leader_is_ignored():
    v, _ = make()
    beat = dict(counter=0, nodes_alive=2, nodes_missing=[], job_started=True, leader_node=0)
    for rid, wid in ((2, 0), (4, 0), (6, 1), (8, 3)):
        v.on_round(rid, "global", Candidate(wid, 0.1), wid // 2)
    assert v.snapshot().leader_changes == 2  # w0 -> w1 -> w3
    # built before round 8 closed: its leader (w0) is older than what this node knows
    v.on_heartbeat(leader=Candidate(0, 0.3), rounds=8, **beat)
    assert v.snapshot().leader.worker_id == 3 and v.snapshot().leader_changes == 2
    # rounds opened since: its leader is newer (this node missed a round)
    v.on_heartbeat(leader=Candidate(2, 0.05), rounds=10, **dict(beat, leader_node=1))
    s = v.snapshot()
    assert (s.leader.worker_id, s.leader.node, s.leader_changes, s.round_id) == (2, 1, 3, 10)
    v.on_round(9, "global", Candidate(0, 0.4), 0)  # an answer older than that: ignored
    assert v.snapshot().leader.worker_id == 2
    assert v.final()["leader_changes"] == 3 and v.final()["last_leader"]["worker_id"] == 2


def test_rates_and_eta_follow_the_last_ten_seconds():
    v, clock = make(iterations=10_000)
    assert v.snapshot().rate is None and v.snapshot().eta is None  # nothing measured yet
    for second in range(1, 31):
        clock.now += 1.0
        v.on_counter(100 * second if second <= 20 else 2000 + 300 * (second - 20))
        v.set_workers([(2, 40 * second, True, 0), (3, 10 * second, True, 0)])
        s = v.snapshot()
    assert s.rate == pytest.approx(300, rel=0.05)  # the last 10 s, not the mean since the start
    assert s.node_rate == pytest.approx(50, rel=0.05)
    assert s.eta == pytest.approx((10_000 - 5000) / s.rate)
    v2, clock2 = make(iterations=None, minutes=1.0)
    clock2.now += 45
    assert v2.snapshot().eta == pytest.approx(15)


def test_a_counter_or_steps_taken_over_from_before_are_not_speed():
    # RESUME=1, or a node joining a running job: the first counter heard is 30000
    v, clock = make(iterations=60_000)
    for second in range(1, 4):
        clock.now += 1.0
        v.snapshot()  # the progress thread reads before the first answer came
    v.set_workers([(2, 15_000, True, 0), (3, 15_000, True, 0)])  # restored step counts
    v.joined()
    for second in range(1, 6):
        v.on_counter(30_000 + 2500 * second)
        v.set_workers([(2, 15_000 + 600 * second, True, 0), (3, 15_000 + 600 * second, True, 0)])
        s = v.snapshot()
        clock.now += 1.0
    assert s.rate == pytest.approx(2500, rel=0.3)
    assert s.node_rate == pytest.approx(1200, rel=0.3)


def test_join_wait_and_other_waits_say_what_and_how_long():
    v, clock = make(node=0, groups=3, join_timeout=60)
    v.wait("starting 2 workers: 0 ready", key="start")
    clock.now += 3
    v.wait("starting 2 workers: 1 ready", key="start")  # the same wait goes on
    assert v.snapshot().wait_text() == "starting 2 workers: 1 ready (3 s)"
    v.joined()
    v.on_heartbeat(counter=0, nodes_alive=1, nodes_missing=[1, 2], job_started=False, leader=None,
                   leader_node=0, rounds=0)
    clock.now += 9
    assert progress_line(v.snapshot()) == \
        "waiting for nodes 1, 2 of 3 to join: 12 s of JOIN_TIMEOUT 60 s"  # node 0: since its start
    v.on_heartbeat(counter=0, nodes_alive=3, nodes_missing=[], job_started=True, leader=None,
                   leader_node=0, rounds=0)
    assert v.snapshot().wait is None
    v.wait("detached from the global server, reattaching", "RECONNECT_TIMEOUT", 120)
    clock.now += 5
    assert v.snapshot().wait_text() == ("detached from the global server, reattaching: 5 s of "
                                        "RECONNECT_TIMEOUT 120 s")
    v.reattached()
    assert v.snapshot().wait is None and v.snapshot().reattaches == 1


def test_progress_lines_for_each_budget():
    v, clock = make(node=0, iterations=6000)
    v.on_heartbeat(counter=0, nodes_alive=2, nodes_missing=[], job_started=True,
                   leader=None, leader_node=0, rounds=0)
    v.set_workers([(0, 0, True, 0), (1, 0, True, 0)])
    v.snapshot()
    clock.now += 3
    v.on_counter(2400)
    v.on_round(37, "global", Candidate(1, 0.123), 0)
    assert progress_line(v.snapshot()) == (
        "progress: 2400/6000 it (40%), 800 it/s, ETA 4 s, leader w1 (node 0) loss 0.123, "
        "nodes 2/2, workers 2/2 training, round 37")
    v2, clock2 = make(node=0, iterations=None, minutes=5.0)
    clock2.now += 62
    line = progress_line(v2.snapshot())
    assert line.startswith("progress: 0 it, time 1:02/5:00, ? it/s, ETA 3:58, no leader yet, "
                           "nodes ?/2"), line
    assert [duration(s) for s in (4.4, 62, 3723)] == ["4 s", "1:02", "1:02:03"]


def test_heartbeat_report_is_bounded_and_sends_from_the_servers_index(monkeypatch):
    monkeypatch.setattr(view_mod, "MAX_EVALUATIONS", 100)  # the ring, small for the test
    v, _ = make(node=0, workers=3)
    v.on_rows([row(3, 1, 0.25, local_leader=1, pull_global=0.5)])
    v.on_rows([{"round": r, "kind": "eval", "iteration": 64 * r, "worker_id": 1,
                "target": "leader", "metric": "m" * 100, "value": r / 1000} for r in range(150)])
    start, evals = v.evaluations_since(0, MAX_EVALUATIONS)
    assert start == 50 and len(evals) == 64 and evals[0].round_id == 50  # 50 were dropped
    report = node_report(v.snapshot(), start, evals)
    assert [w.worker_id for w in report.workers] == [0, 1, 2]  # this node's workers only
    w1 = report.workers[1]
    assert (w1.loss, w1.distance, w1.distance_to, w1.round_id) == (0.25, 0.5, "global_leader", 3)
    assert math.isnan(report.workers[0].loss) and report.workers[0].distance_to == ""
    assert report.has_local_leader and report.local_leader.worker_id == 1
    assert report.evaluations_from == 50 and len(report.evaluations) == 64
    assert all(len(e.metric) == 64 for e in report.evaluations)
    assert report.ByteSize() < 8192
    assert v.evaluations_since(140, 64)[0] == 140 and len(v.evaluations_since(140, 64)[1]) == 10
    assert v.evaluations_since(150, 64) == (150, [])  # the server holds all of them
    assert v.evaluations_since(400, 64) == (400, [])  # a server that claims more: nothing


def test_progress_is_off_at_warning_level_or_every_0(tmp_path):
    cfg = JobConfig(progress_every=10)
    quiet = logging.getLogger("b10.quiet")
    quiet.setLevel(logging.WARNING)
    loud = logging.getLogger("b10.loud")
    loud.setLevel(logging.INFO)
    with open(tmp_path / "log", "w") as f:
        assert choose_mode(cfg, f, quiet) == "off"
        assert choose_mode(cfg, f, loud) == "lines"
        assert choose_mode(JobConfig(progress_every=0), f, loud) == "off"
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert choose_mode(cfg, tty, loud) == "live"
            assert choose_mode(cfg, tty, quiet) == "off"
    finally:
        os.close(master)
        os.close(slave)


def test_log_records_go_around_the_live_line(monkeypatch):
    """In-process: a record printed while the line is shown lands on a line of its own, and the
    line is drawn again below it; closing leaves no half line behind."""
    import select

    from lsgd.local_server import progress

    monkeypatch.setattr(progress, "LIVE_EVERY", 0.02)
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    handler = logging.StreamHandler(tty)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    out = b""

    def read(seconds: float) -> None:
        nonlocal out
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([master], [], [], 0.05)[0]:
                out += os.read(master, 65536)

    try:
        v, _ = make(node=0, iterations=6000)
        v.on_counter(1200)
        shown = Progress(v, v.cfg, stream=tty)
        assert shown.mode == "live"
        shown.start()
        read(0.3)
        assert handler.stream is not tty  # goes around the line now
        logging.getLogger("b10.record").warning("a record while the line is shown")
        read(0.3)
        shown.close()
        assert handler.stream is tty  # restored
        tty.write("after\n")
        tty.flush()
        read(0.2)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        tty.close()
        os.close(master)
    text = out.decode()
    assert "node 0  20%|" in text and "1200/6000 it" in text, text
    before, after = text.split("a record while the line is shown", 1)
    assert before.endswith("\r"), before[-200:]  # the line was cleared first
    assert after.startswith("\r\n") and "node 0  20%|" in after  # drawn again below it
    tail = after.split("after")[0]
    assert tail.rstrip(" ").endswith("\r")  # erased: "after" starts at the start of a line


def test_final_lines_say_why_what_and_where(tmp_path):
    cfg = JobConfig(run_dir=str(tmp_path / "run"), tensorboard=False, iterations=6000)
    (tmp_path / "run" / "global").mkdir(parents=True)
    (tmp_path / "run" / "global" / "status.port").write_text("50052\n")
    files = where_to_look(cfg, since=time.time())
    assert files["status_page"] == "http://127.0.0.1:50052/"
    assert where_to_look(cfg, since=time.time() + 60).get("status_page") is None  # stale file
    assert where_to_look(cfg.replace(node_index=1, num_groups=2)).get("status_page") is None
    assert status_page(cfg.replace(status_port=0)) is None  # the page is off
    summary = {"node": 0, "seconds": 12.34, "counter": 6000, "workers": {"0": 3000, "1": 3000},
               "job_stop_reason": budget_reason(cfg, 6000),
               "rounds": {"local": 30, "global": 9, "final": 1}, "leader_changes": 4,
               "last_leader": {"worker_id": 1, "node": 0, "loss": 0.123},
               "final_leader": {"worker_id": 1, "loss": 0.12},
               "evaluation": {"leader": {"accuracy": 0.97}, "average": {"accuracy": 0.96}},
               "files": files}
    lines = final_lines(summary, 0)
    assert lines[0] == ("lsgd: node 0 finished in 12.3 s (iteration budget reached); global "
                        "counter 6000; this node's workers did 6000 iterations")
    assert lines[1] == ("lsgd: rounds on this node: 30 local, 9 global, 1 final; the global "
                        "leader changed 4 times (last: worker 1 on node 0, loss 0.123)")
    assert lines[2] == "lsgd: test accuracy: final leader (worker 1) 0.9700, worker average 0.9600"
    assert lines[3:] == [f"lsgd: plots: python -m lsgd plot {tmp_path / 'run'}",
                         f"lsgd: metrics: {tmp_path / 'run' / 'node0' / 'metrics.csv'}",
                         "lsgd: status page (while the job ran): http://127.0.0.1:50052/"]
    tb = where_to_look(cfg.replace(tensorboard=True))["tensorboard"]
    assert tb == f"tensorboard --logdir {tmp_path / 'run' / 'tensorboard'}"
    stopped = final_lines({"node": 1, "stop_reason": "job stopped on node 0: interrupted",
                           "files": files}, 4)
    assert stopped[0] == "lsgd: node 1: job stopped on node 0: interrupted"
    assert budget_reason(cfg.replace(minutes=1.0), 5000) == "time budget reached"


def test_an_asynchronous_rule_shows_exchanges_and_its_best_worker_not_rounds():
    v, clock = make(iterations=6000)  # node 1: workers 2 and 3
    v.on_counter(1200)
    assert "no leader yet" in progress_line(v.snapshot())  # nothing seen: a synchronous look
    v.on_rows([row(0, 2, 0.5, kind="exchange", pull_center=0.25),
               row(0, 3, 0.4, kind="exchange", pull_center=0.5),
               row(0, 2, 0.3, kind="exchange", pull_center=0.125)])
    s = v.snapshot()
    assert s.rounds["exchange"] == 3 and s.round_id == 0
    assert (s.workers[0].loss, s.workers[0].distance, s.workers[0].distance_to) == (0.3, 0.125,
                                                                                      "center")
    line = progress_line(s)
    assert "best w2 loss 0.3" in line and line.endswith("exchanges 3"), line
    assert "round" not in line and "leader" not in line
    v.on_rows([row(0, 2, math.nan, kind="exchange"), row(0, 3, math.nan, kind="exchange")])
    assert "no loss yet" in progress_line(v.snapshot())  # a NaN loss is nobody's best

    summary = {"node": 1, "seconds": 5.0, "counter": 6000, "workers": {"2": 3000, "3": 3000},
               "rounds": {"local": 0, "global": 0, "final": 1, "exchange": 250},
               "async": {"exchanges": 250, "syncs": 40, "sync_failures": 2, "deltas_sent": 39}}
    lines = final_lines(summary, 0)
    assert lines[1] == ("lsgd: exchanges on this node: 250 without a barrier (39 center deltas "
                        "sent, 2 syncs with the global server failed and went again), then 1 "
                        "final round")
    summary["async"] = {"exchanges": 250, "syncs": 40, "sync_failures": 0, "mail_sent": 7,
                        "mail_received": 5}
    assert final_lines(summary, 0)[1] == ("lsgd: exchanges on this node: 250 without a barrier "
                                          "(mail 7 sent, 5 received), then 1 final round")


def test_status_page_address_follows_the_security_settings(tmp_path, monkeypatch):
    (tmp_path / "global").mkdir()
    (tmp_path / "global" / "status.port").write_text("50052")
    monkeypatch.setenv("LSGD_SECRET", "s" * 32)
    cfg = JobConfig(run_dir=str(tmp_path), ip_addr="10.0.0.1")
    assert status_page(cfg) == "http://10.0.0.1:50052/"  # with a secret: where gRPC listens
    monkeypatch.delenv("LSGD_SECRET")
    cfg = JobConfig(run_dir=str(tmp_path), ip_addr="10.0.0.1", allow_insecure=True)
    assert status_page(cfg) == "http://127.0.0.1:50052/"  # without one: loopback only
    (tmp_path / "global" / "status.port").write_text("not a port")
    assert status_page(cfg) is None
