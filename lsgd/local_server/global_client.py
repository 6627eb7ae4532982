"""The local server's gRPC client to the global server.

Translates between protobuf and plain values, sets a deadline on every call, retries the first
connection with backoff for ``connect_timeout`` seconds, and streams parameter vectors between
node shared memory and the server in raw float32 chunks (no full-size copies).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import grpc
import numpy as np

from ..leader import Candidate
from ..proto import lsgd_pb2 as pb
from ..proto import lsgd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # float32 elements per upload chunk (4 MiB)
RPC_TIMEOUT = 10.0  # seconds for short calls
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]
BUFFER_KINDS = {"global_leader": pb.BUFFER_KIND_GLOBAL_LEADER, "center": pb.BUFFER_KIND_CENTER,
                "sum": pb.BUFFER_KIND_NODE_SUM, "average": pb.BUFFER_KIND_AVERAGE}


class GlobalUnreachable(RuntimeError):
    """The global server could not be reached within the allowed time."""


@dataclass(frozen=True)
class CreditAnswer:
    grant: int
    round_id: int
    round_kind: int
    round_iteration: int
    counter: int


@dataclass(frozen=True)
class RoundAnswer:
    missed: bool
    leader: Candidate | None
    leader_node: int | None
    participants: int
    nodes: tuple[int, ...]


class GlobalClient:
    """One node's connection to the global server."""

    def __init__(self, address: str, job_id: str, node_index: int, round_timeout: float) -> None:
        self.address = address
        self.job_id, self.node_index = job_id, node_index
        self.round_timeout = round_timeout
        self.session = 0
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GlobalServerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _node(self) -> pb.NodeId:
        return pb.NodeId(job_id=self.job_id, node_index=self.node_index, session=self.session)

    # ------------------------------------------------------------------ control
    def join(self, *, workers: int, param_count: int, algorithm: str, num_groups: int,
             connect_timeout: float) -> pb.JoinResponse:
        """Join the job, retrying with backoff while the server is not up yet."""
        req = pb.JoinRequest(node=self._node(), num_workers=workers, param_count=param_count,
                             algorithm=algorithm, num_groups=num_groups)
        end = time.monotonic() + connect_timeout
        delay = 0.1
        while True:
            try:
                resp = self._stub.Join(req, timeout=min(RPC_TIMEOUT, max(1.0, end - time.monotonic())))
                self.session = resp.session
                return resp
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() + delay > end:
                    raise GlobalUnreachable(
                        f"global server at {self.address} unreachable for {connect_timeout:g} s "
                        f"(is node 0 running? check IP_ADDR and PORT)") from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def heartbeat(self) -> int:
        return self._stub.Heartbeat(pb.HeartbeatRequest(node=self._node()), timeout=RPC_TIMEOUT).counter

    def acquire(self, *, consumed: int, late: int, released: int, want: int,
                last_round_seen: int, max_wait: float) -> CreditAnswer:
        resp = self._stub.AcquireCredits(
            pb.AcquireCreditsRequest(node=self._node(), consumed=consumed, late_consumed=late,
                                     released=released, want=want, last_round_seen=last_round_seen,
                                     max_wait_ms=int(max_wait * 1000)),
            timeout=RPC_TIMEOUT)
        return CreditAnswer(resp.grant, resp.round.id, resp.round.kind, resp.round.iteration,
                            resp.counter)

    def report_round(self, round_id: int, best: Candidate | None, participants: int) -> RoundAnswer:
        req = pb.ReportRoundRequest(node=self._node(), round_id=round_id, participants=participants)
        if best is not None:
            req.has_best = True
            req.best.worker_id = best.worker_id
            req.best.loss = best.loss
        resp = self._stub.ReportRound(req, timeout=self.round_timeout + RPC_TIMEOUT)
        leader = Candidate(resp.leader.worker_id, resp.leader.loss) if resp.has_leader else None
        return RoundAnswer(resp.missed, leader, resp.leader_node if resp.has_leader else None,
                           resp.participants, tuple(resp.nodes))

    def leave(self, consumed: int, late: int) -> int:
        return self._stub.Leave(pb.LeaveRequest(node=self._node(), consumed=consumed,
                                                late_consumed=late), timeout=RPC_TIMEOUT).counter

    # ------------------------------------------------------------------ parameters
    def push(self, buffer: str, vec: np.ndarray, round_id: int, summands: int = 0) -> None:
        """Upload ``vec`` (a flat float32 view) as the node's ``buffer`` for ``round_id``."""
        header = pb.PushHeader(node=self._node(), round_id=round_id, buffer=BUFFER_KINDS[buffer],
                               param_count=vec.size, summands=summands)

        def requests() -> Iterator[pb.PushParamsRequest]:
            yield pb.PushParamsRequest(header=header)
            for lo in range(0, vec.size, CHUNK):
                yield pb.PushParamsRequest(chunk=pb.ParamChunk(offset=lo, data=vec[lo : lo + CHUNK].tobytes()))

        self._stub.PushParams(requests(), timeout=self.round_timeout + RPC_TIMEOUT)

    def pull(self, buffer: str, out: np.ndarray, round_id: int) -> None:
        """Download the server's ``buffer`` for ``round_id`` into ``out`` (a flat float32 view)."""
        stream = self._stub.PullParams(
            pb.PullParamsRequest(node=self._node(), round_id=round_id, buffer=BUFFER_KINDS[buffer]),
            timeout=self.round_timeout + RPC_TIMEOUT)
        pos = 0
        for chunk in stream:
            src = np.frombuffer(chunk.data, dtype="<f4")
            if chunk.offset != pos or pos + src.size > out.size:
                raise ValueError(f"bad chunk at {chunk.offset} ({src.size} elements) for a "
                                 f"vector of {out.size}")
            out[pos : pos + src.size] = src
            pos += src.size
        if pos != out.size:
            raise ValueError(f"download of {buffer} ended at {pos} of {out.size} elements")


class Heartbeat:
    """Background thread that keeps the node alive on the global server between calls.

    ``fatal`` becomes a message when the server says this node is no longer a member, or has
    been unreachable for ``give_up`` seconds; the node loop checks it and stops.
    """

    def __init__(self, client: GlobalClient, interval: float, give_up: float) -> None:
        import threading

        self.client, self.interval, self.give_up = client, interval, give_up
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lsgd-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RPC_TIMEOUT + 1)

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.client.heartbeat()
                last_ok = time.monotonic()
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    self.fatal = f"global server refused this node: {exc.details()}"
                    return
                if time.monotonic() - last_ok > self.give_up:
                    self.fatal = (f"global server at {self.client.address} unreachable for "
                                  f"{self.give_up:g} s ({exc.code().name})")
                    return
