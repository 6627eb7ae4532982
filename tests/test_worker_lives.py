"""A respawned worker's process is told apart from its dead predecessor (issue 9, item 5),
checked on a local server's message handling without processes or a global server."""

from __future__ import annotations

import queue
import time

import pytest

from lsgd.config import JobConfig
from lsgd.local_server import messages as m
from lsgd.local_server.server import LocalServer
from lsgd.local_server.state import WorkerState


class Proc:
    """Stands in for a live worker process."""

    exitcode = None
    pid = 0
    name = "fake"

    def is_alive(self) -> bool:
        return True


class Replies:
    """A worker's reply queue that records what the node sends."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def put(self, msg: object) -> None:
        self.sent.append(msg)


@pytest.fixture
def node(tmp_path):
    server = LocalServer(JobConfig(run_dir=str(tmp_path), workers=2), "127.0.0.1:1")
    server.inbox = queue.Queue()
    server.workers = [WorkerState(i, i, Proc(), Replies(), time.monotonic()) for i in range(2)]
    yield server
    server.client.close()
    server.metrics.close()


def respawned(w: WorkerState) -> WorkerState:
    """What _respawn leaves: a new process (life 1) that has not had its Setup."""
    w.respawns.append(time.time())
    w.replies, w.starting, w.absent = Replies(), True, True
    return w


def test_what_a_dead_process_sent_counts_its_steps_and_is_never_answered(node):
    w = respawned(node.workers[1])
    for msg in (m.Ask(1, 5), m.Join(1, 3, 0.5, 7, 100), m.Progress(1, 2), m.Done(1, 3)):
        node.inbox.put(msg)  # life 0: sent by the process that died
        assert node._recv() is None
    assert node.report.late == 14 and node.report.consumed == 0  # its credits were released
    assert w.iterations == 14
    assert not node.pending and w.replies.sent == [] and w.absent  # nothing answered, not back


def test_the_new_process_is_heard_and_gets_nothing_but_setup_or_stop_before_its_setup(node):
    w = respawned(node.workers[1])
    for msg in (m.Credits(4), m.RoundCall(3, 1), m.Pull(3, (), False)):
        node._send(w, msg)
    assert w.replies.sent == []
    node._send(w, m.Stop("job finished"))
    assert w.replies.sent == [m.Stop("job finished")]
    node.inbox.put(m.Hello(1, 10, life=1))  # during the handshake: handed to the caller
    assert isinstance(node._recv(), m.Hello) and w.absent  # back only once set up
    node.inbox.put(m.Ready(1, life=1))
    assert isinstance(node._recv(), m.Ready) and not w.absent
    w.starting = False  # its Setup was sent
    node._send(w, m.Credits(4))
    assert w.replies.sent[-1] == m.Credits(4)


def test_the_other_workers_messages_are_untouched(node):
    respawned(node.workers[1])
    node.inbox.put(m.Ask(0, 3))
    assert node._recv() == m.Ask(0, 3)
    assert node.report.late == 0


class Exited(Proc):
    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid, self.exitcode = pid, exitcode


class Unread(queue.Queue):
    """An inbox that still holds what exited processes sent (``drain``, as ``Inbox``)."""

    def __init__(self, left: dict[int, list[object]]) -> None:
        super().__init__()
        self.left = left

    def drain(self, pid: int) -> list[object]:
        return self.left.pop(pid, [])


@pytest.mark.parametrize("exitcode", [0, 1])
def test_a_bye_read_only_after_the_process_exited_ends_the_worker_and_is_not_respawned(
        node, caplog, exitcode):
    # the loop ended (Bye) and the process exited before the node read its pipe: running the
    # loop again would redo its steps from step 1 (CI: 200 steps counted for a loop of 100)
    node.store, respawned_ = object(), []
    node._respawn = respawned_.append
    w0, w1 = node.workers
    w0.outstanding, w1.outstanding = 8, 8
    w1.proc = Exited(102, exitcode)
    node.inbox = Unread({102: [m.Progress(1, 60), m.Bye(1, 40)]})
    node._check_workers()
    assert respawned_ == [] and w1.gone and not w0.gone
    assert w1.iterations == 100 and node.report.consumed + node.report.late == 100
    said = "worker 1 left the job: its training loop ended"
    assert said in caplog.text
    if exitcode:  # it ended, then failed: the node says so and the result is suspect
        assert ", then its process exited with code 1" in caplog.text
        assert node._problems() != []
    else:
        assert node._problems() == []


def test_a_process_that_exited_without_a_bye_is_respawned(node):
    node.store, respawned_ = object(), []
    node._respawn = respawned_.append
    w1 = node.workers[1]
    w1.proc = Exited(102, 0)
    node.inbox = Unread({102: [m.Progress(1, 60)]})
    node._check_workers()
    assert respawned_ == [w1] and w1.iterations == 60


def test_the_inbox_reads_every_process_pipe_and_drains_a_dead_ones():
    import multiprocessing as mp

    from lsgd.local_server.inbox import Inbox

    inbox = Inbox(mp.get_context("spawn"))
    first, second = inbox.open(), inbox.open()
    first.put(m.Ask(0, 1))
    second.put(m.Ask(1, 2))
    second.put(m.Bye(1, 3))
    first.put(m.Ask(0, 4))
    inbox.bind(first, 101)  # as if started: only the (here: finished) process holds its end
    inbox.bind(second, 102)
    assert not inbox.empty()
    assert inbox.drain(102) == [m.Ask(1, 2), m.Bye(1, 3)]  # a dead process's last words
    assert [inbox.get(1.0), inbox.get(1.0)] == [m.Ask(0, 1), m.Ask(0, 4)]
    with pytest.raises(queue.Empty):  # its end is closed: read no more, not an error
        inbox.get(0.1)
    assert inbox.empty() and inbox.drain(101) == []
    inbox.close()
