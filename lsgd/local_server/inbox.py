"""The local server's inbox: one pipe per worker process, read as one queue.

A ``multiprocessing.Queue`` shared by all workers has one write lock: a worker SIGKILLed while
its feeder thread holds it (a few microseconds per message) would block every other worker's
messages for good, and the node with them. Here each process writes to a pipe of its own,
synchronously and without a lock (``Connection.send``: a message of a few dozen bytes is one
atomic write), and the node waits on all of them at once. The pipe of a dead process is read to
its end and closed (``drain``), so nothing it sent can be taken for its successor's.
"""

from __future__ import annotations

import queue
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any


class Sender:
    """A worker process's end: ``put(msg)`` (the interface of the queue it replaces)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def put(self, msg: object) -> None:
        self._conn.send(msg)

    def close(self) -> None:
        self._conn.close()


class Inbox:
    """The node's end."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._by_pid: dict[int, Connection] = {}
        self._open: dict[int, Connection] = {}  # id(sender) -> read end, until bound to a pid
        self._ready: deque[Connection] = deque()

    def open(self) -> Sender:
        """A new pipe for a process about to start; ``bind`` it once started."""
        reader, writer = self._ctx.Pipe(duplex=False)
        sender = Sender(writer)
        self._open[id(sender)] = reader
        return sender

    def bind(self, sender: Sender, pid: int) -> None:
        """The process ``pid`` holds ``sender`` now: the node closes its own copy of it."""
        self._by_pid[pid] = self._open.pop(id(sender))
        sender.close()

    def get(self, timeout: float) -> object:
        """The next message from any process. Raises ``queue.Empty`` after ``timeout`` s."""
        while True:
            if not self._ready:
                ready = wait(list(self._by_pid.values()), timeout)
                if not ready:
                    raise queue.Empty
                self._ready.extend(ready)
                timeout = 0.0
            conn = self._ready.popleft()
            if conn.closed:
                continue
            try:
                return conn.recv()
            except (EOFError, OSError):  # the process is gone and so is its end: read it no more
                self._forget(conn)

    def empty(self) -> bool:
        return not self._ready and not wait(list(self._by_pid.values()), 0)

    def drain(self, pid: int) -> list[object]:
        """What the dead process ``pid`` sent and the node has not read; its pipe is closed."""
        conn = self._by_pid.get(pid)
        out: list[object] = []
        if conn is None:
            return out
        try:
            while conn.poll(0):
                out.append(conn.recv())
        except (EOFError, OSError):
            pass
        self._forget(conn)
        return out

    def _forget(self, conn: Connection) -> None:
        self._by_pid = {p: c for p, c in self._by_pid.items() if c is not conn}
        if conn in self._ready:
            self._ready.remove(conn)
        conn.close()

    def cancel_join_thread(self) -> None:
        """Nothing to do (a queue's method, kept for the node's shutdown)."""

    def close(self) -> None:
        for conn in list(self._by_pid.values()) + list(self._open.values()):
            conn.close()
        self._by_pid, self._open = {}, {}
        self._ready.clear()
