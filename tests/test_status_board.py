"""The status board (lsgd/global_server/status.py), pure: reports checked, rings bounded,
snapshot and history built from a hand-driven coordinator and an injected clock."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lsgd.global_server.coordinator import Coordinator, CoordinatorError, Schedule
from lsgd.global_server.records import RoundState
from lsgd.global_server.status import StatusBoard
from lsgd.leader import Candidate
from lsgd.proto import lsgd_pb2 as pb
from lsgd.rules.base import RoundKind


def report(*workers, evaluations=(), start=0, **fields):
    r = pb.NodeReport(evaluations_from=start, **fields)
    for w in workers:
        r.workers.append(pb.WorkerStat(**w))
    for e in evaluations:
        r.evaluations.append(pb.Evaluation(**e))
    return r


def worker(wid, rnd=0, loss=0.5, distance=0.1, to="global_leader", **kw):
    return dict(worker_id=wid, round_id=rnd, loss=loss, distance=distance, distance_to=to,
                training=True, **kw)


def evaluation(rnd=1, value=0.9, metric="accuracy", target="leader", wid=0):
    return dict(round_id=rnd, iteration=16 * rnd, target=target, metric=metric, value=value,
                worker_id=wid)


def state(board):
    """Everything a refused report must leave as it was."""
    return (dict(board.reports), list(board.points), list(board.evaluations), board._seq,
            dict(board._held), dict(board._worker_round))


def fake_coord(**kw):
    """The coordinator fields the board reads, settable by hand."""
    c = SimpleNamespace(job_id="j", algorithm="lsgd", num_groups=2, workers=2, done=0,
                        started=True, started_at=0.0, stopped=None, stop_reason=None,
                        finished=False, finishing=False, round=None, rounds_opened=0,
                        period_start=0, last_leader=None, deadline=None, nodes={},
                        live_nodes=[], schedule=Schedule(8, 16, 2000))
    c.__dict__.update(kw)
    return c


# ---------------------------------------------------------------------------- refusals
BAD = [
    ("a worker of another node", report(worker(2)), "workers[0].worker_id"),
    ("more workers than the node has", report(worker(0), worker(1), worker(1)), "workers"),
    ("a worker twice", report(worker(1), worker(1)), "workers[1].worker_id"),
    ("an unknown distance target", report(worker(0, to="moon")), "workers[0].distance_to"),
    ("a negative distance", report(worker(0, distance=-1.0)), "workers[0].distance"),
    ("a round not opened yet", report(worker(0, rnd=4)), "workers[0].round_id"),
    ("iterations past 2**53", report(worker(0, iterations=1 << 60)), "workers[0].iterations"),
    ("more training workers than workers", report(workers_training=3), "workers_training"),
    ("steps past 2**53", report(steps=1 << 62), "steps"),
    ("a local leader of another node",
     report(has_local_leader=True, local_leader=pb.Candidate(worker_id=3, loss=0.1)),
     "local_leader.worker_id"),
    ("65 evaluations", report(evaluations=[evaluation()] * 65), "evaluations"),
    ("a metric name of 65 characters", report(evaluations=[evaluation(metric="m" * 65)]),
     "evaluations[0].metric"),
    ("a metric name with a newline", report(evaluations=[evaluation(metric="a\nb")]),
     "evaluations[0].metric"),
    ("an empty metric name", report(evaluations=[evaluation(metric="")]), "evaluations[0].metric"),
    ("an unknown evaluation target", report(evaluations=[evaluation(target="best")]),
     "evaluations[0].target"),
    ("an evaluated worker outside the job", report(evaluations=[evaluation(wid=4)]),
     "evaluations[0].worker_id"),
    ("an evaluation of a round not opened yet", report(evaluations=[evaluation(rnd=9)]),
     "evaluations[0].round_id"),
    ("a good worker, then a bad one", report(worker(0, rnd=1), worker(5)), "workers[1].worker_id"),
    ("evaluations numbered past 2**53", report(evaluations=[evaluation()], start=1 << 53),
     "evaluations_from"),
]


@pytest.mark.parametrize("why, bad, field", BAD, ids=[b[0] for b in BAD])
def test_a_bad_report_is_refused_naming_the_field_and_changes_nothing(why, bad, field):
    board = StatusBoard(2, 2)
    board.ingest(0, report(worker(0, rnd=1), worker(1, rnd=1),
                           evaluations=[evaluation()]), now=1.0, session=5, rounds=3)
    before = state(board)
    with pytest.raises(CoordinatorError) as e:
        board.ingest(0, bad, now=2.0, session=5, rounds=3)
    assert e.value.code == "INVALID_ARGUMENT"
    assert field in str(e.value)
    assert state(board) == before


def test_evaluations_from_another_node_are_refused():
    board = StatusBoard(2, 2)
    with pytest.raises(CoordinatorError, match="node 0 only"):
        board.ingest(1, report(worker(2), evaluations=[evaluation(wid=2)]), now=0.0, rounds=3)
    assert not board.reports and not board.evaluations


def test_numbers_that_are_not_finite_are_kept_as_unknown():
    board = StatusBoard(2, 2)
    board.ingest(0, report(worker(0, loss=math.nan, distance=math.inf), worker(1, loss=-2.5),
                           rate=math.nan, has_local_leader=True,
                           local_leader=pb.Candidate(worker_id=1, loss=math.inf),
                           evaluations=[evaluation(value=math.nan)]), now=0.0, rounds=1)
    snap = board.snapshot(fake_coord(), now=1.0)
    w0, w1 = snap["workers"]
    assert (w0["loss"], w0["distance"], w1["loss"]) == (None, None, -2.5)
    assert snap["nodes"][0]["rate"] is None
    assert snap["nodes"][0]["local_leader"] == {"worker": 1, "loss": None}
    assert snap["evaluations"][0]["value"] is None
    json.dumps(snap, allow_nan=False)  # valid JSON: no NaN anywhere
    board.ingest(0, report(rate=-5.0), now=0.0, rounds=1)
    assert board.reports[0].rate is None


# ---------------------------------------------------------------------------- evaluations, points
def test_evaluations_past_what_the_server_holds_are_not_taken_and_asked_for_again():
    board = StatusBoard(2, 2)
    assert board.ingest(0, report(evaluations=[evaluation()]), now=0.0, session=7, rounds=5) == 1
    # numbered from 40: 1..39 would be missing; the answer asks again from 1
    gap = report(evaluations=[evaluation(rnd=2)], start=40)
    assert board.ingest(0, gap, now=1.0, session=7, rounds=5) == 1
    assert len(board.evaluations) == 1
    # a hostile start cannot push what the server holds out of range either
    assert board.ingest(0, report(evaluations=[evaluation(rnd=2)], start=(1 << 53) - 1),
                        now=2.0, session=7, rounds=5) == 1


def test_evaluations_are_stored_once_per_session_index():
    board = StatusBoard(2, 2)
    first = [evaluation(rnd=1, value=0.1), evaluation(rnd=1, value=0.2), evaluation(rnd=2, value=0.3)]
    assert board.ingest(0, report(evaluations=first), now=0.0, session=7, rounds=5) == 3
    # the node did not hear the answer and sends 1..3 again (3 is new)
    again = first[1:] + [evaluation(rnd=3, value=0.4)]
    assert board.ingest(0, report(evaluations=again, start=1), now=1.0, session=7, rounds=5) == 4
    assert [e[6] for e in board.evaluations] == [0.1, 0.2, 0.3, 0.4]
    assert board.ingest(0, report(), now=2.0, session=7, rounds=5) == 4
    assert board.evaluations_held(0, 7) == 4
    # a new session (the node started again) numbers from 0
    assert board.evaluations_held(0, 9) == 0
    assert board.ingest(0, report(evaluations=[evaluation(rnd=4, value=0.5)]), now=3.0,
                        session=9, rounds=5) == 1
    assert len(board.evaluations) == 5 and board.evaluations_held(0, 7) == 0


def test_one_point_per_worker_and_new_round():
    board = StatusBoard(2, 2)
    coord = fake_coord(round=RoundState(1, RoundKind.LOCAL, 8, 0.5, {0, 1}, closed=True),
                       rounds_opened=1, done=8)
    board.observe(coord, 0.5)
    board.ingest(0, report(worker(0, rnd=1), worker(1, rnd=0)), now=1.0, rounds=1)
    board.ingest(0, report(worker(0, rnd=1), worker(1, rnd=0)), now=1.5, rounds=1)
    assert [(p[3], p[5], p[2]) for p in board.points] == [(0, 1, 8)]  # (worker, round, iteration)
    board.ingest(0, report(worker(0, rnd=1, loss=0.25), worker(1, rnd=1)), now=2.0, rounds=1)
    assert [(p[3], p[5]) for p in board.points] == [(0, 1), (1, 1)]


# ---------------------------------------------------------------------------- rings
def test_rings_are_bounded_and_numbered_on():
    board = StatusBoard(1, 2, rounds=5, points=7, evaluations=3)
    coord = fake_coord(num_groups=1, schedule=Schedule(None, 16, None))
    for rid in range(1, 31):
        coord.round = RoundState(rid, RoundKind.GLOBAL, 16 * rid, float(rid), {0}, closed=True)
        coord.rounds_opened, coord.done = rid, 16 * rid
        board.observe(coord, rid + 0.25)
        board.ingest(0, report(worker(0, rnd=rid), worker(1, rnd=rid),
                               evaluations=[evaluation(rnd=rid)], start=rid - 1),
                     now=rid + 0.5, rounds=rid)
    assert (len(board.rounds), len(board.points), len(board.evaluations)) == (5, 7, 3)
    assert len(board._iteration) == 5  # the round -> counter map shrinks with its ring
    assert [r[1] for r in board.rounds] == [26, 27, 28, 29, 30]
    assert board.kinds["global"] == 30 and board._seq == 30 * 4
    seqs = [e[0] for ring in (board.rounds, board.points, board.evaluations) for e in ring]
    assert len(set(seqs)) == len(seqs)
    assert sum(board.latency) == 30 and board.latency_sum == pytest.approx(30 * 0.25)


def test_history_pages_lose_and_repeat_nothing():
    board = StatusBoard(1, 2)
    coord = fake_coord(num_groups=1, schedule=Schedule(None, 16, None))
    for rid in range(1, 12):
        coord.round = RoundState(rid, RoundKind.GLOBAL, 16 * rid, float(rid), {0}, closed=True)
        coord.rounds_opened = rid
        board.observe(coord, rid + 0.1)
        board.ingest(0, report(worker(0, rnd=rid), worker(1, rnd=rid),
                               evaluations=[evaluation(rnd=rid)] if rid % 3 == 0 else [],
                               start=max(0, rid // 3 - 1)), now=rid + 0.2, rounds=rid)
    full = board.history(0, page=10_000)
    assert [len(full[k]) for k in ("rounds", "points", "evaluations")] == [11, 22, 3]
    assert full["next"] == board._seq + 1 == 11 + 22 + 3 + 1
    got, since, calls = {"rounds": [], "points": [], "evaluations": []}, 1, 0
    while calls < 50:
        page = board.history(since, page=4)
        calls += 1
        assert all(len(page[k]) <= 4 for k in got)
        for k in got:
            got[k] += page[k]
        if page["next"] == since:
            break
        since = page["next"]
    assert got == {k: full[k] for k in got}
    assert full["rounds"][0] == {"seq": 1, "id": 1, "kind": "global", "iteration": 16, "t": 1.0,
                                 "leader": None, "leader_node": None, "loss": None,
                                 "latency_s": pytest.approx(0.1)}
    assert set(full["points"][0]) == {"seq", "t", "iteration", "worker", "node", "round", "loss",
                                      "distance", "distance_to"}
    assert board.history(board._seq + 1) == {"rounds": [], "points": [], "evaluations": [],
                                             "next": board._seq + 1}


# ---------------------------------------------------------------------------- rate, ETA
def test_rate_and_eta_from_an_injected_clock():
    board = StatusBoard(2, 2)
    coord = fake_coord()
    assert board.rate(0, 0.0) is None  # nothing seen yet
    for k in range(0, 41):  # 20 s at 100 iterations/s, a change every 0.5 s
        coord.done = 50 * k
        board.observe(coord, 0.5 * k)
    assert board.rate(coord.done, 20.0) == pytest.approx(100.0)
    snap = board.snapshot(coord, now=20.0)
    assert snap["job"]["rate"] == pytest.approx(100.0)
    assert snap["job"]["eta_s"] == pytest.approx((2000 - 2000) / 100.0)
    coord.done = 1200
    board.observe(coord, 20.5)
    assert board.eta(coord, "running", 100.0, 20.5) == pytest.approx(8.0)
    coord.deadline = 23.5  # MINUTES ends sooner than the budget
    assert board.eta(coord, "running", 100.0, 20.5) == pytest.approx(3.0)
    assert board.eta(coord, "finished", 100.0, 20.5) == 0.0
    assert board.eta(coord, "stopped", 100.0, 20.5) is None
    assert board.rate(1200, 60.0) is None  # nothing seen in the last 10 s: unknown


# ---------------------------------------------------------------------------- a real coordinator
def make_coord(iters=40):
    sched = Schedule.for_job(num_groups=2, workers=2, l_comm=2, g_comm=4, local_rounds=True,
                             max_iterations=iters)
    return Coordinator(job_id="j", algorithm="lsgd", num_groups=2, workers=2, schedule=sched,
                       max_seconds=None, node_timeout=50.0, round_timeout=10.0,
                       join_timeout=30.0, now=0.0)


def test_snapshot_follows_a_job_through_its_rounds():
    c, board = make_coord(), StatusBoard(2, 2)
    now = [0.0]

    def do(fn):
        out = fn()
        board.observe(c, now[0])
        return out

    s = {i: do(lambda i=i: c.join(job_id="j", index=i, workers=2, algorithm="lsgd",
                                  num_groups=2, now=0.0)).session for i in (0,)}
    assert board.snapshot(c, 0.0)["job"]["state"] == "waiting"
    s[1] = do(lambda: c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2,
                             now=0.0)).session
    held = {0: 0, 1: 0}
    seen = {0: 0, 1: 0}

    def run_until_round():
        for _ in range(100):
            for i in (0, 1):
                now[0] += 0.01
                g = do(lambda i=i: c.acquire(i, s[i], consumed=held[i], late=0, released=0,
                                             want=100, last_round_seen=seen[i], now=now[0]))
                held[i] = g.grant
                if g.round is not None:
                    return g.round
        raise AssertionError("no round opened")

    rnd = run_until_round()
    assert rnd.kind == RoundKind.LOCAL and board.snapshot(c, now[0])["job"]["state"] == "running"
    assert board.history(0)["rounds"][0]["kind"] == "local"
    assert board.history(0)["rounds"][0]["latency_s"] is None  # no barrier
    seen = {0: rnd.id, 1: rnd.id}
    rnd = run_until_round()
    assert rnd.kind == RoundKind.GLOBAL and len(board.rounds) == 1  # open: not recorded yet
    opened = rnd.opened_at
    now[0] += 1.0
    do(lambda: c.report(0, s[0], rnd.id, Candidate(1, 0.3), 2, now[0]))
    now[0] += 0.5
    do(lambda: c.report(1, s[1], rnd.id, Candidate(2, 0.2), 2, now[0]))
    g = board.history(0)["rounds"][-1]
    assert (g["kind"], g["leader"], g["leader_node"], g["loss"]) == ("global", 2, 1, 0.2)
    assert g["latency_s"] == pytest.approx(now[0] - opened)
    board.ingest(1, report(worker(2, rnd=rnd.id, loss=0.2, distance=0.0), worker(3, rnd=rnd.id),
                           steps=8, workers_training=2, rate=4.0, has_local_leader=True,
                           local_leader=pb.Candidate(worker_id=2, loss=0.2)),
                 now=now[0], session=s[1], rounds=c.rounds_opened)
    snap = board.snapshot(c, now[0] + 0.25, wall=123.0)
    json.dumps(snap, allow_nan=False)
    job = snap["job"]
    assert (job["id"], job["algorithm"], job["num_groups"], job["workers_per_node"]) == ("j", "lsgd", 2, 2)
    assert job["exchange"] == "leader" and StatusBoard(2, 2, exchange="center").snapshot(
        c, now=5.0)["job"]["exchange"] == "center"
    assert job["counter"] == c.done == 16 and job["budget"] == {"iterations": 40, "minutes": None}
    assert job["rounds"] == {"local": 1, "global": 1, "final": 0, "total": 2}
    assert snap["time"] == 123.0 and job["restarts"] == 0 and job["stop_reason"] is None
    assert snap["leader"] == {"worker": 2, "node": 1, "loss": 0.2, "round": 2, "iteration": 16}
    n1 = snap["nodes"][1]
    assert (n1["alive"], n1["steps"], n1["rate"], n1["workers_training"]) == (True, 8, 4.0, 2)
    assert n1["last_heard_s"] == pytest.approx(0.25)
    assert n1["local_leader"] == {"worker": 2, "loss": 0.2}
    assert [w["id"] for w in snap["workers"]] == [2, 3]
    assert snap["workers"][0] == {"id": 2, "node": 1, "iterations": 0, "loss": 0.2,
                                  "distance": 0.0, "distance_to": "global_leader", "round": 2,
                                  "resets": 0, "respawns": 0, "training": True}
    assert snap["history"]["next"] == board._seq + 1
    # node 0 stops the job: stopped, with its reason, and no ETA
    do(lambda: c.stop_job(0, s[0], "interrupted", 0, 0, now[0]))
    job = board.snapshot(c, now[0])["job"]
    assert job["state"] == "stopped" and "interrupted" in job["stop_reason"]
    assert job["eta_s"] is None


def test_a_restored_coordinators_rounds_are_counted_by_kind():
    c = make_coord(iters=400)
    c.rounds_opened, c.period_start, c.done = 7, 56, 56  # 56 = 3 global (16) + 4 local (8)
    board = StatusBoard(2, 2)
    board.observe(c, 0.0)
    assert board.kinds == {"local": 4, "global": 3, "final": 0}


# ---------------------------------------------------------------------------- fuzzed
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
SMALL = st.integers(0, 10**6)
U64 = st.one_of(SMALL, SMALL, SMALL, SMALL, st.integers(0, 2**64 - 1))  # mostly fine
TO = st.sampled_from(["", "local_leader", "global_leader", "center", "moon"])
METRIC = st.one_of(st.sampled_from(["accuracy", "loss"]), st.text(max_size=80))
WORKERS = st.lists(st.builds(pb.WorkerStat, worker_id=st.integers(0, 2), iterations=U64,
                             loss=FLOATS, distance=FLOATS, distance_to=TO,
                             resets=st.integers(0, 2**32 - 1), training=st.booleans(),
                             round_id=st.one_of(st.integers(0, 5), st.integers(0, 5), U64)),
                   max_size=3, unique_by=lambda w: w.worker_id)
EVALS = st.lists(st.builds(pb.Evaluation, round_id=st.integers(0, 6), iteration=st.integers(0, 99),
                           target=st.sampled_from(["leader", "average", "center", "best"]),
                           metric=METRIC, value=FLOATS, worker_id=st.integers(0, 6)),
                 max_size=2)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, 2), steps=U64, rate=FLOATS, training=st.integers(0, 3),
       workers=WORKERS, evals=EVALS, start=U64, leader=st.integers(0, 2))
def test_any_report_is_stored_whole_or_refused_whole(index, steps, rate, training, workers,
                                                      evals, start, leader):
    board = StatusBoard(3, 2)
    board.ingest(0, report(worker(0, rnd=1)), now=0.0, session=1, rounds=5)
    r = pb.NodeReport(steps=steps, rate=rate, workers_training=training, evaluations_from=start,
                      has_local_leader=True, local_leader=pb.Candidate(worker_id=2 * index + leader))
    for w in workers:  # ids 0, 1 on the node are its own; 2 is the next node's
        w.worker_id += 2 * index
    r.workers.extend(workers)
    r.evaluations.extend(evals if index == 0 or len(evals) == 2 else [])
    before = state(board)
    try:
        board.ingest(index, r, now=1.0, session=1, rounds=5)
    except CoordinatorError as exc:
        assert exc.code == "INVALID_ARGUMENT" and str(exc).startswith("heartbeat report: ")
        assert state(board) == before
        event("refused")
        return
    event("stored")
    assert board.reports[index].steps == steps
    json.dumps(board.snapshot(fake_coord(num_groups=3), now=2.0), allow_nan=False)
    json.dumps(board.history(0), allow_nan=False)
