"""One lsgd node as a Ray actor's body: a ``python -m lsgd train`` subprocess and its log lines.

Plain Python (``ray_launch`` wraps it with ``ray.remote``), and every method returns at once, so
the driver polls it for lines and the exit code without blocking the actor. The subprocess runs
in a session of its own; it gets SIGTERM if the actor's process dies (Linux ``PR_SET_PDEATHSIG``),
so a lost driver or a killed actor does not leave a node running.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from . import exitcodes

MAX_LINES = 10_000  # lines kept for the driver; older ones are dropped (and counted)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child, before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: ray_launch's stop() is the only way out


class NodeProcess:
    """The lsgd node ``index``, run by the actor of the same index."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=MAX_LINES)
        self.total = 0
        self.run_dir: Path | None = None
        self._reader: threading.Thread | None = None
        self._ended: float | None = None  # when the process was first seen exited
        self._lock = threading.Lock()

    def where(self) -> dict:
        """Where this actor runs: ``{"node", "ray_node_id", "ip"}`` (node 0's IP is the job's)."""
        import ray

        return {"node": self.index, "ray_node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Start the node; returns its pid (its session's id too)."""
        self.run_dir = Path(env["RUN_DIR"])
        if self.index == 0:  # a port file of an earlier job would point the others astray
            (self.run_dir / "global.port").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            argv, env=os.environ | env, cwd=cwd if os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._read, name=f"lsgd-node{self.index}-log",
                                        daemon=True)
        self._reader.start()
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))
                self.total += 1

    def poll(self, since: int) -> tuple[list[str], int | None, int | None]:
        """Lines after the first ``since``; the exit code once the node exited and its output
        was read to the end (None before); on node 0, the global server's port once known."""
        code = self.proc.poll() if self.proc else exitcodes.FAILED
        if code is not None and self._ended is None:
            self._ended = time.monotonic()
        if code is not None and self._reader is not None:  # a straggler may hold the pipe open
            self._reader.join(0.1)
        reading = self._reader is not None and self._reader.is_alive()  # before taking lines
        with self._lock:
            start = max(0, since - (self.total - len(self.lines)))
            lines = list(self.lines)[start:]
        if code is not None and reading and time.monotonic() < self._ended + 5:
            code = None
        port = None
        if self.index == 0 and self.run_dir is not None:
            text = _read_text(self.run_dir / "global.port").strip()
            port = int(text) if text.isdigit() else None
        return lines, None if code is None else _code(code), port

    def stop(self, grace: float) -> int:
        """SIGINT the node's session, SIGKILL it after ``grace`` s; returns its exit code."""
        if self.proc is None:
            return exitcodes.FAILED
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any straggler of its session
        except ProcessLookupError:
            pass
        return _code(self.proc.wait(10))

    def summary(self) -> dict | None:
        """The node's ``summary.json`` (None when it wrote none)."""
        if self.run_dir is None:
            return None
        text = _read_text(self.run_dir / f"node{self.index}" / "summary.json")
        return json.loads(text) if text else None


def _code(returncode: int) -> int:
    """A shell's view of an exit: killed by signal s is 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
