"""One node of ``bench.plane``, run inside its network namespace. Modes:

- ``raw``: receive a vector (unless it is the source) and forward it chunk by chunk to the
  nodes it sends to, over lsgd's data connection (``lsgd/plane/wire.py``). One transfer, and
  the star broadcast (node 0 sends to all at once, as the global server's link does today).
- ``tcp``: a plain TCP socket from node 0 to node 1, the bulk-transfer baseline.
- ``gather``: the star reduce: every node sends its vector to node 0 at once, which takes
  them all in (as the global server takes every node's sum today).
- ``chain`` / ``reduce``: lsgd's own parameter plane (``lsgd/plane/node.py``, what a node runs
  with PLANE=chain): a broadcast down a chain from node 0, or the sums added up along a chain
  to node 0.

Prints, as its last line, JSON with the wall-clock time at which it was done.

    python -m bench.plane_node '<json spec>'    # run by bench/plane.py
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import numpy as np

from lsgd.plane.node import DataPlane, RouteInfo, chunk_for
from lsgd.plane.route import Kind, Reception, plan
from lsgd.plane.wire import Header, as_bytes, receive_vector, send_vector


def vector(count: int, node: int) -> np.ndarray:
    return (np.arange(count, dtype=np.float32) % 1000.0) * np.float32(node + 1)


def connect(ip: str, port: int) -> socket.socket:
    for _ in range(100):  # the receiver may not listen yet
        try:
            return socket.create_connection((ip, port), timeout=5)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"cannot connect to {ip}:{port}")


def raw(spec: dict, buf: np.ndarray) -> None:
    count, chunk, secret = spec["count"], spec["chunk"], spec["secret"].encode()
    deadline = spec["timeout"]
    rx, held = Reception(count), threading.Condition()
    listener = None
    if spec["listen"] is not None:
        listener = socket.create_server((spec["listen"], spec["port"]), backlog=4)
    else:  # the source: the whole vector is there from the start
        rx.open(0)
        rx.accept(0, 0, count)
    time.sleep(max(0.0, spec["start_at"] - time.time()))

    def ready(end: int) -> int:
        with held:
            held.wait_for(lambda: rx.offset >= end or rx.complete, timeout=deadline)
            return rx.offset

    errors: list[BaseException] = []

    def forward(node: int, ip: str) -> None:
        try:
            with connect(ip, spec["port"]) as sock:
                h = Header("bench", 1, 0, 0, 0, spec["node"], node, count, chunk)
                send_vector(sock, h, as_bytes(buf), secret, deadline, chunk_ready=ready)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    senders = [threading.Thread(target=forward, args=(n, ip)) for n, ip in spec["sendto"]]
    for t in senders:
        t.start()
    if listener is not None:
        conn, _ = listener.accept()
        with conn:
            receive_vector(conn, as_bytes(buf), rx, secret, deadline, lock=held,
                           admit=lambda h: None if h.sender == spec["from"] else "not my sender",
                           on_chunk=lambda at, n: held.notify_all())
        listener.close()
    for t in senders:
        t.join(deadline)
    if errors:
        raise errors[0]


def tcp(spec: dict, buf: np.ndarray) -> None:
    """A plain TCP socket, node 0 -> node 1: ``sendall`` / ``recv_into``, a 1-byte ack."""
    data = as_bytes(buf)
    if spec["node"] == 1:
        with socket.create_server((spec["ips"][1], spec["port"])) as listener:
            conn, _ = listener.accept()
            with conn:
                view, got = memoryview(bytearray(len(data))), 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise RuntimeError("the sender closed early")
                    got += n
                conn.sendall(b"k")
        return
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    with connect(spec["ips"][1], spec["port"]) as sock:
        sock.settimeout(spec["timeout"])
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise RuntimeError("no ack")


def gather(spec: dict, buf: np.ndarray) -> None:
    count, chunk, secret = spec["count"], spec["chunk"], spec["secret"].encode()
    ips, me = spec["ips"], spec["node"]
    if me != 0:
        time.sleep(max(0.0, spec["start_at"] - time.time()))
        with connect(ips[0], spec["port"]) as sock:
            send_vector(sock, Header("bench", 1, 0, 1, 0, me, 0, count, chunk), as_bytes(buf),
                        secret, spec["timeout"])
        return
    listener = socket.create_server((ips[0], spec["port"]), backlog=len(ips))
    sums = {n: np.zeros(count, np.float32) for n in range(1, len(ips))}
    time.sleep(max(0.0, spec["start_at"] - time.time()))

    def take(conn: socket.socket) -> None:
        with conn:
            rx = Reception(count)
            target = {}

            def admit(h: Header):
                target["n"] = h.sender
                return as_bytes(sums[h.sender]), rx
            receive_vector(conn, None, None, secret, spec["timeout"], admit=admit)

    threads = []
    for _ in range(len(ips) - 1):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=take, args=(conn,)))
        threads[-1].start()
    for t in threads:
        t.join(spec["timeout"])
    total = buf + sum(sums.values())  # what the server adds (cheap beside the links)
    if not np.isfinite(total[:10]).all():
        raise RuntimeError("bad sum")


def plane(spec: dict, buf: np.ndarray) -> np.ndarray | None:
    me, ips, port = spec["node"], spec["ips"], spec["port"]
    reduce = spec["mode"] == "reduce"
    members = list(range(len(ips)))
    route = plan(Kind.REDUCE if reduce else Kind.BROADCAST, members, 0,
                 1 if reduce else spec.get("fanout", 1))
    info = RouteInfo(1, route, {n: f"{ips[n]}:{port}" for n in members}, 0,
                     chunk_for(spec["count"], route.depth()),  # what a job's route would use
                     total_summands=len(ips), total_weight=float(len(ips)))

    def refuse(*args):
        raise RuntimeError(f"no bypass in the benchmark: {args}")

    dp = DataPlane(job_id="bench", index=me, count=spec["count"], secret=spec["secret"],
                   host=ips[me], timeout=spec["timeout"], bypass=refuse, port=port)
    try:
        time.sleep(max(0.0, spec["start_at"] - time.time()))
        dp.begin(info, own=buf if reduce else None)  # a reduce's far end sends at once
        if reduce:
            out = dp.reduce()
        elif me == 0:
            out = buf if dp.send(buf) else None
        else:
            out = dp.receive()
            if out is not None and not dp._join(dp.current):  # its own sends on, too
                out = None
        if out is None:
            raise RuntimeError(f"node {me}: the transfer failed ({dp.stats})")
        return np.array(out[:1000])
    finally:
        dp.close()


def main(spec: dict) -> None:
    buf = vector(spec["count"], spec["node"])
    mode = spec["mode"]
    got = None
    if mode == "raw":
        raw(spec, buf)
    elif mode == "tcp":
        tcp(spec, buf)
    elif mode == "gather":
        gather(spec, buf)
    else:
        got = plane(spec, buf)
    done = time.time()
    if mode in ("raw", "chain") and not np.array_equal((got if got is not None else buf)[:1000],
                                                         vector(1000, 0)):
        raise RuntimeError("the vector arrived changed")
    if mode == "reduce" and spec["node"] == 0:
        want = sum(vector(1000, n) for n in range(len(spec["ips"])))
        if not np.allclose(got, want):
            raise RuntimeError("the total is wrong")
    print(json.dumps({"node": spec["node"], "done": done}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
