"""The floor of gRPC Python's server per control message: sync (thread pool) against asyncio.

``python -m bench.stream_floor [--streams 256] [--messages 200]`` starts a bare echo server
(raw bytes, no protobuf, no interceptors) in its own process, once with ``grpc.server`` and a
thread pool (lsgd's server today) and once with ``grpc.aio.server``, and drives it from two
client processes: ``--streams`` bidirectional streams in all, each sending ``--messages``
64-byte messages one at a time (as a node loop does), and as many unary calls. It prints the
server's CPU per message (user + sys from /proc) for each server kind and call kind, in the
same run, so that the ratio says whether an asyncio server would pay off (design-scale.md,
section 2). The server does nothing but echo: this is the transport's cost alone. A last row
echoes the same messages on a plain TCP socket under asyncio (a ``Protocol``, a 4-byte length
per message and an HMAC-SHA256 checked and made per message), the floor of a session protocol
without gRPC (design-scale.md, "Step 6").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

from bench.common import cpu_seconds

METHOD_STREAM = "/floor.Echo/Stream"
METHOD_UNARY = "/floor.Echo/Unary"
PAYLOAD = b"x" * 64


def _serve_sync(port_q: "mp.Queue", threads: int) -> None:
    from concurrent import futures

    import grpc

    def stream(requests, context):  # noqa: ANN001 - grpc API
        for r in requests:
            yield r

    def unary(request, context):  # noqa: ANN001 - grpc API
        return request

    handler = grpc.method_handlers_generic_handler("floor.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "Unary": grpc.unary_unary_rpc_method_handler(unary)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(port)
    server.wait_for_termination()


def _serve_aio(port_q: "mp.Queue", threads: int) -> None:
    import asyncio

    import grpc

    async def stream(requests, context):  # noqa: ANN001 - grpc API
        async for r in requests:
            yield r

    async def unary(request, context):  # noqa: ANN001 - grpc API
        return request

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler("floor.Echo", {
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Unary": grpc.unary_unary_rpc_method_handler(unary)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _serve_socket(port_q: "mp.Queue", threads: int) -> None:
    """The same echo on a plain TCP socket under asyncio (a ``Protocol``: no stream objects): a
    4-byte length, then the message, with an HMAC-SHA256 checked and made per message (as a
    signed session's would be)."""
    import asyncio
    import hashlib
    import hmac

    key = b"k" * 32

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:  # noqa: ANN001
            self.t, self.buf = transport, bytearray()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while len(self.buf) >= 4:
                n = int.from_bytes(self.buf[:4], "big")
                if len(self.buf) < 4 + n:
                    return
                body = bytes(self.buf[4 : 4 + n])
                del self.buf[: 4 + n]
                msg, mac = body[:-32], body[-32:]
                if not hmac.compare_digest(hmac.new(key, msg, hashlib.sha256).digest(), mac):
                    self.t.close()
                    return
                out = msg + hmac.new(key, msg, hashlib.sha256).digest()
                self.t.write(len(out).to_bytes(4, "big") + out)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0, backlog=1024)
        port_q.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _socket_caller(port: int, messages: int) -> None:
    import hashlib
    import hmac
    import socket

    key = b"k" * 32
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = s.makefile("rb")
    for _ in range(messages):
        out = PAYLOAD + hmac.new(key, PAYLOAD, hashlib.sha256).digest()
        s.sendall(len(out).to_bytes(4, "big") + out)
        n = int.from_bytes(f.read(4), "big")
        f.read(n)
    s.close()


def _client(port: int, streams: int, messages: int, kind: str, out: "mp.Queue") -> None:
    import queue

    import grpc

    def one() -> None:
        if kind == "socket":
            return _socket_caller(port, messages)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        if kind == "stream":
            q: queue.SimpleQueue = queue.SimpleQueue()
            q.put(PAYLOAD)
            call = channel.stream_stream(METHOD_STREAM)(iter(q.get, None))
            replies = iter(call)
            next(replies)
            for _ in range(messages - 1):
                q.put(PAYLOAD)
                next(replies)
            q.put(None)
            call.cancel()
        else:
            call = channel.unary_unary(METHOD_UNARY)
            for _ in range(messages):
                call(PAYLOAD, timeout=30)
        channel.close()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out.put(time.monotonic() - t0)


def measure(server: str, kind: str, streams: int, messages: int) -> dict:
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    target = {"sync": _serve_sync, "aio": _serve_aio, "socket": _serve_socket}[server]
    proc = ctx.Process(target=target, args=(port_q, streams + 16), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=30)
        time.sleep(0.3)
        out = ctx.Queue()
        half = streams // 2
        clients = [ctx.Process(target=_client, args=(port, n, messages, kind, out), daemon=True)
                   for n in (half, streams - half)]
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        for c in clients:
            c.start()
        walls = [out.get(timeout=300) for _ in clients]
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        for c in clients:
            c.join(10)
        total = streams * messages
        return {"server": server, "kind": kind, "streams": streams, "messages": total,
                "server_cpu_s": round(cpu1 - cpu0, 3),
                "server_cpu_us_per_message": round((cpu1 - cpu0) / total * 1e6, 1),
                "messages_per_s": round(total / max(walls), 0), "wall_s": round(t1 - t0, 2)}
    finally:
        proc.kill()
        proc.join(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stream_floor", description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--messages", type=int, default=200)
    a = p.parse_args(argv)
    rows = []
    for server in ("sync", "aio"):
        for kind in ("stream", "unary"):
            row = measure(server, kind, a.streams, a.messages)
            rows.append(row)
            print(json.dumps(row), flush=True)
    row = measure("socket", "socket", a.streams, a.messages)
    rows.append(row)
    print(json.dumps(row), flush=True)
    base = {r["kind"]: r["server_cpu_us_per_message"] for r in rows if r["server"] == "sync"}
    print(f"\nserver CPU per message, {a.streams} concurrent callers, load average "
          f"{os.getloadavg()[0]:.1f} at the end:")
    print("| server | stream message | unary call |")
    print("|---|---|---|")
    for server in ("sync", "aio"):
        r = {x["kind"]: x["server_cpu_us_per_message"] for x in rows if x["server"] == server}
        print(f"| {server} | {r['stream']} µs ({r['stream'] / base['stream']:.2f}x) | "
              f"{r['unary']} µs ({r['unary'] / base['unary']:.2f}x) |")
    r = rows[-1]["server_cpu_us_per_message"]
    print(f"| asyncio, plain TCP socket, HMAC per message | {r} µs "
          f"({r / base['stream']:.2f}x) | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
