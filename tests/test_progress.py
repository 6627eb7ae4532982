"""The progress display of a 2-node job started with train.sh (issue 10, item 1): a live line on
a terminal (a pseudo-terminal here), progress and wait lines in a log, nothing at WARNING."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, TESTS, assert_clean_exit, shm_segments

# 4 workers of at most 1000 steps/s each: at least 2 s of training
JOB = dict(NUM_GROUPS=2, WORKERS=2, ITERATIONS=8000, ENTRY="toyjob:main", TOYJOB_STEP_SECONDS="0.001")
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # the start of every log record


def visible(line: str) -> str:
    """What a terminal shows of one line written as ``line`` (carriage returns overwrite,
    ``ESC [K`` erases to the end)."""
    cells: list[str] = []
    col, i = 0, 0
    while i < len(line):
        if line.startswith("\x1b[K", i):
            del cells[col:]
            i += 3
            continue
        ch = line[i]
        if ch == "\r":
            col = 0
        else:
            cells[col:col + 1] = [ch]
            col += 1
        i += 1
    return "".join(cells)


class PtyNode:
    """`bash train.sh <i>` with stdout and stderr on a pseudo-terminal of its own."""

    def __init__(self, index: int, env: dict[str, str], size: tuple[int, int] = (50, 200)) -> None:
        import fcntl
        import struct
        import termios

        self.index, self.env = index, env
        self.master, slave = os.openpty()  # a terminal of 0x0 when size is (0, 0)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
        self.proc = subprocess.Popen(["bash", str(REPO / "train.sh"), str(index)], env=env,
                                     stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                     cwd=env["RUN_DIR"], start_new_session=True)
        os.close(slave)
        self.raw = b""

    def read(self, timeout: float = 0.1) -> None:
        if select.select([self.master], [], [], timeout)[0]:
            try:
                self.raw += os.read(self.master, 1 << 16)
            except OSError:  # EIO: every writer is gone
                pass

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        os.close(self.master)


def _env(run_dir, job_id: str, **knobs) -> dict[str, str]:
    env = dict(os.environ, RUN_DIR=str(run_dir), JOB_ID=job_id, PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in knobs.items()})
    return env


@pytest.mark.timeout(150)
def test_a_terminal_shows_a_live_line_and_warning_level_shows_none(tmp_path):
    run_dir, job_id = tmp_path / "run", "t" + uuid.uuid4().hex[:12]
    run_dir.mkdir()
    nodes: list[PtyNode] = []
    try:
        # node 0's terminal says it has 0 rows and 0 columns, as `docker exec -t` and
        # `ssh -tt` give: it must draw anyway
        n0 = PtyNode(0, _env(run_dir, job_id, PORT=0, **JOB), size=(0, 0))
        nodes.append(n0)
        end = time.monotonic() + 60
        port = run_dir / "global.port"
        while not (port.exists() and port.read_text().strip()) and time.monotonic() < end:
            n0.read()
        n1 = PtyNode(1, _env(run_dir, job_id, PORT=port.read_text().strip(), LOG_LEVEL="WARNING", **JOB))
        nodes.append(n1)
        end = time.monotonic() + 120
        while time.monotonic() < end and (n0.proc.poll() is None or n1.proc.poll() is None):
            n0.read(0.05)
            n1.read(0.05)
        for n in nodes:
            n.read(0.2)
        assert n0.proc.wait(10) == 0 and n1.proc.wait(10) == 0, n0.text + n1.text
    finally:
        for n in nodes:
            n.close()
    out = n0.text
    # (a terminal that does not say its width gets lines of 119 columns: the end is cut)
    live = re.findall(r"node 0 +\d+%\|[^|]*\| \d+/8000 it, [\d.]+ it/s, ETA [\d:]+(?: s)?, leader w\d "
                      r"\(node [01]\) loss [-+.\deE]+, nodes 2/2, workers", out)
    assert live, out[-3000:]
    # every log record starts a line, whichever process wrote it (none lands in the live line)
    for m in STAMP.finditer(out):
        assert out[: m.start()].endswith(("\n", "\x1b[K")), repr(out[max(0, m.start() - 200): m.end()])
    # the live line is erased before the end-of-job report
    before, report = out.split("lsgd: node 0 finished in", 1)
    assert not visible(before.rsplit("\n", 1)[-1]).strip(), repr(before[-300:])
    assert "lsgd: plots: python -m lsgd plot" in report and "lsgd: rounds on this node:" in report
    # LOG_LEVEL=WARNING on a terminal: no live line, no progress, only the final lines
    quiet = n1.text
    assert "it/s" not in quiet and "progress" not in quiet and "waiting for" not in quiet, quiet
    assert "lsgd: node 1 finished in" in quiet
    assert not shm_segments(job_id)


@pytest.mark.timeout(150)
def test_a_log_gets_progress_lines_and_says_what_it_waits_for(cluster):
    n0 = cluster(0, PORT=0, PROGRESS_EVERY=0.5, **JOB)
    end = time.monotonic() + 60
    while "waiting for node 1 of 2 to join" not in n0.output and time.monotonic() < end:
        time.sleep(0.1)  # node 1 starts only once node 0 says that it waits for it
    wait = re.search(r"waiting for node 1 of 2 to join: \d+ s of JOIN_TIMEOUT 60 s", n0.output)
    assert wait, n0.output
    n1 = cluster(1, PORT=cluster.port_of_node0(), PROGRESS_EVERY=0.5, **JOB)
    assert n1.wait(90) == 0, n1.output
    assert n0.wait(30) == 0, n0.output
    for node in (n0, n1):
        lines = re.findall(rf"node {node.index} INFO progress: \d+/8000 it \(\d+%\), [\d.?]+ it/s, "
                           r"ETA [^,]+, [^,]+, nodes 2/2, workers 2/2 training, round \d+",
                           node.output)
        assert len(lines) >= 2, node.output
        assert "\r" not in node.output and "\x1b" not in node.output  # a log: plain lines
    assert re.search(r"leader w\d \(node [01]\) loss", n0.output), n0.output
    s = n0.summary()
    assert s["rounds"]["global"] >= 1 and s["rounds"]["final"] == 1 and "leader_changes" in s
    assert s["files"]["metrics"].endswith("node0/metrics.csv")
    assert f"lsgd: metrics: {s['files']['metrics']}" in n0.output
    assert_clean_exit(cluster.run_dir, [n0, n1])
