"""A node at the edge of its machine (issue 9, item 21): a /dev/shm too small for the node
segment (Docker's default is 64 MB), and a node loop inside a long blocking call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SMALL_SHM = "mount -t tmpfs -o size=2m tmpfs /dev/shm"


def _private_shm_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", SMALL_SHM], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_private_shm = pytest.mark.skipif(not _private_shm_works(),
                                       reason="needs unshare -m and mount (root)")


def in_small_shm(command: str, tmp_path, timeout: float, **env) -> subprocess.CompletedProcess:
    """Run ``command`` with a 2 MB /dev/shm of its own (a private mount namespace)."""
    full = dict(os.environ, PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"), PORT="0",
                PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["unshare", "-m", "sh", "-c", f"{SMALL_SHM} && exec {command}"],
                          env=full, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@needs_private_shm
@pytest.mark.timeout(90)
def test_a_too_small_dev_shm_is_one_line_and_exit_2(tmp_path):
    res = in_small_shm(f"bash {REPO / 'train.sh'} 0", tmp_path, timeout=80, ENTRY="toyjob:main",
                       TOYJOB_SIZE=1_000_000, ITERATIONS=2000)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out  # not 135 (Bus error)
    lines = [line for line in out.splitlines() if "/dev/shm has" in line]
    assert len(lines) == 1, out
    # 2 slots + 3 LSGD buffers (local leader, global leader, sum) of 1,000,000 float32
    assert "/dev/shm has 2.0 MB free but this node's shared memory needs 19.1 MB" in lines[0]
    assert "--shm-size" in lines[0] and "Traceback" not in out and "Bus error" not in out


@needs_private_shm
@pytest.mark.timeout(60)
def test_the_segment_is_reserved_so_touching_it_cannot_sigbus(tmp_path):
    # /dev/shm says it has room (the check is fooled), but the pages are not there: the
    # reservation at creation fails with the same error instead of a SIGBUS on first touch
    script = textwrap.dedent("""
        import numpy as np
        from lsgd.local_server import store
        store.shm_free = lambda: 1 << 40
        layout = store.StoreLayout.new("b4", 0, 1_000_000, 2, ("sum",))
        try:
            s = store.NodeStore.create(layout)
        except store.SharedMemoryTooSmall as exc:
            print("refused:", exc)
        else:
            for i in range(2):
                s.slot(i)[:] = 1.0  # every page: SIGBUS where the space was never there
            print("touched")
        import os
        print("left:", sorted(os.listdir("/dev/shm")))
    """)
    (tmp_path / "reserve.py").write_text(script)
    res = in_small_shm(f"{sys.executable} reserve.py", tmp_path, timeout=50)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert "refused: /dev/shm has" in res.stdout and "needs 11.4 MB" in res.stdout, res.stdout
    assert "left: []" in res.stdout  # nothing left behind


class Shared:
    value = 0.0


class Timeout(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "deadline exceeded"


def test_the_loop_beat_goes_on_only_within_the_calls_bound():
    import time

    from lsgd.local_server.liveness import LoopBeat

    shared = Shared()
    beat = LoopBeat(shared, period=0.05)
    try:
        with beat.blocking(limit=0.6):
            entered = time.monotonic()
            time.sleep(0.4)
            assert shared.value > entered + 0.25  # beaten for the loop while it blocks
            time.sleep(0.6)  # past the call's own bound: stuck, as far as anyone can tell
            stuck_at = shared.value
            time.sleep(0.3)
            assert shared.value == stuck_at and time.monotonic() - stuck_at > 0.3
            with beat.blocking(limit=5.0):  # a nested bounded call beats again...
                time.sleep(0.2)
                assert time.monotonic() - shared.value < 0.15
            left = shared.value  # ...and leaving it restores the outer (expired) bound
            time.sleep(0.2)
            assert shared.value == left
        outside = shared.value
        time.sleep(0.2)
        assert shared.value == outside  # outside a blocking call only the loop beats
    finally:
        beat.close()


@pytest.mark.timeout(60)
def test_a_long_round_barrier_keeps_the_nodes_beat(tmp_path):
    # the node loop blocked in ReportRound (a global round's barrier: up to round_timeout):
    # its workers, which read the beat, must see it refreshed during the wait
    import time

    from lsgd.config import JobConfig
    from lsgd.local_server.server import LocalServer

    server = LocalServer(JobConfig(run_dir=str(tmp_path / "run"), port=1), "127.0.0.1:1")
    seen = {}

    def report_round(rid, best, participants, weight=0.0, **_):  # the barrier, to its deadline
        seen["entered"] = time.monotonic()
        server.beat.value = 0.0  # only a beat during the call can set it again
        time.sleep(2.5)
        seen["beat"] = server.beat.value
        raise Timeout()

    server.client.report_round = report_round
    try:
        assert server._report(1, None, 0) is None
    finally:
        server._shutdown()
    assert seen["beat"] > seen["entered"] + 0.5


class _BeatCounter:
    """The part of a GlobalClient a Heartbeat uses: counts beats, answers like a server."""

    address, session = "127.0.0.1:1", 1

    def __init__(self) -> None:
        self.beats = 0
        self.answered_at = float("-inf")  # when the node loop's own call was last answered

    def beat(self, report):
        from lsgd.proto import lsgd_pb2 as pb
        self.beats += 1
        return pb.HeartbeatResponse()


def test_the_heartbeat_stops_while_the_node_loop_is_stuck_and_goes_on_after():
    # the process is up but its loop is stuck: the server must drop the node (and the
    # liveness probe then fails), so the heartbeat thread no longer speaks for it
    import time
    from lsgd.local_server.heartbeat import Heartbeat
    silent = {"s": 0.0}
    client = _BeatCounter()
    hb = Heartbeat(client, interval=0.02, give_up=10.0, loop_silent=lambda: silent["s"],
                   stale_after=5.0)
    hb.start()
    try:
        deadline = time.monotonic() + 5
        while client.beats < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.beats >= 5 and not hb.loop_stuck
        silent["s"] = 6.0  # the loop's beat is older than stale_after
        time.sleep(0.1)
        stopped_at = client.beats
        time.sleep(0.3)
        assert hb.loop_stuck and client.beats == stopped_at
        silent["s"] = 0.0
        deadline = time.monotonic() + 5
        while client.beats < stopped_at + 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not hb.loop_stuck and client.beats >= stopped_at + 5
    finally:
        hb.stop()


def test_beats_thin_out_while_the_node_loops_own_calls_are_answered():
    # a busy node's credit calls keep it alive on the server; its beats then only carry the
    # status report, one every REPORT_EVERY intervals
    import threading
    import time
    from lsgd.local_server.heartbeat import REPORT_EVERY, Heartbeat
    client = _BeatCounter()
    busy = threading.Event()

    def loop_calls() -> None:  # the node loop, answered every 5 ms
        while not busy.is_set():
            client.answered_at = time.monotonic()
            time.sleep(0.005)

    hb = Heartbeat(client, interval=0.02, give_up=10.0)
    hb.start()
    try:
        time.sleep(0.4)
        idle = client.beats
        assert idle >= 10  # no calls of the loop: a beat every interval
        caller = threading.Thread(target=loop_calls)
        caller.start()
        before = client.beats
        time.sleep(1.2)
        busy.set()
        caller.join()
        thinned = client.beats - before
        # unthinned, 1.2 s of 20 ms intervals would be 60 beats
        assert 1 <= thinned <= 1.2 / (REPORT_EVERY * 0.02) + 3
        after = client.beats
        time.sleep(0.4)
        assert client.beats - after >= 10  # idle again: every interval
    finally:
        hb.stop()


def test_beats_are_not_thinned_while_the_job_waits_for_nodes():
    # the loop's long-polls are answered while the job waits for a node; the beats' answers
    # say when it starts and who is there (CI: node 0 said "waiting for node 1" 2 s after
    # node 1 joined, and printed one progress line of a 3 s job)
    import threading
    import time
    from lsgd.local_server.heartbeat import Heartbeat

    class View:
        started = False

        def waiting_for_nodes(self) -> bool:
            return not self.started

        def on_heartbeat(self, **answer) -> None:  # (the test says when the job starts)
            pass

    client, view, busy = _BeatCounter(), View(), threading.Event()

    def loop_calls() -> None:
        while not busy.is_set():
            client.answered_at = time.monotonic()
            time.sleep(0.005)

    hb = Heartbeat(client, interval=0.02, give_up=10.0, view=view)
    hb._reporting = False  # beats without status reports (this view makes none)
    caller = threading.Thread(target=loop_calls)
    caller.start()
    hb.start()
    try:
        time.sleep(0.6)
        assert client.beats >= 15  # waiting: a beat every interval, answered calls or not
        view.started = True
        time.sleep(0.1)
        before = client.beats
        time.sleep(0.6)
        assert client.beats - before <= 0.6 / (3 * 0.02) + 3  # started: thinned again
    finally:
        busy.set()
        caller.join()
        hb.stop()


def test_semaphores_of_a_node_killed_outright_are_removed_by_its_next_run(tmp_path):
    # SIGKILL of a node's whole process group takes Python's resource tracker with it, which
    # would have unlinked the queues' named semaphores (/dev/shm/sem.mp-*)
    import signal
    import time

    from lsgd.local_server.store import reclaim_semaphores

    script = textwrap.dedent(f"""
        import multiprocessing as mp, sys, time
        from pathlib import Path
        from lsgd.local_server.store import remember_semaphores
        ctx = mp.get_context("spawn")
        queues = [ctx.Queue() for _ in range(2)]
        for q in queues:
            remember_semaphores(Path({str(tmp_path)!r}), q)
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        names = (tmp_path / "semaphores").read_text().split()
        assert len(names) == 6 and all(Path(f"/dev/shm/sem.{n}").exists() for n in names)
        assert reclaim_semaphores(tmp_path) == []  # still in use: left alone
        (tmp_path / "semaphores").write_text("".join(f"{n}\n" for n in names))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    time.sleep(0.2)
    assert all(Path(f"/dev/shm/sem.{n}").exists() for n in names)  # left behind...
    assert sorted(reclaim_semaphores(tmp_path)) == sorted(f"sem.{n}" for n in names)  # ...removed
    assert not any(Path(f"/dev/shm/sem.{n}").exists() for n in names)
    assert not (tmp_path / "semaphores").exists()
