"""The local server's gRPC client to the global server.

Translates between protobuf and plain values, sets a deadline on every call, retries the first
connection with backoff for ``connect_timeout`` seconds. Parameter vectors move between node
shared memory and the server through ``transfer_client.py``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from ..leader import Candidate
from ..proto import lsgd_pb2 as pb
from ..proto import lsgd_pb2_grpc as pb_grpc
from ..security import Security
from ..signing import derive_key
from ..wire import GRPC_OPTIONS
from .session_socket import SocketSession, probe
from .session_stream import CODES, CallError, SessionStream
from .transfer_client import BUFFER_KINDS, WIRE_FORMATS, ParamTransfers

log = logging.getLogger(__name__)

RPC_TIMEOUT = 10.0  # seconds for short calls
SESSION_UPLOADS = {"global_leader", "sum"}  # a round's own: the server takes them without a wait
PORT_PROBE = 3.0  # seconds a node gives the server's session port to connect, once per server
CHANNEL_OPTIONS = GRPC_OPTIONS + [("grpc.enable_retries", 0)]  # retries are ours, explicit


class GlobalUnreachable(RuntimeError):
    """The global server could not be reached within the allowed time."""


# The start of the reason the global server gives (in ``stopped`` fields, and refusing a Join)
# once node 0 has stopped the job.
JOB_STOPPED = "job stopped"  # every stop reason starts so (node 0's, or the server's own)


def stop_reason_of(exc: grpc.RpcError) -> str | None:
    """The job-stop reason when ``exc`` is the server refusing a call because the job was
    stopped; None for any other error."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(JOB_STOPPED):
        return details
    return None


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
    node_count: int  # how many nodes reported in time (this one included)
    evaluate: bool = False
    checkpoint: bool = False
    route: "pb.DataRoute | None" = None  # PLANE=chain: the leader's route (no members: none)


class GlobalClient:
    """One node's connection to the global server."""

    def __init__(self, address: str, job_id: str, node_index: int, round_timeout: float,
                 security: Security | None = None) -> None:
        self.address = address
        self._host = address.rsplit(":", 1)[0].strip("[]")
        self.job_id, self.node_index = job_id, node_index
        self.round_timeout = round_timeout
        self.session = 0
        self.epoch = 0  # the server process's; changes when it restarts
        self._seq = 0  # credit requests (and reattaching joins) numbered per session
        self._join_seq = 0  # the number of a reattach not answered yet
        self.stopped = ""  # non-empty once an answer said the job was stopped (the reason)
        self.on_stopped: Callable[[str], None] | None = None  # told once, from the answer's thread
        self.on_aborted: Callable[[int], None] | None = None  # a reduce the server aborted (round)
        self.data_address = ""  # PLANE=chain: this node's data listener, told at every join
        self.answered_at = -math.inf  # when a credit or round call was last answered (monotonic)
        security = security or Security()
        self._md = security.metadata  # none: the channel signs every call with the job secret
        self._channel = security.channel(address, CHANNEL_OPTIONS)
        self._stub = pb_grpc.GlobalServerStub(self._channel)
        # The loop's credit and round calls go on one Session stream per node session, each
        # message with a MAC under the job secret (session_stream.py).
        self._key = derive_key(security.secret) if security.secret else None
        self._stream: SessionStream | None = None
        self._stream_lock = threading.Lock()
        self._call_lock = threading.RLock()  # one call at a time on the stream
        # The server's session port (JoinResponse.session_port; 0: none, or it could not be
        # reached: the streams go to ``address``'s gRPC Session method then).
        self._session_port = 0
        self._unreachable = (0, 0)  # (server epoch, session port) that did not answer
        self.transfers = ParamTransfers(self._channel, self._md, security.secret, address,
                                        node_index, lambda: self.round_timeout + RPC_TIMEOUT)
        self._param_count = 0  # the model's, told at join
        # The download a round's answer carried (report_round's then_pull): (buffer, round,
        # wire, answer), taken by the next pull of that buffer and round; and the upload its
        # report carried (then_push): (round, answer), which the next push of the sum is.
        self._carried: tuple[str, int, str, pb.ReportRoundResponse] | None = None
        self._carried_push: tuple[int, pb.SessionUpload, pb.ReportRoundResponse] | None = None

    def close(self) -> None:
        self._end_stream()
        with self._stream_lock:
            self._use_session_port(0)
        self._channel.close()

    def _session_port_ready(self, epoch: int) -> bool:
        """Whether the session port answers within ``PORT_PROBE`` seconds (a firewall that
        drops its packets would otherwise cost the node's first call its whole deadline)."""
        why = probe(self._host, self._session_port, PORT_PROBE)
        if why is None:
            return True
        self._unreachable = (epoch, self._session_port)
        self._warn_unreachable(self._session_port, why)
        return False

    def _warn_unreachable(self, port: int, why: str) -> None:
        log.warning("node %d: the global server's session port %d did not answer (%s); the "
                    "node's credit and round calls go to %s instead (open SESSION_PORT too for "
                    "a job of hundreds of nodes)", self.node_index, port, why, self.address)

    def _use_session_port(self, port: int) -> None:
        """Open session streams on the server's ``port`` from now on (0: on ``address``)."""
        self._session_port = port

    def _end_stream(self) -> None:
        with self._stream_lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None

    def _note_stop(self, reason: str) -> None:
        if reason and not self.stopped:
            self.stopped = reason
            self.transfers.abort()  # a vector the job no longer needs: do not wait on its link
            if self.on_stopped is not None:
                self.on_stopped(reason)

    def _on_stream(self, field: str, request, timeout: float):  # noqa: ANN001, ANN201
        """Make a credit ("acquire"), round ("report"), digest ("digest") or small download
        ("pull") call on this session's stream, opening one first if there is none (or it
        broke, or the session changed). One call at a time; ``close`` from another thread ends
        a call in progress."""
        with self._call_lock:
            return self._stream_call(field, request, timeout)

    def _stream_call(self, field: str, request, timeout: float,  # noqa: ANN001, ANN201
                     again: bool = True):
        with self._stream_lock:
            s = self._stream
            if s is None or s.ended or s.node.session != self.session:
                if s is not None:
                    s.close()
                if self._session_port:
                    s = SocketSession(self._host, self._session_port, self._key, self._node())
                else:
                    s = SessionStream(self._stub, self._md, self._key, self._node())
                self._stream = s
        try:
            return s.call(field, request.SerializeToString(), timeout)
        except grpc.RpcError as exc:
            if (again and s.port and not s.replied and field != "push"
                    and exc.code() == grpc.StatusCode.CANCELLED):
                # The server ended the new stream before it took a call: its opening came
                # after newer connections from this host (many nodes joining at once from one
                # address) or late. Nothing was counted: once more on a new stream.
                return self._stream_call(field, request, timeout, again=False)
            if not (s.port and s.broken and not s.answered and exc.code() in (
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)):
                raise
            if not self._same_server_answers():  # the server is gone or new, not the port
                raise
            # never answered there, while PORT works: a firewall, most likely
            self._warn_unreachable(s.port, exc.details())
            with self._stream_lock:
                self._unreachable = (self.epoch, s.port)
                if self._session_port == s.port:
                    self._use_session_port(0)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or field == "push":
                raise  # it may have arrived (an upload is taken once): the node loop decides
            # it never reached the server: the same call on PORT (a retry of a numbered
            # credit request, a report or a digest question gets the same answer anyway)
            return self._stream_call(field, request, timeout)

    def _same_server_answers(self) -> bool:
        """Whether the server process this node joined answers on ``PORT`` (it connects within
        a second, and a heartbeat names the same epoch). When it does not, a failed session
        stream says nothing about the session port: the server is gone, or a restarted one
        (not yet listening there when the stream tried) waits for this node's reattach."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=1.0)
            beat = self._stub.Heartbeat(pb.HeartbeatRequest(node=self._node()), timeout=2.0,
                                        metadata=self._md)
        except (grpc.FutureTimeoutError, grpc.RpcError):
            return False
        return beat.epoch == self.epoch

    def _node(self) -> pb.NodeId:
        return pb.NodeId(job_id=self.job_id, node_index=self.node_index, session=self.session)

    # ------------------------------------------------------------------ control
    def join(self, *, workers: int, param_count: int, algorithm: str, num_groups: int,
             connect_timeout: float, resume: bool = False, held: int = 0,
             unreported: int = 0, unanswered: tuple[int, int] = (0, 0),
             replaces: int = 0) -> pb.JoinResponse:
        """Join the job, retrying with backoff while the server is not up yet.

        ``resume``: reattach with this client's session, holding ``held`` credits, with
        ``unreported`` steps not counted yet and ``unanswered`` = (seq, steps) of a credit
        request whose answer never came. Every attempt of one reattach carries the same number.
        ``replaces``: the session of this node's earlier run (restarted after a crash), which
        the server drops in favour of this one.
        """
        self._param_count = param_count
        if resume and not self._join_seq:  # every attempt of this reattach: one number
            self._seq += 1
            self._join_seq = self._seq
        req = pb.JoinRequest(node=self._node(), num_workers=workers, param_count=param_count,
                             algorithm=algorithm, num_groups=num_groups,
                             resume_session=self.session if resume else 0, held_credits=held,
                             unreported=unreported, seq=self._join_seq if resume else 0,
                             unanswered_seq=unanswered[0], unanswered_steps=unanswered[1],
                             replaces_session=replaces, data_address=self.data_address)
        end = time.monotonic() + connect_timeout
        delay = 0.1
        while True:
            try:
                resp = self._stub.Join(req, metadata=self._md,
                                       timeout=min(RPC_TIMEOUT, max(1.0, end - time.monotonic())))
                if resp.session != self.session:
                    self._seq = 0  # numbering starts again with a new session
                port = resp.session_port
                if (resp.epoch, port) == self._unreachable:
                    port = 0  # it did not answer: this server's own port, as before
                if port != self._session_port:
                    self._end_stream()
                    with self._stream_lock:
                        self._use_session_port(port)
                    if port and not self._session_port_ready(resp.epoch):
                        with self._stream_lock:
                            self._use_session_port(0)
                self.session, self.epoch, self._join_seq = resp.session, resp.epoch, 0
                self.transfers.use_bulk_port(resp.epoch, resp.bulk_port)
                self._end_stream()  # the next call opens a stream on this attachment
                return resp
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                late = time.monotonic() + delay > end
                if late and (exc.details() or "").startswith("waiting for node 0"):
                    raise GlobalUnreachable(  # the server answers: node 0 has not joined
                        f"node 0 did not join the job at {self.address} within "
                        f"{connect_timeout:g} s (CONNECT_TIMEOUT); start node 0, or check that "
                        "it did not fail") from None
                if late:
                    raise GlobalUnreachable(
                        f"global server at {self.address} unreachable for {connect_timeout:g} s "
                        f"(is node 0 running? check IP_ADDR and PORT, and that TLS_CA, TLS_CERT "
                        f"and MTLS match node 0's); last error: {exc.details()}") from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def heartbeat(self, report: pb.NodeReport | None = None) -> int:
        """Beat (with the node's ``report`` for the status page); returns the counter."""
        return self.beat(report).counter

    def beat(self, report: pb.NodeReport | None = None) -> pb.HeartbeatResponse:
        """Beat; returns the whole answer (who is there, who leads: the progress line)."""
        req = pb.HeartbeatRequest(node=self._node())
        if report is not None:
            req.report.CopyFrom(report)
        resp = self._stub.Heartbeat(req, timeout=RPC_TIMEOUT, metadata=self._md)
        self._note_stop(resp.stopped)
        if resp.aborted_reduce and self.on_aborted is not None:
            self.on_aborted(resp.aborted_reduce)
        return resp

    @property
    def last_seq(self) -> int:
        """The number of the newest credit request sent."""
        return self._seq

    def acquire(self, *, consumed: int, late: int, released: int, want: int,
                last_round_seen: int, max_wait: float, used: float = 0.0) -> CreditAnswer:
        """Report steps and ask for credits; ``used``: seconds the ``consumed`` steps took
        (0: not measured), which sizes this node's share of the next period."""
        self._seq += 1
        used_ms = min(int(used * 1000), (1 << 32) - 1) if consumed and used > 0 else 0
        resp = self._on_stream(
            "acquire",
            pb.AcquireCreditsRequest(node=self._node(), consumed=consumed, late_consumed=late,
                                     released=released, want=want, last_round_seen=last_round_seen,
                                     max_wait_ms=int(max_wait * 1000), seq=self._seq,
                                     used_ms=used_ms),
            RPC_TIMEOUT)
        self.answered_at = time.monotonic()
        self._note_stop(resp.stopped)
        return CreditAnswer(resp.grant, resp.round.id, resp.round.kind, resp.round.iteration,
                            resp.counter)

    def report_round(self, round_id: int, best: Candidate | None, participants: int,
                     weight: float = 0.0, then_pull: str | None = None,
                     wire: str = "float32",
                     then_push: tuple[np.ndarray, int, float] | None = None) -> RoundAnswer:
        """Report this node's part of a round and wait for the round's answer. ``then_pull``:
        the buffer this node downloads right after the answer unless it is the leader's node
        (only ``global_leader``); on the server's session port a small one comes with the
        answer, and the next ``pull`` of it this round takes it from there. ``then_push``:
        (vector, summands, weight) of the sum this node uploads right after the answer; on the
        session port a small one goes with the report, and the next ``push`` of the sum this
        round is that upload (done, or refused as it was)."""
        req = pb.ReportRoundRequest(node=self._node(), round_id=round_id, participants=participants,
                                    weight=weight)
        if best is not None:
            req.has_best = True
            req.best.worker_id = best.worker_id
            req.best.loss = best.loss
        timeout = self.round_timeout + RPC_TIMEOUT
        self._carried = self._carried_push = None
        carry = bool(self._session_port)  # PORT's Session would ignore them: send nothing
        if carry and then_pull is not None and self._param_count and self.transfers.small_count(
                self._param_count, wire):
            req.then_pull, req.then_pull_wire = BUFFER_KINDS[then_pull], WIRE_FORMATS[wire]
            timeout += self.round_timeout  # the barrier, then the download's own wait
        if carry and then_push is not None and self.transfers.small(then_push[0], wire):
            vec, summands, push_weight = then_push
            req.then_push.header.CopyFrom(pb.PushHeader(
                node=self._node(), round_id=round_id, buffer=BUFFER_KINDS["sum"],
                param_count=vec.size, summands=summands, wire_format=WIRE_FORMATS[wire],
                weight=push_weight))
            req.then_push.data = self.transfers.encode(vec, wire)
        resp = self._on_stream("report", req, timeout)
        if resp.HasField("download") or resp.download_code:
            self._carried = (then_pull, round_id, wire, resp)
        if resp.pushed or resp.push_code:
            self._carried_push = (round_id, req.then_push, resp)
        self.answered_at = time.monotonic()
        self._note_stop(resp.stopped)
        leader = Candidate(resp.leader.worker_id, resp.leader.loss) if resp.has_leader else None
        return RoundAnswer(resp.missed, leader, resp.leader_node if resp.has_leader else None,
                           resp.participants, resp.node_count, resp.evaluate, resp.checkpoint,
                           resp.route if resp.route.members else None)

    def bypass(self, round_id: int, epoch: int, stalled: int, why: str,
               reduce: bool = False) -> pb.DataRoute:
        """PLANE=chain: this node could not send to ``stalled``: the broadcast's route without it
        (a reduce is aborted instead: ABORTED)."""
        req = pb.BypassRequest(node=self._node(), round_id=round_id, epoch=epoch, stalled=stalled,
                               why=why.encode("ascii", "replace").decode()[:200], reduce=reduce)
        return self._stub.Bypass(req, timeout=RPC_TIMEOUT, metadata=self._md)

    def digest(self, round_id: int, sha256: bytes = b"", center: bool = False) -> bytes:
        """PLANE=chain: register the SHA-256 of the leader this node sends down round
        ``round_id``'s route (its source), or, with none, ask for the one registered, or with
        ``center`` for the digest of the round's new center (empty: none within the server's
        wait)."""
        from ..global_server.digests import WAIT

        req = pb.DigestRequest(node=self._node(), round_id=round_id, sha256=sha256, center=center)
        return self._on_stream("digest", req, RPC_TIMEOUT + WAIT).sha256

    def leave(self, consumed: int, late: int, stop_job: str = "",
              timeout: float = RPC_TIMEOUT) -> int:
        """Leave the job; ``stop_job`` (node 0 only): stop the whole job, for this reason. On
        the server's session port, a message of the session's open stream (when no other call
        holds it): at the end of a job of hundreds of nodes, a unary call each costs the server
        a thread hand-off while it still serves the last rounds of the others. No stream is
        opened for it: where the stream broke or the server ended it (a stop, Ctrl-C), the
        unary call fails or succeeds at once, as before."""
        req = pb.LeaveRequest(node=self._node(), consumed=consumed, late_consumed=late,
                              stop_job=stop_job)
        s = self._stream
        if (self._session_port and s is not None and s.node.session == self.session
                and not s.ended and self._call_lock.acquire(blocking=False)):
            try:
                return self._on_stream("leave", req, timeout).counter
            finally:
                self._call_lock.release()
        return self._stub.Leave(req, timeout=timeout, metadata=self._md).counter

    # ------------------------------------------------------------------ parameters
    def push(self, buffer: str, vec: np.ndarray, round_id: int, summands: int = 0,
             wire: str = "float32", weight: float = 0.0) -> None:
        """Upload ``vec`` (a flat float32 view) as the node's ``buffer`` for ``round_id``.

        ``wire="bfloat16"`` sends half the bytes, rounded to bfloat16 (needs ``ml_dtypes``).
        A round's small leader or sum goes whole on the session stream, when no other call
        holds it; a large vector on the server's bulk port when it has one, else a gRPC stream
        (``transfer_client.py``).
        """
        t = self.transfers
        if buffer == "sum" and self._took_carried_push(round_id, vec, summands, wire, weight):
            t.moved["session"] += 1
            return
        if buffer in SESSION_UPLOADS and t.small(vec, wire) and self._whole("push", lambda: (
                pb.SessionUpload(header=pb.PushHeader(
                    node=self._node(), round_id=round_id, buffer=BUFFER_KINDS[buffer],
                    param_count=vec.size, summands=summands, wire_format=WIRE_FORMATS[wire],
                    weight=weight), data=t.encode(vec, wire)))) is not None:
            t.moved["session"] += 1
            return
        t.push(self._node(), buffer, vec, round_id, summands, wire, weight)

    def pull(self, buffer: str, out: np.ndarray, round_id: int, wire: str = "float32") -> None:
        """Download the server's ``buffer`` for ``round_id`` into ``out`` (a flat float32 view).

        ``wire="bfloat16"`` receives half the bytes, rounded to bfloat16 (needs ``ml_dtypes``).
        A round's small vector (``round_id`` > 0: the node loop's own download, between its
        other calls) comes whole on the session stream; a newest one (``round_id`` 0, e.g. an
        asynchronous rule's own thread, which must not hold the loop's calls while it waits
        for a seed) or a large one on the bulk port or a gRPC stream (``transfer_client.py``).
        """
        t = self.transfers
        chunk = self._take_carried(buffer, round_id, wire)
        if chunk is None and round_id and buffer != "mail" and t.small(out, wire):
            chunk = self._whole("pull", lambda: pb.PullParamsRequest(
                node=self._node(), round_id=round_id, buffer=BUFFER_KINDS[buffer],
                wire_format=WIRE_FORMATS[wire]))
        if chunk is not None:
            t.fill(out, chunk.data, wire)
            return
        t.pull(self._node(), buffer, out, round_id, wire)

    def _took_carried_push(self, round_id: int, vec: np.ndarray, summands: int, wire: str,
                           weight: float) -> bool:
        """Whether this very upload of the sum of ``round_id`` (the same values, summands,
        weight and wire format) went with its report (once); ``CallError`` if the server
        refused it there."""
        carried = self._carried_push
        if carried is None or carried[0] != round_id:
            return False
        h, data = carried[1].header, carried[1].data
        if ((h.summands, h.weight, h.wire_format) != (summands, weight, WIRE_FORMATS[wire])
                or data != self.transfers.encode(vec, wire)):
            return False
        self._carried_push = None
        _raise_refusal(carried[2].push_code, carried[2].push_details)
        return True

    def _take_carried(self, buffer: str, round_id: int, wire: str) -> pb.ParamChunk | None:
        """The download of ``buffer`` for ``round_id`` that the round's answer carried (once),
        or None; ``CallError`` if the server refused it there."""
        carried = self._carried
        if carried is None or carried[:3] != (buffer, round_id, wire):
            return None
        self._carried = None
        resp = carried[3]
        _raise_refusal(resp.download_code, resp.download_details)
        return resp.download

    def _whole(self, field: str, request: Callable[[], object]):  # noqa: ANN202
        """A small vector's ``field`` call on the session stream, whole; None (nothing sent)
        when another call holds the stream: the caller takes its own stream then."""
        if not self._call_lock.acquire(blocking=False):
            return None
        try:
            return self._on_stream(field, request(), self.round_timeout + RPC_TIMEOUT)
        finally:
            self._call_lock.release()

    def push_mail(self, vec: np.ndarray, number: int, weight: float) -> None:
        """Send a gossip rule's mail ``number`` (``vec`` = sum of weight * x) to a random
        other node (``global_server/mail.py``)."""
        self.push("mail", vec, number, weight=weight)

    def pull_mail(self, number: int, out: np.ndarray) -> float:
        """Delivery ``number`` of this node's mail into ``out``; returns its weight (0: no
        mail, ``out`` untouched)."""
        return self.transfers.pull_mail(self._node(), number, out)


def _raise_refusal(code: int, details: str) -> None:
    """A carried transfer's refusal (a gRPC status code, 0: none) raised as its call's would
    have been."""
    if code:
        raise CallError(CODES.get(code, grpc.StatusCode.UNKNOWN), details)
