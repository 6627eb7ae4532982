"""Shared fixtures: running nodes the way a user does, and checking they leave nothing behind."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def shm_segments(job_id: str = "") -> set[str]:
    """Names of lsgd segments in /dev/shm (of one job when ``job_id`` is given)."""
    pattern = f"lsgd-{job_id}-*" if job_id else "lsgd-*"
    return {p.name for p in Path("/dev/shm").glob(pattern)} if Path("/dev/shm").exists() else set()


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not reaped) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (each node runs in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids


def global_summary(run_dir) -> dict:
    return json.loads((run_dir / "global" / "summary.json").read_text())


def assert_clean_exit(run_dir, nodes) -> None:
    """No process of the job is alive and no segment of it is left in /dev/shm."""
    pids = [global_summary(run_dir)["pid"]] if (run_dir / "global" / "summary.json").exists() else []
    for node in nodes:
        s = node.summary()
        pids += s["pids"]
        assert s["shm"] and s["shm"] not in shm_segments(), f"segment {s['shm']} left in /dev/shm"
    end = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "a process of the job survived"
    for node in nodes:  # nothing else of the node's session either (resource tracker, ...)
        assert not node.wait_session_gone(5), "a process of the node's session survived"


def metric_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_for_rows(path, rows: int = 6, timeout: float = 60.0) -> None:
    """Wait (bounded) until the CSV at ``path`` has ``rows`` lines: the node is training."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(path.read_text().splitlines() if path.exists() else []) < rows:
        time.sleep(0.1)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Nodes start as a terminal starts them, whatever the runner's own SIGINT handling: a runner
# started in the background ignores SIGINT, and its children would inherit that. Set here, in
# this process, not in a preexec_fn: that makes Popen fork, and gRPC's fork handlers then
# crash the child before its exec (epoll_wait: Bad file descriptor, grpc/grpc#43055).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Node:
    """One `bash train.sh <i>` process with its environment."""

    def __init__(self, index: int, env: dict[str, str], run_dir: Path,
                 ignore_sigint: bool = False, netns: str | None = None,
                 placed: bool = False) -> None:
        self.index, self.run_dir, self.env = index, run_dir, env
        self.log = run_dir / f"node{index}.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._logf = self.log.open("w")
        prefix = ["ip", "netns", "exec", netns] if netns else []  # a host of its own
        index_arg = [] if placed else [str(index)]  # placed: a launcher's environment says
        self.proc = subprocess.Popen(prefix + ["bash", str(REPO / "train.sh"), *index_arg], env=env,
                                     stdout=self._logf, stderr=subprocess.STDOUT, cwd=run_dir,
                                     start_new_session=True,
                                     preexec_fn=_ignore_sigint if ignore_sigint else None)

    def wait(self, timeout: float) -> int:
        """The node's exit code; past ``timeout``, a failure that says what each of its
        processes was doing (and the node's output), not a bare ``TimeoutExpired``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.index} still running after {timeout:g} s\n"
                                 f"{self.describe()}\n--- its output:\n{self.output}") from None
        finally:
            self._logf.flush()

    def describe(self) -> str:
        """Each live process of the node: state, kernel wait of every thread, command line,
        and its Python stacks where py-spy is installed."""
        spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                          f"{os.environ.get('PATH', '')}")
        lines = []
        for pid in session_pids(self.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                waits = sorted({(t / "wchan").read_text() for t in Path(f"/proc/{pid}/task").iterdir()})
            except OSError:
                continue
            lines.append(f"pid {pid}: {cmd[:200]}; threads wait in {waits}")
            if spy:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=30)
                lines.append(dump.stdout + dump.stderr)
        return "\n".join(lines) or "(no process left)"

    def wait_session_gone(self, timeout: float) -> list[int]:
        """Wait until no process of this node's session is left; returns the survivors."""
        end = time.monotonic() + timeout
        while (left := session_pids(self.proc.pid)) and time.monotonic() < end:
            time.sleep(0.1)
        return left

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def output(self) -> str:
        self._logf.flush()
        return self.log.read_text()

    def summary(self) -> dict:
        path = Path(self.env["RUN_DIR"]) / f"node{self.index}" / "summary.json"
        return json.loads(path.read_text())


@pytest.fixture
def cluster(tmp_path, request):
    """Start nodes with `train.sh`; on teardown kill anything left and check for leftovers.

    Each test runs its own job id, so segments of other runs on the machine are not counted.
    """
    nodes: list[Node] = []
    job_id = "t" + uuid.uuid4().hex[:12]

    def start(index: int, _ignore_sigint: bool = False, _netns: str | None = None,
              _placed: bool = False, **knobs: object) -> Node:
        env = dict(os.environ)
        env.update({k: str(v) for k, v in knobs.items()})
        env.setdefault("RUN_DIR", str(tmp_path / "run"))
        env["JOB_ID"] = job_id
        env["PYTHON"] = sys.executable
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
        node = Node(index, env, tmp_path, ignore_sigint=_ignore_sigint, netns=_netns,
                    placed=_placed)
        nodes.append(node)
        return node

    def port_of_node0(timeout: float = 30.0) -> int:
        path = tmp_path / "run" / "global.port"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if path.exists() and path.read_text().strip():
                return int(path.read_text())
            if nodes and nodes[0].proc.poll() is not None:
                raise AssertionError(f"node 0 exited early:\n{nodes[0].output}")
            time.sleep(0.05)
        raise AssertionError("node 0 did not write its port")

    start.port_of_node0 = port_of_node0
    start.run_dir = tmp_path / "run"
    start.nodes = nodes
    start.job_id = job_id
    yield start
    for node in nodes:
        if node.proc.poll() is None or node.wait_session_gone(10):
            node.kill_group()
            node.proc.wait(10)
    end = time.monotonic() + 10  # orphaned workers of a killed node exit within ~1 s
    while shm_segments(job_id) and time.monotonic() < end:
        time.sleep(0.1)
    leaked = shm_segments(job_id)
    for name in leaked:  # clean up so one failure does not cascade, then fail
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
