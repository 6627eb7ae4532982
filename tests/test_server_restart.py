"""Node 0's global server after a crash (issue 9, items 12 and 13): the supervisor restarts it
after any unexpected exit and says why; the restarted server never repeats a round id, an
evaluation or a checkpoint, and takes back nodes holding a period's credits."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time

import pytest

from lsgd import cli
from lsgd.config import JobConfig
from lsgd.global_server.coordinator import Coordinator, CoordinatorError, Schedule
from lsgd.local_server.global_client import GlobalClient
from lsgd.local_server.state import NodeError
from test_insider import _Node  # the parts of a LocalServer that _reattach uses


def _coord():
    sched = Schedule.for_job(num_groups=1, workers=2, l_comm=4096, g_comm=4096, local_rounds=False,
                             max_iterations=None)
    return Coordinator(job_id="j", algorithm="lsgd", num_groups=1, workers=2, schedule=sched,
                       max_seconds=None, node_timeout=5.0, round_timeout=10.0, join_timeout=30.0,
                       now=0.0)


class _Proc:
    def __init__(self, exitcode):
        self.exitcode, self.pid = exitcode, 1


def _supervise(monkeypatch, first_code, word, restarted_code=None):
    """Run a _Supervisor over a process that ended with ``first_code`` after saying ``word``."""
    starts = []

    def start(config, level, security, restore=False):
        r, w = mp.Pipe(duplex=False)
        if restarted_code is not None:
            w.send(("crashed", "OSError: disk full"))
        starts.append(restore)
        return _Proc(restarted_code), r

    monkeypatch.setattr(cli, "_start_global", start)
    monkeypatch.setattr(cli, "_await_global", lambda proc, ready: 1)
    monkeypatch.setattr(cli._Supervisor, "MAX_RESTARTS", 2)
    r, w = mp.Pipe(duplex=False)
    if word is not None:
        w.send(word)
    sup = cli._Supervisor(JobConfig(), logging.INFO, None, _Proc(first_code))
    sup.pipe = r  # the server process's pipe: what it said about its end
    sup.start()
    time.sleep(1.5)
    sup.stop()
    return sup, starts


def test_the_supervisor_restarts_a_crashed_server_and_says_why(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    sup, starts = _supervise(monkeypatch, 1, ("crashed", "KeyError: 'global_leader'"),
                             restarted_code=1)
    assert starts == [True, True] and sup.restarts == 2  # not only after a signal
    text = caplog.text
    assert "global server died (exit code 1); restarting it" in text
    assert "KeyError: 'global_leader'" in text and "OSError: disk full" in text
    assert "died 3 times" in sup.fate() and "IP_ADDR" not in sup.fate()


def test_the_supervisor_does_not_restart_a_server_that_ended_on_its_own(monkeypatch):
    sup, starts = _supervise(monkeypatch, 0, ("ended", 0))
    assert starts == [] and sup.fate() is None
    sup, starts = _supervise(monkeypatch, 1, ("ended", 1))  # e.g. it could not restore
    assert starts == [] and "ended with exit code 1" in sup.fate()
    sup, starts = _supervise(monkeypatch, -signal.SIGKILL, None)
    assert starts == [True]


def test_node_0_says_its_own_server_died_not_ip_addr():
    fate = ("the global server this node started died 6 times (last: exit code 1, its last "
            "error: KeyError: 'x')")
    node = _Node(GlobalClient("127.0.0.1:9", "job", 0, round_timeout=5.0), fate=fate)
    with pytest.raises(NodeError) as e:
        node._reattach()
    assert "KeyError" in str(e.value) and "IP_ADDR" not in str(e.value)


def test_a_reattach_holding_a_periods_credits_is_accepted_after_a_restart():
    """G_COMM=4096, one node of 2 workers: a grant is 4096, more than the stale state's
    target - done; what the server could have granted bounds it instead."""
    c = _coord()
    s = c.join(job_id="j", index=0, workers=2, algorithm="lsgd", num_groups=1, now=0).session

    def ask(consumed, seq, want=10**6):
        return c.acquire(0, s, consumed=consumed, late=0, released=0, want=want,
                         last_round_seen=c.round.id if c.round else 0, now=1, seq=seq)

    g = ask(0, 1).grant
    ask(g, 2)
    ask(3000, 3)
    stale = c.state(1)  # saved here (done 7096 of 8192); the server goes on, then dies
    ask(8192 - 7096, 4)
    held = ask(0, 5).grant
    assert c.round.id == 1 and held == 4096
    restored = _coord()
    restored.restore(stale, now=2)
    node = restored.join(job_id="j", index=0, workers=2, algorithm="lsgd", num_groups=1, now=2,
                         resume_session=s, held=held, unreported=0, seq=6)
    assert node.outstanding == held
    with pytest.raises(CoordinatorError) as e:  # more than a node can ever hold is refused
        restored.join(job_id="j", index=0, workers=2, algorithm="lsgd", num_groups=1, now=2,
                      resume_session=s, held=8193, unreported=0, seq=7)
    assert e.value.code == "INVALID_ARGUMENT" and node.outstanding == held


@pytest.mark.timeout(120)
def test_round_ids_and_evaluations_never_repeat_after_a_server_restart(tmp_path):
    """SIGKILL the real server process between its (lagging) state saves; node 0's restart of it
    knows the node that joined since, and goes on with new round ids and without repeating an
    evaluation round."""
    config = JobConfig(num_groups=1, workers=1, job_id="job", algorithm="lsgd", l_comm=2,
                       g_comm=2, eval_every=4, state_every=600, node_timeout=30, port=0,
                       run_dir=str(tmp_path), join_timeout=60)
    proc, ready = cli._start_global(config, logging.WARNING, None)
    port = cli._await_global(proc, ready)
    c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
    seen = []  # (round id, iteration, evaluate)
    last = {"round": 0}  # the newest round this node has started (reset by a reattach)

    def train(rounds, held=0):
        while len(seen) < rounds:
            ans = c.acquire(consumed=held, late=0, released=0, want=1,
                            last_round_seen=last["round"], max_wait=0.5)
            held = ans.grant
            if ans.round_id:
                last["round"] = ans.round_id
                out = c.report_round(ans.round_id, None, 1)
                seen.append((ans.round_id, ans.round_iteration, out.evaluate))
        return held

    state = tmp_path / "global" / "state.json"
    try:
        end = time.monotonic() + 10
        while not state.exists() and time.monotonic() < end:  # its first save: no node yet
            time.sleep(0.05)
        c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=1, connect_timeout=10)
        held = train(5)
        assert '"nodes": {}' in state.read_text()  # the save lags: the join is not in it
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        proc, ready = cli._start_global(config.replace(port=port), logging.WARNING, None,
                                        restore=True)
        cli._await_global(proc, ready)
        last["round"] = c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=1,
                               connect_timeout=10, resume=True, held=held).round_id
        train(10, held=held)
    finally:
        c.close()
        proc.terminate()
        proc.join(10)
    ids = [r for r, _, _ in seen]
    assert len(set(ids)) == len(ids) and ids == sorted(ids), seen
    evaluated = [it for _, it, ev in seen if ev]
    assert len(set(evaluated)) == len(evaluated) and len(evaluated) >= 2, seen


def test_the_rounds_journal_never_lends_its_counter_to_older_request_numbers(tmp_path):
    # state.json (dump 1) holds the counter with the nodes' request numbers; a newer round in the
    # journal (dump 2) moves the schedule on, but its counter would pair a newer count with older
    # numbers, and a reattaching node's lost request would then be counted twice.
    from lsgd.global_server.journal import Journal

    j = Journal(tmp_path)
    state = {"dump": 1, "done": 100, "rounds_opened": 4, "target": 128, "target_kind": 1,
             "period_start": 96, "next_eval": 0, "next_checkpoint": 0, "stop_reason": None,
             "started": True, "stopped": None, "nodes": {"0": {"last_seq": 3}}}
    j.write(state | {"dump": 2, "done": 130, "rounds_opened": 5, "target": 160,
                     "period_start": 128}, members=False)
    j.close()
    got = j.load(state)
    assert (got["rounds_opened"], got["target"], got["period_start"]) == (5, 160, 128)
    assert got["done"] == 100 and got["nodes"] == state["nodes"]


def test_a_restarted_server_whose_session_port_is_taken_serves_the_streams_on_port(tmp_path):
    """A restart mid-job cannot wait for the port: the nodes are waiting. It says so and the
    nodes' streams go to PORT (at its first start, the same is an error: exit 2, test_first_run)."""
    import socket

    config = JobConfig(num_groups=1, workers=1, job_id="job", algorithm="lsgd", l_comm=2,
                       g_comm=2, state_every=0.1, node_timeout=30, port=0,
                       run_dir=str(tmp_path), join_timeout=60)
    proc, ready = cli._start_global(config, logging.WARNING, None)
    port = cli._await_global(proc, ready)
    c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
    taken = socket.socket()
    try:
        c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=1, connect_timeout=10)
        session = c._session_port
        assert session
        held = c.acquire(consumed=0, late=0, released=0, want=1, last_round_seen=0,
                         max_wait=0.5).grant
        time.sleep(0.5)  # a state save with the node in it
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its old connections
        taken.bind(("127.0.0.1", session))
        taken.listen()
        proc, ready = cli._start_global(config.replace(port=port, session_port=session),
                                        logging.WARNING, None, restore=True)
        assert cli._await_global(proc, ready) == port
        c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=1, connect_timeout=10,
               resume=True, held=held)
        assert c._session_port == 0  # told: no session port on this server
        c.acquire(consumed=held, late=0, released=0, want=1, last_round_seen=0, max_wait=0.5)
    finally:
        taken.close()
        c.close()
        proc.terminate()
        proc.join(10)
