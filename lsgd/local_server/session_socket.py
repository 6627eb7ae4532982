"""The node's side of a session stream on the server's session port (``SESSION_PORT``): the
``Session`` messages on a plain TCP connection (``lsgd/plane/session_wire.py``).

``SocketSession`` has ``SessionStream``'s interface (``session_stream.py``): ``call`` sends one
call and waits for its reply within a deadline; a refused call raises ``CallError`` with the
code and details the server gave, and the stream goes on; anything else (the connection
failed or closed, the server ended the stream, the deadline passed) raises a ``CallError`` too
and marks the stream ``broken``, and the caller opens a new one for its next call. A
connection's time-outs are its own: no watchdog thread. ``close`` from another thread ends a
call in progress.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import grpc

from ..plane import session_wire as sw
from ..proto import lsgd_pb2 as pb
from ..signing import session_mac
from .session_stream import CODES, FIELDS, CallError, answer_of

CONNECT = 3.0  # seconds to connect and hear the server's hello
ENDED = 1.0  # seconds to read the server's last word on a stream it closed


def probe(host: str, port: int, timeout: float) -> str | None:
    """Why ``host:port`` is not a session port that answers within ``timeout`` seconds (None:
    it is): a node's look at the port when it joins."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            data = b""
            while len(data) < sw.HELLO_SIZE:
                part = sock.recv(sw.HELLO_SIZE - len(data))
                if not part:
                    return "it closed the connection"
                data += part
            sw.read_hello(data)
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


class SocketSession:
    """One open session stream of node session ``node`` on ``host:port`` (one call at a time)."""

    def __init__(self, host: str, port: int, key: bytes | None, node: pb.NodeId) -> None:
        self.node, self.port, self._key = node, port, key
        self._host = host
        self.nonce = os.urandom(sw.NONCE)
        self.n = 0
        self.broken = False
        self.answered = False  # the server answered on it (its hello, a reply, a status)
        self.replied = False  # the server replied to a call on it
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # close() from another thread
        self._timeout = 0.0  # the call in progress's

    # ------------------------------------------------------------------ connection
    def _open(self, wait: float) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self.port), timeout=wait)
        except OSError as exc:
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to the session port "
                            f"{self._host}:{self.port}: {exc}") from None
        with self._lock:
            if self.broken:  # closed meanwhile
                sock.close()
                raise CallError(grpc.StatusCode.UNAVAILABLE, "the session stream is closed")
            self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            server_nonce = sw.read_hello(self._read(sw.HELLO_SIZE, time.monotonic() + wait))
        except ValueError as exc:
            raise CallError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except CallError as exc:  # nothing was sent: the call may go elsewhere
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"no hello from the session port "
                            f"within {wait:g} s" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                            else exc.details()) from None
        self.answered = True
        opening = pb.SessionRequest(n=0, node=self.node, nonce=self.nonce).SerializeToString()
        try:
            self._send(sw.opening_mac(self._key, server_nonce, opening) + opening,
                       time.monotonic() + wait)
        except CallError:
            pass  # the server ended the stream at once: the reply's read says why
        return sock

    def _live(self) -> socket.socket:
        sock = self._sock
        if sock is None:  # closed from another thread
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the session stream is closed")
        return sock

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer on the session stream within {self._timeout:g} s")
        return left

    @contextmanager
    def _io(self):  # noqa: ANN202
        """A socket's failures as the call's: its time-out, or a broken stream."""
        try:
            yield
        except socket.timeout:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the session "
                            f"stream within {self._timeout:g} s") from None
        except OSError as exc:
            raise CallError(grpc.StatusCode.UNAVAILABLE,
                            f"the session stream broke: {exc}") from None

    def _send(self, payload: bytes, deadline: float) -> None:
        sock = self._live()
        with self._io():
            sock.settimeout(self._left(deadline))
            sock.sendall(sw.frame(payload))

    def _read(self, size: int, deadline: float) -> bytes:
        """``size`` bytes, all of them by ``deadline`` (monotonic: the call's, not a read's)."""
        sock, out = self._live(), bytearray()
        while len(out) < size:
            with self._io():
                sock.settimeout(self._left(deadline))
                part = sock.recv(size - len(out))
            if not part:
                raise CallError(grpc.StatusCode.UNAVAILABLE,
                                "the global server closed the session stream")
            out += part
        return bytes(out)

    # ------------------------------------------------------------------ calls
    def call(self, field: str, body: bytes, timeout: float):  # noqa: ANN201 - the answer message
        """Send one call (``field``: "acquire", "report", "digest", "pull" or "push"; ``body``:
        the serialized request) and return its answer; ``grpc.RpcError`` when it fails."""
        if self.broken:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the session stream is closed")
        self._timeout = timeout
        try:
            if self._sock is None:
                self._open(min(CONNECT, timeout))
            deadline = time.monotonic() + timeout
            self.n += 1
            msg = pb.SessionRequest(n=self.n, **{field: body})
            if self._key is not None:
                msg.mac = session_mac(self._key, self.nonce, self.n, FIELDS[field], body)
            try:
                self._send(msg.SerializeToString(), deadline)
            except CallError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # the server may have ended the stream: its last word says why
                deadline = min(deadline, time.monotonic() + ENDED)
            size = int.from_bytes(self._read(sw.LENGTH, deadline), "big")
            if size > sw.MAX_FRAME:
                raise CallError(grpc.StatusCode.INTERNAL, f"a session reply of {size} bytes")
            reply = pb.SessionReply.FromString(self._read(size, deadline))
        except CallError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a reply that does not parse
            self.close()
            raise CallError(grpc.StatusCode.INTERNAL, f"a bad session reply: {exc}") from None
        except BaseException:  # e.g. Ctrl-C mid-call: its reply would answer the next call
            self.close()
            raise
        self.answered = True
        self.replied = self.replied or reply.n != 0
        if reply.n == 0 and reply.code:  # the server ended the stream with this status
            self.close()
            code = CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full for now: try again later
                raise CallError(grpc.StatusCode.UNAVAILABLE, "the global server refused a "
                                f"session stream: {reply.details}")
            raise CallError(code, reply.details)
        return answer_of(self, reply, field)

    @property
    def ended(self) -> bool:
        """The stream can take no more calls: it broke, was closed, or the server ended or
        closed it (e.g. it restarted) while no call was waiting."""
        if self.broken:
            return True
        sock = self._sock
        if sock is None:
            return False
        try:  # idle, so anything there (or its close) is its end
            sock.setblocking(False)  # (a time-out would wait for data first)
            sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        """End the stream (idempotent; from any thread)."""
        with self._lock:
            self.broken = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
