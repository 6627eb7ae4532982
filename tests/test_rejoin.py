"""A node restarted right after a crash (systemd, Kubernetes, by hand) rejoins its job (issue 9,
item 8): the coordinator's rule with an injected clock, then the real thing with train.sh."""

from __future__ import annotations

import json

import pytest

from conftest import assert_clean_exit, global_summary, metric_rows, wait_for_rows
from lsgd.global_server.coordinator import CoordinatorError
from lsgd.leader import Candidate
from lsgd.rules.base import RoundKind
from test_coordinator import acq, drain, join_all, make


def join(c, i, now=0.0, **kw):
    return c.join(job_id="j", index=i, workers=c.workers, algorithm="lsgd", num_groups=c.num_groups,
                  now=now, **kw)


def test_a_restarted_node_replaces_its_live_earlier_run():
    c = make(l_comm=4, g_comm=4, node_timeout=5)
    s = join_all(c, 2)
    g1 = acq(c, s, 1).grant
    acq(c, s, 0)
    assert g1 > 0 and c.nodes[1].outstanding == g1
    done = c.done
    new = join(c, 1, now=1.0, replaces_session=s[1])  # well within node_timeout
    assert new.session not in (0, s[1]) and c.nodes[1] is new and new.alive
    assert c.outstanding == c.nodes[0].outstanding  # the crashed run's credits are free again
    assert c.done == done  # nothing counted for the crashed run
    with pytest.raises(CoordinatorError, match="not a member"):  # the old session is void
        c.heartbeat(1, s[1], now=1.5)
    s[1] = new.session
    assert acq(c, s, 1, now=1.5).grant > 0  # the new run gets credits


def test_an_index_held_by_a_silent_earlier_run_is_unavailable_until_it_is_dropped():
    # a replaced pod (a fresh RUN_DIR: no session to name) joins before NODE_TIMEOUT dropped
    # its predecessor: not a configuration error; its join is retried until the index frees
    c = make(l_comm=4, g_comm=4, node_timeout=5)
    s = join_all(c, 2)
    with pytest.raises(CoordinatorError, match="already in the job") as e:  # heard just now
        join(c, 1, now=0.5)
    assert e.value.code == "FAILED_PRECONDITION"
    c.heartbeat(0, s[0], now=3.0)
    with pytest.raises(CoordinatorError, match="still held by an earlier run, silent for 3.0 s") as e:
        join(c, 1, now=3.0)
    assert e.value.code == "UNAVAILABLE"
    c.heartbeat(0, s[0], now=5.5)
    assert c.tick(now=5.5) == [1]  # dropped...
    new = join(c, 1, now=5.6)  # ...and the new run joins
    assert new.session != s[1] and c.nodes[1] is new


def test_a_node_that_joins_a_finishing_job_ends_without_failing():
    from types import SimpleNamespace

    from lsgd import exitcodes
    from lsgd.local_server.ending import EndingMixin
    from lsgd.local_server.state import JoinedTooLate

    code, reason = EndingMixin._ended(SimpleNamespace(), JoinedTooLate("the job was finishing"))
    assert code == exitcodes.OK and reason == "the job was finishing"


def test_a_duplicate_index_is_still_refused_without_a_change():
    c = make()
    s = join_all(c, 2)
    before = c.snapshot()
    for replaces in (0, s[1] + 2, s[0]):  # none, a session that matches nothing, another node's
        with pytest.raises(CoordinatorError, match="already in the job") as e:
            join(c, 1, replaces_session=replaces)
        assert e.value.code == "FAILED_PRECONDITION"
        assert c.snapshot() == before and c.nodes[1].session == s[1]


def test_replacing_a_node_that_was_dropped_or_left_is_a_plain_join():
    c = make(node_timeout=5)
    s = join_all(c, 2)
    c.heartbeat(0, s[0], now=6)
    assert c.tick(now=6) == [1]  # node 1 dropped
    new = join(c, 1, now=7, replaces_session=s[1])
    assert new.alive and new.session != s[1]


def test_rounds_stop_waiting_for_the_replaced_run():
    c = make(l_comm=4, g_comm=4, round_timeout=10)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1], now=1)
    assert rnd.kind == RoundKind.GLOBAL
    out = c.report(0, s[0], rnd.id, Candidate(0, 1.0), 2, now=2)
    assert not out.ready  # waits for node 1, which crashed before reporting
    new = join(c, 1, now=3, replaces_session=s[1])
    out = c.outcome(0, rnd.id)  # closed at once, with node 0 only, long before t=11
    assert out.ready and out.nodes == (0,) and out.leader == Candidate(0, 1.0)
    assert new.last_round_seen == rnd.id  # the new run takes part from the next round
    s[1] = new.session
    assert acq(c, s, 1, now=3).grant > 0


def test_no_replacement_while_the_job_is_finishing():
    c = make(l_comm=4, g_comm=4, iters=16)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    assert rnd.kind == RoundKind.FINAL
    before = c.snapshot()
    with pytest.raises(CoordinatorError, match="finishing"):
        join(c, 1, replaces_session=s[1])
    assert c.snapshot() == before


TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO")


@pytest.mark.timeout(150)
def test_a_node_killed_and_restarted_at_once_rejoins_and_keeps_its_metrics(cluster):
    knobs = dict(NUM_GROUPS=2, NODE_TIMEOUT=30, ROUND_TIMEOUT=10, ITERATIONS=30000,
                 TOYJOB_STEP_SECONDS="0.0005", **TOY)
    n0 = cluster(0, PORT=0, **knobs)
    port = cluster.port_of_node0()
    n1 = cluster(1, PORT=port, **knobs)
    metrics = cluster.run_dir / "node1" / "metrics.csv"
    wait_for_rows(metrics)
    session = json.loads((cluster.run_dir / "node1" / "session").read_text())["session"]
    assert session > 0
    n1.kill_group()  # the node's local server and workers die at once (a crash, an OOM kill)
    n1.wait(10)
    first_rows = metric_rows(metrics)
    assert len(first_rows) >= 5
    again = cluster(1, PORT=port, **knobs)  # a supervisor restarts it at once
    assert again.wait(120) == 0, again.output
    assert n0.wait(30) == 0, n0.output
    assert "node 1 restarted: its earlier run is dropped" in n0.output
    assert "node 1 dropped" not in n0.output  # replaced at once, not after NODE_TIMEOUT=30
    assert "already in the job" not in again.output
    assert "node 1 joins a running job" in again.output
    assert sum(again.summary()["workers"].values()) > 0
    assert global_summary(cluster.run_dir)["counter"] == 30000
    rows = metric_rows(metrics)  # the rows of both runs, the first run's first
    assert rows[: len(first_rows)] == first_rows and len(rows) > len(first_rows)
    assert int(rows[-1]["round"]) > int(first_rows[-1]["round"])
    assert not (cluster.run_dir / "node1" / "session").exists()  # it left the job
    assert_clean_exit(cluster.run_dir, [n0, again])


@pytest.mark.timeout(60)
def test_a_new_job_in_an_old_run_dir_starts_a_fresh_metrics_file(cluster):
    # a session file left by a crashed run of an earlier job of the same id: the new job's
    # server does not know it, the counter is 0 at the join, the old rows go
    node_dir = cluster.run_dir / "node0"
    node_dir.mkdir(parents=True)
    (node_dir / "session").write_text(json.dumps({"job_id": cluster.job_id, "session": 12345}))
    (node_dir / "metrics.csv").write_text("round,kind\n999,global\n")
    n0 = cluster(0, PORT=0, ITERATIONS=2000, **TOY)
    assert n0.wait(50) == 0, n0.output
    rounds = [r["round"] for r in metric_rows(node_dir / "metrics.csv")]
    assert rounds and "999" not in rounds
    assert not (node_dir / "session").exists()


@pytest.mark.timeout(90)
def test_a_node_with_other_settings_is_refused_as_a_configuration_error(cluster):
    # one line naming the node and the knobs, exit 2 (CONFIG): running it again cannot help
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ENTRY="toyjob:main", ITERATIONS=100000, JOIN_TIMEOUT=60)
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **(knobs | {"WORKERS": 3}))
    assert n1.wait(60) == 2, n1.output
    lines = [line for line in n1.output.splitlines() if "refused this node" in line]
    assert len(lines) == 1, n1.output
    assert "node 1 runs" in lines[0] and "workers=3 but the job runs" in lines[0] and \
        "workers=2" in lines[0], lines[0]
    assert "Traceback" not in n1.output
    assert n1.summary()["exit_code"] == 2
    n0.proc.terminate()  # node 0 still waits for node 1: stop it as a user would
    assert n0.wait(60) == 143, n0.output
