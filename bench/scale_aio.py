"""Simulated nodes on asyncio for ``bench.scale`` (``--nodes-on asyncio``).

``bench.scale``'s own simulated nodes are threads, each driving a real ``GlobalClient`` (a
synchronous gRPC channel, a node thread, a heartbeat thread). At 512 nodes on 2 cores those two
client processes take most of the host (docs/benchmarks.md, "Step 3"), and every reply waits for
its thread's turn at the GIL: the harness, not the server, sets the round latency. Here each
client process runs its nodes as tasks of one event loop on ``grpc.aio`` channels (one per node
and port, as real nodes have), and speaks the node's side of the protocol as ``bench.scale``'s
``_node`` does, message for message: Join; credit and round calls as messages of one session
stream (on the server's session port when it has one, a plain socket; else the gRPC ``Session``
method on ``PORT``); heartbeats by the same skipping rule; the
leader's upload and downloads of a global round; the final round's uploads; Leave. The records
it writes are the same, so ``bench.scale`` measures both kinds of node the same way.

It has no job secret (nor has ``bench.scale``'s job): the messages carry no MAC.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

JOB_ID = "scale"
WANT = 1 << 30
RPC_TIMEOUT = 10.0


class _Refused(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(f"{code}: {details}")


async def _node(index: int, address: str, sc: Any, out: dict[str, Any], stop: asyncio.Event) -> None:
    import grpc
    import numpy as np

    from lsgd.local_server.global_client import CHANNEL_OPTIONS
    from lsgd.local_server.heartbeat import REPORT_EVERY
    from lsgd.wire import SMALL_VECTOR
    from lsgd.proto import lsgd_pb2 as pb
    from lsgd.proto import lsgd_pb2_grpc as pb_grpc
    from lsgd.rules.base import RoundKind

    rng = random.Random(index)
    rounds: list[dict[str, Any]] = []
    out.update(node=index, rounds=rounds, errors=[], acquires=0, grants=0, first_grant=None,
               heartbeat_fatal=None, left=False)
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)]
    stub = pb_grpc.GlobalServerStub(channels[0])
    node = pb.NodeId(job_id=JOB_ID, node_index=index)
    vec = np.full(sc.param_count, float(index), dtype=np.float32).tobytes()
    state = {"answered": -math.inf, "seq": 0, "n": 0}
    beat_task = None
    stream = None

    async def session_call(field: str, req: Any, timeout: float) -> Any:
        state["n"] += 1
        reply = await stream.call(pb.SessionRequest(n=state["n"], **{field: req.SerializeToString()}),
                                  timeout)
        if reply is grpc.aio.EOF or reply is None:
            raise _Refused(14, "the server closed the session stream")
        if reply.code:
            raise _Refused(reply.code, reply.details)
        state["answered"] = time.monotonic()
        return getattr(reply, field)

    async def beat() -> None:
        interval, beaten = min(1.0, sc.node_timeout / 5), -math.inf
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - state["answered"] < interval and now - beaten < REPORT_EVERY * interval:
                continue
            beaten = now
            try:
                await stub.Heartbeat(pb.HeartbeatRequest(node=node), timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - a failed heartbeat is a reported error
                why = exc.details() if hasattr(exc, "details") else str(exc)
                out["heartbeat_fatal"] = f"{type(exc).__name__}: {why}"

    async def push(buffer: int, rid: int, summands: int = 0) -> None:
        header = pb.PushHeader(node=node, round_id=rid, buffer=buffer, param_count=sc.param_count,
                               summands=summands)
        if len(vec) < SMALL_VECTOR:  # a round's leader or sum, whole on the stream (as the node)
            await session_call("push", pb.SessionUpload(header=header, data=vec),
                               sc.round_timeout + RPC_TIMEOUT)
            return

        async def requests():  # noqa: ANN202
            yield pb.PushParamsRequest(header=header)
            yield pb.PushParamsRequest(chunk=pb.ParamChunk(offset=0, data=vec))

        await stub.PushParams(requests(), timeout=sc.round_timeout + RPC_TIMEOUT)

    async def pull(buffer: int, rid: int) -> None:
        if 4 * sc.param_count < SMALL_VECTOR:  # whole, on the session stream (as the node)
            chunk = await session_call("pull", pb.PullParamsRequest(
                node=node, round_id=rid, buffer=buffer), sc.round_timeout + RPC_TIMEOUT)
            if len(chunk.data) != 4 * sc.param_count:
                raise RuntimeError(f"download of buffer {buffer}: {len(chunk.data)} bytes")
            return
        got = 0
        async for chunk in stub.PullParams(pb.PullParamsRequest(
                node=node, round_id=rid, buffer=buffer, chunk_elements=1 << 17),
                timeout=sc.round_timeout + RPC_TIMEOUT):
            got += len(chunk.data)
        if got != 4 * sc.param_count:
            raise RuntimeError(f"download of buffer {buffer} ended at {got} bytes")

    try:
        if sc.late_join_s and index == sc.nodes - 1:
            await asyncio.sleep(sc.late_join_s)
        end = time.monotonic() + 20.0
        while True:
            try:
                resp = await stub.Join(pb.JoinRequest(
                    node=node, num_workers=sc.workers, param_count=sc.param_count,
                    algorithm="lsgd", num_groups=sc.nodes), timeout=RPC_TIMEOUT)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                    raise
                await asyncio.sleep(0.2)
        node.session = resp.session
        out["joined"] = time.monotonic()
        opening = pb.SessionRequest(n=0, node=node, nonce=os.urandom(16))
        if resp.session_port:  # the session port: a plain socket (lsgd/plane/session_wire.py)
            stream = await _SocketStream.open(address.rsplit(":", 1)[0], resp.session_port,
                                              opening)
        else:  # the gRPC server's Session method on PORT
            stream = _GrpcStream(pb_grpc.GlobalServerStub(channels[0]).Session())
            await stream.grpc.write(opening)
        beat_task = asyncio.create_task(beat())
        held, last_round_seen, took = 0, 0, time.monotonic()
        while not stop.is_set():
            state["seq"] += 1
            used = time.monotonic() - took
            ans = await session_call("acquire", pb.AcquireCreditsRequest(
                node=node, consumed=held, want=WANT, last_round_seen=last_round_seen,
                max_wait_ms=500, seq=state["seq"],
                used_ms=int(used * 1000) if held else 0), RPC_TIMEOUT)
            out["acquires"] += 1
            held = 0
            if ans.round.id > last_round_seen:
                t_learn = time.monotonic()
                rid, kind = ans.round.id, RoundKind(ans.round.kind)
                last_round_seen = rid
                role, missed, participants = "", False, sc.workers
                if kind != RoundKind.LOCAL:  # a local round is the node's own: no call
                    req = pb.ReportRoundRequest(node=node, round_id=rid, participants=sc.workers,
                                                has_best=True)
                    req.best.worker_id = index * sc.workers + rng.randrange(sc.workers)
                    req.best.loss = rng.random()
                    small = 4 * sc.param_count < SMALL_VECTOR
                    if kind == RoundKind.GLOBAL and small:
                        req.then_pull = pb.BUFFER_KIND_GLOBAL_LEADER  # as the node: the answer
                        req.then_pull_wire = pb.WIRE_FORMAT_UNSPECIFIED  # carries the leader
                    if kind == RoundKind.FINAL and small:  # and the report the node's sum
                        req.then_push.header.CopyFrom(pb.PushHeader(
                            node=node, round_id=rid, buffer=pb.BUFFER_KIND_NODE_SUM,
                            param_count=sc.param_count, summands=sc.workers))
                        req.then_push.data = vec
                    r = await session_call("report", req, 2 * sc.round_timeout + RPC_TIMEOUT)
                    missed, participants = r.missed, r.participants
                t_report = time.monotonic()
                if kind != RoundKind.LOCAL and not missed:
                    if kind == RoundKind.GLOBAL and r.has_leader and r.node_count > 1:
                        if r.leader_node == index:
                            await push(pb.BUFFER_KIND_GLOBAL_LEADER, rid)
                            role = "leader"
                        elif r.HasField("download") or r.download_code:
                            if r.download_code:
                                raise _Refused(r.download_code, r.download_details)
                            if len(r.download.data) != 4 * sc.param_count:
                                raise RuntimeError(f"the leader came with {len(r.download.data)} "
                                                   "bytes")
                            role = "pull"
                        else:
                            await pull(pb.BUFFER_KIND_GLOBAL_LEADER, rid)
                            role = "pull"
                    if kind == RoundKind.FINAL:
                        if r.has_leader and r.leader_node == index:
                            await push(pb.BUFFER_KIND_GLOBAL_LEADER, rid)
                            role = "leader"
                        if r.push_code:
                            raise _Refused(r.push_code, r.push_details)
                        if not r.pushed:
                            await push(pb.BUFFER_KIND_NODE_SUM, rid, summands=sc.workers)
                        if index == 0 and r.has_leader:
                            await pull(pb.BUFFER_KIND_GLOBAL_LEADER, rid)
                            await pull(pb.BUFFER_KIND_AVERAGE, rid)
                t_done = time.monotonic()
                rounds.append({"id": rid, "kind": kind.name.lower(), "learn": t_learn,
                               "report_s": t_report - t_learn, "latency_s": t_done - t_learn,
                               "missed": missed, "role": role, "participants": participants})
                if kind == RoundKind.FINAL:
                    break
            took = time.monotonic()
            if ans.grant:
                out["grants"] += 1
                if out["first_grant"] is None:
                    out["first_grant"] = time.monotonic()
                held = ans.grant
                if sc.step_ms:
                    await asyncio.sleep(math.ceil(held / sc.workers) * sc.step_ms / 1000.0)
        beat_task.cancel()
        if isinstance(stream, _SocketStream):  # as the node: on the session port's stream
            await session_call("leave", pb.LeaveRequest(node=node, consumed=held), RPC_TIMEOUT)
        else:
            await stub.Leave(pb.LeaveRequest(node=node, consumed=held), timeout=RPC_TIMEOUT)
        out["left"] = True
    except grpc.aio.AioRpcError as exc:
        out["errors"].append(f"node {index}: {exc.code().name}: {exc.details()}")
    except Exception as exc:  # noqa: BLE001 - every failure is a reported error
        out["errors"].append(f"node {index}: {type(exc).__name__}: {exc}")
    finally:
        out["end"] = time.monotonic()
        if beat_task is not None:
            beat_task.cancel()
        if stream is not None:
            stream.cancel()
        for ch in channels:
            await ch.close()


class _SocketStream(asyncio.Protocol):
    """A node's session stream on the session port (an asyncio ``Protocol``: a reply resolves
    the waiting call's future, its deadline a timer, so a call costs no task of its own), with
    ``call`` (the reply, or None at the stream's end) and ``cancel`` (no job secret here: the
    opening's MAC is zeros)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None
        self.waiting: asyncio.Future | None = None
        self.hello: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ended = False

    @classmethod
    async def open(cls, host: str, port: int, opening: Any) -> "_SocketStream":
        from lsgd.plane import session_wire as sw

        loop = asyncio.get_running_loop()
        _, self = await loop.create_connection(cls, host, port)
        sw.read_hello(await asyncio.wait_for(self.hello, RPC_TIMEOUT))
        self.transport.write(sw.frame(bytes(sw.MAC_SIZE) + opening.SerializeToString()))
        return self

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        from lsgd.plane import session_wire as sw
        from lsgd.proto import lsgd_pb2 as pb

        self.buf += data
        if not self.hello.done():
            if len(self.buf) < sw.HELLO_SIZE:
                return
            self.hello.set_result(bytes(self.buf[:sw.HELLO_SIZE]))
            del self.buf[:sw.HELLO_SIZE]
        while len(self.buf) >= 4:
            size = int.from_bytes(self.buf[:4], "big")
            if len(self.buf) < 4 + size:
                return
            reply = pb.SessionReply.FromString(bytes(self.buf[4:4 + size]))
            del self.buf[:4 + size]
            if self.waiting is not None and not self.waiting.done():
                self.waiting.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("the session port closed"))
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)

    async def call(self, msg: Any, timeout: float) -> Any:
        from lsgd.plane import session_wire as sw

        if self.ended:
            return None
        loop = asyncio.get_running_loop()
        self.waiting = fut = loop.create_future()
        self.transport.write(sw.frame(msg.SerializeToString()))
        timer = loop.call_later(timeout, lambda: fut.done() or fut.set_exception(
            asyncio.TimeoutError()))
        try:
            return await fut
        finally:
            timer.cancel()

    def cancel(self) -> None:
        self.transport.close()


class _GrpcStream:
    """The gRPC server's ``Session`` stream on ``PORT``, with the socket stream's ``call``."""

    def __init__(self, grpc_stream: Any) -> None:
        self.grpc = grpc_stream

    async def call(self, msg: Any, timeout: float) -> Any:
        import grpc

        await self.grpc.write(msg)
        reply = await asyncio.wait_for(self.grpc.read(), timeout)
        return None if reply is grpc.aio.EOF else reply

    def cancel(self) -> None:
        self.grpc.cancel()


def client_main(spec: dict[str, Any], sc: Any) -> int:
    """A client process: every node of ``spec["nodes"]`` as a task of one event loop (asyncio's,
    or uvloop's for ``--nodes-on uvloop``)."""
    outs = [dict() for _ in spec["nodes"]]

    async def main() -> list[str]:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        tasks = [asyncio.create_task(_node(i, spec["address"], sc, o, stop))
                 for i, o in zip(spec["nodes"], outs)]
        done, pending = await asyncio.wait(tasks, timeout=sc.limit_s)
        stop.set()
        if pending:
            done2, pending = await asyncio.wait(pending, timeout=2.0)
        alive = []
        for i, (t, o) in enumerate(zip(tasks, outs)):
            if t in pending:
                t.cancel()
                alive.append(f"node{spec['nodes'][i]}")
                o.setdefault("errors", []).append(f"node{spec['nodes'][i]}: stopped before the "
                                                  "end of the job")
        return alive

    if sc.nodes_on == "uvloop":  # the same nodes on uvloop's event loop: less of the host
        import uvloop

        alive = uvloop.run(main())
    else:
        alive = asyncio.run(main())
    tmp = Path(spec["out"] + ".tmp")
    tmp.write_text(json.dumps({"nodes": outs, "alive": alive}, default=str))
    os.replace(tmp, spec["out"])
    return 0
