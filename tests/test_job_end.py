"""How a job ends (issue 9, items 1, 2, 3, 6): a stop on node 0 ends every node within 10 s,
exit codes tell the truth, every summary says why the node ended, and a normal end needs no
terminated worker. Each test is bounded."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import REPO, assert_clean_exit, global_summary

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO")
# two nodes that train until stopped; short timeouts keep a failure short
FOREVER = dict(NUM_GROUPS=2, ITERATIONS=10**9, TOYJOB_STEP_SECONDS="0.001", NODE_TIMEOUT=2,
               ROUND_TIMEOUT=5, RECONNECT_TIMEOUT=60, **TOY)


def wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.05)
    return predicate()


def training(cluster, node: int) -> bool:
    """The node has run a few rounds."""
    path = cluster.run_dir / f"node{node}" / "metrics.csv"
    return path.exists() and len(path.read_text().splitlines()) >= 3


def start_two(cluster, **knobs):
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    return n0, n1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_on_node_0_ends_every_node_within_10_s(cluster, sig):
    n0, n1 = start_two(cluster, **FOREVER)
    assert wait_for(lambda: training(cluster, 0) and training(cluster, 1), 60), n0.output + n1.output
    if sig == signal.SIGINT:  # Ctrl-C in node 0's terminal: its whole process group
        os.killpg(n0.proc.pid, sig)
    else:  # `kill <pid>` of node 0's main process
        n0.proc.send_signal(sig)
    t0 = time.monotonic()
    assert n1.wait(15) == 4, n1.output  # exitcodes.STOPPED
    assert n0.wait(15) == (130 if sig == signal.SIGINT else 143), n0.output
    assert time.monotonic() - t0 < 10, "the job took more than 10 s to stop everywhere"
    why = "interrupted" if sig == signal.SIGINT else "terminated"
    line = f"lsgd: node 1: job stopped on node 0: {why}"
    assert n1.output.count(line) == 1, n1.output
    assert f"lsgd: node 0: {why}; the job was stopped on every node" in n0.output, n0.output
    for node, code in ((n0, 130 if sig == signal.SIGINT else 143), (n1, 4)):
        s = node.summary()
        assert s["exit_code"] == code and s["stop_reason"], s
        assert "Traceback" not in node.output
    assert n1.summary()["stop_reason"] == f"job stopped on node 0: {why}"
    g = global_summary(cluster.run_dir)
    assert g["stop_reason"] == f"job stopped on node 0: {why}" and g["exit_code"] == 0, g
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(90)
def test_ctrl_c_on_node_0_ends_an_asynchronous_job_everywhere_within_10_s(cluster):
    # no rounds: node 1 learns of the stop from its heartbeat, its credit calls or its sync
    # thread's refused exchanges, while its workers exchange with the node's copy of the center
    n0, n1 = start_two(cluster, **(FOREVER | dict(ALGORITHM="easgd-async", G_COMM=16)))
    assert wait_for(lambda: training(cluster, 0) and training(cluster, 1), 60), n0.output + n1.output
    os.killpg(n0.proc.pid, signal.SIGINT)  # Ctrl-C in node 0's terminal
    t0 = time.monotonic()
    assert n1.wait(15) == 4, n1.output
    assert n0.wait(15) == 130, n0.output
    assert time.monotonic() - t0 < 10, "the job took more than 10 s to stop everywhere"
    assert n1.output.count("lsgd: node 1: job stopped on node 0: interrupted") == 1, n1.output
    assert "lsgd: node 0: interrupted; the job was stopped on every node" in n0.output
    for node, code in ((n0, 130), (n1, 4)):
        s = node.summary()
        assert s["exit_code"] == code and s["async"]["exchanges"] > 0, s
        assert "Traceback" not in node.output
    assert global_summary(cluster.run_dir)["exit_code"] == 0
    assert_clean_exit(cluster.run_dir, [n0, n1])  # no process, no shared-memory segment left


@pytest.mark.timeout(90)
def test_ctrl_c_on_another_node_leaves_the_job_and_the_others_go_on_at_once(cluster):
    # NODE_TIMEOUT is long: only the interrupted node's Leave can let node 0 go on this soon
    n0, n1 = start_two(cluster, **(FOREVER | dict(NODE_TIMEOUT=60, ROUND_TIMEOUT=60)))
    assert wait_for(lambda: training(cluster, 0) and training(cluster, 1), 60), n0.output + n1.output
    os.killpg(n1.proc.pid, signal.SIGINT)  # Ctrl-C in node 1's terminal
    assert n1.wait(15) == 130, n1.output
    assert "lsgd: node 1: interrupted" in n1.output, n1.output
    assert wait_for(lambda: "node 1 left" in n0.output, 5), n0.output
    rows = len((cluster.run_dir / "node0" / "metrics.csv").read_text().splitlines())
    more = lambda: len((cluster.run_dir / "node0" / "metrics.csv").read_text().splitlines())  # noqa: E731
    assert wait_for(lambda: more() >= rows + 4, 20), "node 0 did not go on with its rounds"
    assert "dropped" not in n0.output and n0.proc.poll() is None
    os.killpg(n0.proc.pid, signal.SIGINT)
    assert n0.wait(15) == 130, n0.output
    assert "Traceback" not in n0.output + n1.output
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(120)
def test_node_0_losing_all_its_workers_ends_the_job_everywhere(cluster):
    # a bug in the user's code kills both workers of node 0 (RESPAWN cannot help a Python error)
    n0, n1 = start_two(cluster, TOYJOB_RAISE="0:300,1:300", **FOREVER)
    assert n0.wait(60) == 1, n0.output  # exitcodes.FAILED
    t0 = time.monotonic()
    assert n1.wait(15) == 4, n1.output
    assert time.monotonic() - t0 < 10
    assert "no worker left on this node" in n0.output
    assert "lsgd: node 0: the job was stopped on every node" in n0.output
    line = "lsgd: node 1: job stopped on node 0: no worker left on node 0"
    assert n1.output.count(line) == 1, n1.output
    assert "RuntimeError: a bug in the training loop" in n1.summary()["stop_reason"]
    assert n0.summary()["exit_code"] == 1 and "no worker left" in n0.summary()["stop_reason"]
    assert global_summary(cluster.run_dir)["stop_reason"].startswith("job stopped on node 0")
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(60)
def test_a_job_where_every_loss_is_nan_exits_3_and_says_so(cluster):
    node = cluster(0, PORT=0, ITERATIONS=2000, TOYJOB_NAN_LOSS=1, **TOY)
    assert node.wait(60) == 3, node.output  # exitcodes.DEGRADED
    s = node.summary()
    assert s["exit_code"] == 3 and "every loss was non-finite" in s["stop_reason"], s
    assert "lsgd: node 0 finished with problems: every loss was non-finite" in node.output
    assert_clean_exit(cluster.run_dir, [node])


@pytest.mark.timeout(60)
def test_two_quick_ctrl_c_still_end_cleanly_with_a_summary(cluster):
    node = cluster(0, PORT=0, ITERATIONS=10**9, TOYJOB_STEP_SECONDS="0.001",
                   TOYJOB_EXIT_SECONDS="1", **TOY)  # workers take a second to exit
    assert wait_for(lambda: training(cluster, 0), 40), node.output
    os.killpg(node.proc.pid, signal.SIGINT)
    time.sleep(0.3)  # the node is stopping its workers now
    os.killpg(node.proc.pid, signal.SIGINT)
    assert node.wait(20) == 130, node.output
    assert "Traceback" not in node.output and "already stopping" in node.output
    s = node.summary()
    assert s["exit_code"] == 130 and s["stop_reason"] == "interrupted", s
    assert set(s["worker_exit_codes"].values()) == {0}, s  # waited for, not killed
    assert global_summary(cluster.run_dir)["exit_code"] in (0, 1)
    assert_clean_exit(cluster.run_dir, [node])


@pytest.mark.timeout(60)
def test_processes_that_exit_slowly_after_the_end_are_waited_for(cluster):
    # processes take 1 s (workers) and 3 s (the evaluator) to exit after their last message
    # (an exit handler, a slow interpreter teardown: PyTorch's takes ~1 s of CPU, several
    # seconds on a busy machine): the node waits for them instead of terminating them
    node = cluster(0, PORT=0, ITERATIONS=2000, EVAL_EVERY=500, TOYJOB_EXIT_SECONDS="1:3", **TOY)
    assert node.wait(60) == 0, node.output
    assert "did not stop" not in node.output, node.output
    s = node.summary()
    assert set(s["worker_exit_codes"].values()) == {0}, s
    assert s["evaluator"]["exit_code"] == 0, s
    assert s["exit_code"] == 0 and s["stop_reason"] == "job finished"
    assert_clean_exit(cluster.run_dir, [node])


@pytest.mark.slow  # test_examples.py's torch job checks the same for LSGD by default
@pytest.mark.timeout(240)
def test_the_torch_example_ends_without_terminating_a_worker(cluster):
    pytest.importorskip("torch")
    knobs = dict(NUM_GROUPS=2, ALGORITHM="easgd", ITERATIONS=800, EVAL_EVERY=400,
                 ENTRY=str(REPO / "examples" / "torch_cnn.py"), PYTHONPATH=REPO)
    n0, n1 = start_two(cluster, **knobs)
    assert n0.wait(200) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    for node in (n0, n1):
        assert "did not stop" not in node.output, node.output
        assert set(node.summary()["worker_exit_codes"].values()) == {0}, node.output
    assert n0.summary()["evaluator"]["exit_code"] == 0
    assert_clean_exit(cluster.run_dir, [n0, n1])
