"""One member of a parameter-plane route in a process of its own, for tests/test_plane_node.py.

``member(index, count, delay, secret, conn)`` runs a real ``DataPlane`` on loopback. The test
process sends it the route, answers its bypass requests (with the global server's own
``Routes``), and gets back what the member ended with. ``delay`` slows this member's
reception by that many seconds per chunk, so that a test can kill it, or its sender, in the
middle of a transfer.
"""

from __future__ import annotations

import threading
import time

import numpy as np


def vector(count: int, index: int = 0) -> np.ndarray:
    """The vector the source sends (a reduce: member ``index``'s sum): every element distinct,
    so a shifted chunk shows."""
    return (np.arange(count, dtype=np.float32) * np.float32(0.5) + np.float32(1.0)) * np.float32(index + 1)


def member(index: int, count: int, delay: float, secret: str | None, conn) -> None:  # noqa: ANN001
    from lsgd.plane import node as plane_node

    if delay:  # this member takes each chunk slowly (a slow link, seen from its sender)
        original = plane_node.receive_vector

        def slow(*args, on_chunk=None, **kw):
            def paced(at: int, n: int) -> None:
                time.sleep(delay)
                if on_chunk is not None:
                    on_chunk(at, n)
            return original(*args, on_chunk=paced, **kw)

        plane_node.receive_vector = slow

    lock = threading.Lock()

    def bypass(round_id: int, epoch: int, stalled: int, why: str, reduce: bool):
        with lock:
            conn.send(("bypass", (index, round_id, epoch, stalled, why, reduce)))
            kind, value = conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    plane = plane_node.DataPlane(job_id="job", index=index, count=count, secret=secret,
                                 host="127.0.0.1", timeout=float(conn.recv()), bypass=bypass)
    with lock:
        conn.send(("address", plane.address))
    info = conn.recv()  # the route
    plane.begin(info, own=vector(count, index) if info.reduce else None)
    if info.reduce:
        got = plane.reduce()
        result = ("reduced", None if got is None else bytes(np.asarray(got).tobytes()))
    elif info.route.root == index:
        ok = plane.send(vector(count))
        result = ("sent", ok)
    else:
        got = plane.receive()
        result = ("received", None if got is None else bytes(np.asarray(got).tobytes()))
    plane._finish_previous()  # the senders of this round end (at the deadline at the latest)
    with lock:
        conn.send(("done", (result, dict(plane.stats))))
    conn.recv()  # the test says when to go
    plane.close()
