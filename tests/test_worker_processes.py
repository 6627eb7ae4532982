"""Worker processes (issue 9): the user's code may start processes of its own (item 4), and a
SIGKILLed worker never freezes the job (item 5). Each test runs `train.sh` and is bounded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import assert_clean_exit, global_summary, pid_alive

PROC = dict(ENTRY="procjob:main", LOG_LEVEL="INFO")


def started(path) -> list[int]:
    """The pids a procjob worker wrote: the processes it started."""
    return [int(p) for p in path.read_text().split()]


def wait_for(path, node, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end and node.proc.poll() is None, node.output
        time.sleep(0.05)


def alive_after(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while [p for p in pids if pid_alive(p)] and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


# ------------------------------------------------------------------ item 4


def test_what_a_worker_starts_ends_with_it_killed_or_orphaned():
    import multiprocessing as mp

    import procjob
    from lsgd.local_server.procs import end_group

    ctx = mp.get_context("spawn")
    received, pids = ctx.Pipe(duplex=False)
    # Killed: the node ends the group the worker led (the program never notices by itself).
    proc = ctx.Process(target=procjob.group_leader, args=(os.getpid(), pids))
    proc.start()
    assert received.poll(60)
    _, sleeper = received.recv()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert alive_after([sleeper], 0.5) == [sleeper]
    end_group(proc.pid)
    assert not alive_after([sleeper], 2.0)
    # Orphaned (its local server, here a stand-in, was SIGKILLed): it ends its own group.
    server = ctx.Process(target=procjob.stand_in_server, args=(pids,))
    server.start()
    assert received.poll(60)
    worker, sleeper = received.recv()
    os.kill(server.pid, signal.SIGKILL)
    server.join(10)
    assert not alive_after([worker, sleeper], 2.0)


def test_ending_a_group_never_reaches_the_callers_own_group(monkeypatch):
    # A process that never ran (pid 0 or None, as in stand-ins) or one in our own group: killpg(0)
    # would kill the caller's whole group (the node, or the test runner).
    from lsgd.local_server import procs

    calls = []
    monkeypatch.setattr(procs.os, "killpg", lambda pgid, sig: calls.append(pgid))
    for pid in (0, None, 1, os.getpgrp()):
        procs.end_group(pid)
    assert calls == []
    procs.end_group(os.getpgrp() + 1 if os.getpgrp() + 1 != os.getpid() else os.getpgrp() + 2)
    assert len(calls) == 1


@pytest.mark.timeout(60)
def test_the_node_never_waits_at_exit_for_a_worker_left_running():
    # multiprocessing joins non-daemonic children at exit without a timeout; a worker that a
    # cut-short shutdown left running would hold the node forever.
    import subprocess
    import sys

    script = ("import multiprocessing as mp, time\n"
              "from lsgd.local_server.procs import start_process\n"
              "p = start_process(mp.get_context('spawn'), time.sleep, (600,), 'w')\n"
              "print(p.pid, flush=True)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert time.monotonic() - t0 < 20, out
    assert not alive_after([int(out.stdout)], 2.0)


@pytest.mark.timeout(150)
def test_a_worker_can_use_a_pool_and_a_dataloader_and_nothing_survives_the_job(cluster, tmp_path):
    pytest.importorskip("torch")
    node = cluster(0, PORT=0, ITERATIONS=400, PROCJOB_LOADER=1, PROCJOB_DIR=tmp_path, **PROC)
    assert node.wait(120) == 0, node.output
    kids = {w: started(tmp_path / f"{w}.0.children") for w in (0, 1)}
    assert all(len(k) == 5 for k in kids.values()), kids  # Pool 2, DataLoader 2, sleep 1
    assert "failed" not in node.output, node.output
    steps = sum(int((tmp_path / f"{w}.count").read_text()) for w in (0, 1))
    assert global_summary(cluster.run_dir)["counter"] == steps == 400
    assert_clean_exit(cluster.run_dir, [node])  # every process of the node's session is gone
    assert not [p for k in kids.values() for p in k if pid_alive(p)]


@pytest.mark.timeout(120)
def test_what_a_killed_worker_started_goes_with_it_and_ctrl_c_ends_the_rest(cluster, tmp_path):
    node = cluster(0, PORT=0, ITERATIONS=10**9, PROCJOB_DIE="1:20", PROCJOB_STEP_SECONDS=0.002,
                   PROCJOB_DIR=tmp_path, **PROC)
    wait_for(tmp_path / "1.1.children", node)  # worker 1 was killed, started again, trains
    first = started(tmp_path / "1.0.children")
    assert len(first) == 3
    # what it started went with it, also the program that never notices its parent died
    assert not alive_after(first, 2.0), first
    assert "started again" in node.output
    os.killpg(node.proc.pid, signal.SIGINT)  # Ctrl-C in the node's terminal
    assert node.wait(30) == 130, node.output
    assert not node.wait_session_gone(10), "a process of the node's session survived"
    assert not alive_after(started(tmp_path / "0.0.children") + started(tmp_path / "1.1.children"), 1)


@pytest.mark.timeout(120)
def test_a_killed_local_server_takes_its_workers_and_their_processes_along(cluster, tmp_path):
    # worker 1 is in a long step (it would not see for 600 s that its local server died)
    node = cluster(0, PORT=0, ITERATIONS=10**9, PROCJOB_STEP_SECONDS=0.002, PROCJOB_STALL="1:50",
                   PROCJOB_DIR=tmp_path, **PROC)
    wait_for(tmp_path / "0.0.children", node)
    wait_for(tmp_path / "1.stalled", node)
    kids = started(tmp_path / "0.0.children") + started(tmp_path / "1.0.children")
    os.kill(node.proc.pid, signal.SIGKILL)  # the local server (train.sh exec's into it)
    node.wait(10)
    left = alive_after(kids, 5.0)
    assert not left, [Path(f"/proc/{p}/cmdline").read_text() for p in left]
    assert not node.wait_session_gone(10), "a process of the node's session survived"


# ------------------------------------------------------------------ item 5

TOY = dict(ENTRY="killjob:main", LOG_LEVEL="INFO", ROUND_TIMEOUT=30, TOYJOB_STEP_SECONDS=0.001)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm, knobs", [
    ("lsgd", dict(TOYJOB_DIE="1:150")),  # between rounds, holding credits
    ("lsgd", dict(KILLJOB="1:3:ask")),  # its Ask for credits reached the node
    ("lsgd", dict(KILLJOB="1:3:join")),  # joined a round: seen while the pulls run
    # seen while the joins are collected, long before the new process can say Hello
    ("lsgd", dict(KILLJOB="1:3:join", KILLJOB_SLOW="0:3:0.3", KILLJOB_RESPAWN_DELAY=1.5)),
    ("lsgd", dict(KILLJOB="1:3:pull")),  # got its Pull, died before Done
    ("lsgd", dict(KILLJOB="1:3:send")),  # in the middle of sending a message
    ("easgd", dict(KILLJOB="1:3:join")),
], ids=["between-rounds", "after-ask", "after-join", "after-join-slow-round", "during-pull",
        "while-sending", "easgd-after-join"])
def test_a_killed_worker_never_freezes_the_job(cluster, tmp_path, algorithm, knobs):
    node = cluster(0, PORT=0, ITERATIONS=4000, ALGORITHM=algorithm, TOYJOB_COUNT_DIR=tmp_path,
                   **knobs, **TOY)
    assert node.wait(60) == 0, node.output
    ended = time.time()
    died = float((tmp_path / "1.died").read_text())
    # A stall would last ROUND_TIMEOUT (30 s); the whole job takes a few seconds.
    assert ended - died < 20, node.output
    for stall in ("missed it", "did not finish their pulls", "expected Setup", "Traceback"):
        assert stall not in node.output, node.output
    s = node.summary()
    assert len(s["respawns"]["1"]) == 1 and s["worker_exit_codes"] == {"0": 0, "1": 0}
    assert int((tmp_path / "1.count").read_text()) > 100  # the new process trained on
    assert global_summary(cluster.run_dir)["counter"] == sum(s["workers"].values()) == 4000
    assert_clean_exit(cluster.run_dir, [node])
