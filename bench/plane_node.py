"""One node of ``bench.plane``: receive a vector (unless it is the source), forward it chunk by
chunk to the nodes it sends to, print when it holds the whole vector and has sent it on.

    python -m bench.plane_node '<json spec>'    # run by bench/plane.py inside a namespace
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import numpy as np

from lsgd.plane.route import Reception
from lsgd.plane.wire import Header, as_bytes, receive_vector, send_vector


def main(spec: dict) -> None:
    count, chunk, secret = spec["count"], spec["chunk"], spec["secret"].encode()
    deadline = spec["timeout"]
    buf = np.zeros(count, np.float32)
    rx = Reception(count)
    held = threading.Condition()
    listener = None
    if spec["listen"] is not None:
        listener = socket.create_server((spec["listen"], spec["port"]), backlog=4)
    else:  # the source: the whole vector is there from the start
        buf[:] = np.arange(count, dtype=np.float32) % 1000.0
        rx.open(0)
        rx.accept(0, 0, count)
    time.sleep(max(0.0, spec["start_at"] - time.time()))

    def ready(end: int) -> int:
        with held:
            held.wait_for(lambda: rx.offset >= end or rx.complete, timeout=deadline)
            return rx.offset

    def arrived(at: int, n: int) -> None:
        with held:
            held.notify_all()

    errors: list[BaseException] = []

    def forward(node: int, ip: str) -> None:
        try:
            for attempt in range(50):  # the receiver may not listen yet
                try:
                    sock = socket.create_connection((ip, spec["port"]), timeout=5)
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"cannot connect to node {node} at {ip}")
            with sock:
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
            receive_vector(conn, as_bytes(buf), rx, secret, deadline,
                           admit=lambda h: None if h.sender == spec["from"] else "not my sender",
                           on_chunk=arrived)
        listener.close()
    got = time.time()
    for t in senders:
        t.join(deadline)
    if errors:
        raise errors[0]
    if not np.array_equal(buf[:1000], np.arange(1000, dtype=np.float32)):
        raise RuntimeError("the vector arrived changed")
    print(json.dumps({"node": spec["node"], "received": got, "done": time.time()}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
