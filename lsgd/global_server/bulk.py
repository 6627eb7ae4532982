"""The global server's bulk port (``BULK_PORT``, default ``PORT+3``): the nodes' uploads and
downloads of parameter vectors on data connections (``lsgd/plane/bulk.py``) instead of gRPC
streams, at the speed of a plain socket.

A connection carries one transfer, which goes through the servicer's own checks and buffers
(``TransferRPCs.take_upload`` / ``give_download``: the same node, session and round checks, the
same ``ParamStore``), so a node sees the same answers on either path. Admission: at most
``Limits.streams`` connections at once and ``Limits.pending_per_host`` from one host (more are
closed at once: the node makes the gRPC call instead; a host's count holds a connection until
its request checks out, when it counts against its node session's instead, at most
``Limits.streams_per_session`` as on gRPC); a connection must say its request within
``AUTH_WAIT`` and make progress every ``Limits.idle`` seconds, and lives at most
``Limits.lifetime``. The bulk port's connections are counted apart from the gRPC streams. With a job secret only its holders are served (``plane/bulk.py``); the
port is off under TLS (its connections are authenticated, not encrypted).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from ..plane import bulk
from ..plane.wire import TransferError
from ..proto import lsgd_pb2 as pb
from .admission import Limits
from .session import Refused

if TYPE_CHECKING:
    from .servicer import GlobalServicer

log = logging.getLogger(__name__)
ITEM = {"float32": 4, "bfloat16": 2}
TURNED_AWAY_EVERY = 60.0  # seconds between warnings that connections were turned away


class _Context:
    """What the servicer's checks see of a bulk transfer: ``abort`` refuses it."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(code, details)

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return self._peer


def _status(exc: Refused) -> bulk.BulkStatus:
    return bulk.BulkStatus(exc.code.value[0], exc.details)


class BulkServer:
    """The listener and its connections (``start`` / ``stop`` from any thread)."""

    def __init__(self, servicer: "GlobalServicer", secret: str | None, limits: Limits) -> None:
        self.servicer, self.limits = servicer, limits
        self.secret = secret.encode() if secret else None
        self.sock: socket.socket | None = None
        self.port = 0
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()  # per host: connections not past their request
        self._sessions: Counter[tuple[int, int]] = Counter()  # (node, session): transfers
        self._open: dict[socket.socket, threading.Thread] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._accept_errors = 0
        # uploads and downloads completed, refused (a status other than OK: the node was
        # told), broken (the connection failed after its request, or was forged or too slow:
        # closed), no_request (closed or silent before a request that checks out: a probe, a
        # stranger, a wrong secret), and connections turned away at once (too many)
        self.served = {"upload": 0, "download": 0, "refused": 0, "broken": 0, "no_request": 0,
                       "turned_away": 0}
        self._turned_away_said = 0.0  # when a warning last said so (monotonic)

    def counts(self) -> dict[str, int]:
        """What the port did (see ``served``)."""
        with self._lock:
            return dict(self.served)

    def start(self, address: str) -> int:
        """Listen on ``address`` ("host:port"); returns the port. OSError when it is taken."""
        host, port = address.rsplit(":", 1)
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, int(port)), family=family, backlog=128)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="lsgd-bulk", daemon=True)
        self._thread.start()
        return self.port

    def stop(self, wait: float = 2.0) -> None:
        """Close the port, end the transfers in progress, and wait for their threads (at most
        ``wait`` seconds: a download still waiting for its round's buffer ends with it)."""
        with self._lock:
            self._stopped = True
            threads = list(self._open.values())
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self.sock is not None:
            self.sock.close()
        end = time.monotonic() + wait
        for t in threads + ([self._thread] if self._thread is not None else []):
            if t.ident is not None:
                t.join(max(0.0, end - time.monotonic()))

    def _accept(self) -> None:
        assert self.sock is not None
        while not self._stopped:
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopped:
                    return  # closed
                # out of file descriptors or memory for a moment: the port stays served
                self._accept_errors += 1
                if self._accept_errors in (1, 10, 100) or not self._accept_errors % 1000:
                    log.warning("the bulk port could not accept a connection (%s; %d times so "
                                "far); the nodes' transfers go over gRPC meanwhile", exc,
                                self._accept_errors)
                time.sleep(0.05)
                continue
            host = peer[0]
            with self._lock:
                busy = (self._stopped or len(self._open) >= self.limits.streams
                        or self._pending[host] >= self.limits.pending_per_host)
                if busy:
                    self.served["turned_away"] += 1
                    now = time.monotonic()
                    say = now - self._turned_away_said > TURNED_AWAY_EVERY
                    if say:
                        self._turned_away_said = now
                else:
                    self._pending[host] += 1
                    thread = threading.Thread(target=self._serve, args=(conn, host),
                                              name="lsgd-bulk-conn", daemon=True)
                    self._open[conn] = thread
            if busy:
                conn.close()
                if say:
                    log.warning("the bulk port turned a connection from %s away (%d open, at "
                                "most %d; at most %d from one host before a request): those "
                                "transfers go over gRPC; %d turned away so far",
                                host, len(self._open), self.limits.streams,
                                self.limits.pending_per_host, self.served["turned_away"])
                continue
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: this connection is turned away
                log.warning("the bulk port could not start a thread (%s)", exc)
                self._end(conn, host, None, "turned_away")

    def _serve(self, conn: socket.socket, host: str) -> None:
        handler = _Handler(self, f"bulk:{host}", host)
        outcome = "broken"  # (anything else that ends the thread)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bulk.serve(conn, self.secret, self.limits.lifetime, handler, stall=self.limits.idle)
            outcome = handler.done or "refused"
        except (TransferError, OSError) as exc:
            outcome = "broken" if handler.called else "no_request"
            log.debug("a bulk transfer from %s ended: %s", host, exc)
        except Exception:  # noqa: BLE001 - a bug here must not end the listener's thread
            log.exception("a bulk transfer from %s failed", host)
        finally:
            self._end(conn, None if handler.admitted else host, handler.session, outcome)

    def _end(self, conn: socket.socket, host: str | None, session: tuple[int, int] | None,
             outcome: str) -> None:
        conn.close()
        with self._lock:
            self.served[outcome] += 1
            self._open.pop(conn, None)
            for table, key in ((self._pending, host), (self._sessions, session)):
                if key is not None:
                    table[key] -= 1
                    if table[key] <= 0:
                        del table[key]

    def admit(self, host: str, session: tuple[int, int]) -> bool:
        """A connection's request checked out (its MAC): it leaves its host's pending ones and
        counts against its node session's transfers (at most ``streams_per_session``, as on
        gRPC). False: that session has as many open already."""
        with self._lock:
            if self._sessions[session] >= self.limits.streams_per_session:
                return False
            self._sessions[session] += 1
            self._pending[host] -= 1
            if self._pending[host] <= 0:
                del self._pending[host]
            return True


class _Handler:
    """One connection's transfer, through the servicer's own checks and buffers."""

    def __init__(self, port: BulkServer, peer: str, host: str) -> None:
        self.port, self.servicer, self.context = port, port.servicer, _Context(peer)
        self.host = host
        self.called = False  # its request's MAC checked out
        self.admitted = False  # past its request: counted against its session, not its host
        self.session: tuple[int, int] | None = None
        self.done = ""  # "upload" or "download" once the transfer went through whole

    def _admit(self, node: pb.NodeId) -> None:
        session = (node.node_index, node.session)
        if not self.port.admit(self.host, session):
            raise bulk.BulkStatus(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], (
                f"node {node.node_index} already has {self.port.limits.streams_per_session} "
                "parameter transfers open; try again later"))
        self.admitted, self.session = True, session

    def __call__(self, req: bulk.Request) -> "tuple[int, int, bulk.Chunks] | None":
        s = self.servicer
        self.called = True
        try:
            if req.kind == bulk.UPLOAD:
                h = pb.PushHeader.FromString(req.body)
                self._admit(h.node)
                item = ITEM.get(s.wire_name(h.wire_format) or "", 4)
                try:
                    s.take_upload(h, req.reader(h.param_count, item), self.context)
                finally:
                    s.stats.moved(received=req.moved)
                self.done = "upload"
                return None
            request = pb.PullParamsRequest.FromString(req.body)
            self._admit(request.node)
            # Chunks go from the server's vector itself; with a secret, from a copy, so that a
            # write meanwhile (a center delta, a slow node's download of an older round) cannot
            # change a chunk between its MAC and its send: the download then ends ABORTED, as
            # on gRPC, not with a MAC the node takes for a forgery.
            count, item, chunks = s.give_download(request, req.chunk, self.context, views=True,
                                                  stable=self.port.secret is not None)
            if not count:
                raise bulk.BulkStatus(grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                      "the job's model size is not known yet (node 0 has not "
                                      "joined)")
            return count, item, self._sent(chunks, req)
        except DecodeError:
            raise bulk.BulkStatus(grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                  "the request does not parse") from None
        except Refused as exc:
            raise _status(exc) from None

    def _sent(self, chunks: bulk.Chunks, req: bulk.Request) -> bulk.Chunks:
        try:
            yield from chunks
            self.done = "download"
        except Refused as exc:
            raise _status(exc) from None
        finally:
            self.servicer.stats.moved(sent=req.moved)
