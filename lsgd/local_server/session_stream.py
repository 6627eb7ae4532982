"""The node's side of a ``Session`` stream (``lsgd/global_server/session.py``).

``SessionStream.call`` sends one call and waits for its reply, within a deadline. A refused call
raises ``CallError``, a ``grpc.RpcError`` with the code and details the server gave, as the
unary call did, and the stream goes on. Anything else (the stream broke, the server closed it,
the deadline passed) raises a ``grpc.RpcError`` too and marks the stream ``broken``: the caller
opens a new one for its next call, and the node loop's usual handling (detach, reattach) sees
the same errors as before.

Deadlines: a stream has no deadline of its own (it lives as long as the node session), so one
watchdog thread per process cancels a stream whose reply is overdue.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Iterator

import grpc

from ..proto import lsgd_pb2 as pb
from ..signing import (ACQUIRE_FIELD, DIGEST_FIELD, LEAVE_FIELD, PULL_FIELD, PUSH_FIELD,
                       REPORT_FIELD, session_mac)

FIELDS = {"acquire": ACQUIRE_FIELD, "report": REPORT_FIELD, "digest": DIGEST_FIELD,
          "pull": PULL_FIELD, "push": PUSH_FIELD, "leave": LEAVE_FIELD}
CODES = {c.value[0]: c for c in grpc.StatusCode}


class CallError(grpc.RpcError):
    """A call that failed with ``code``: refused by the server, or the stream's own failure."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SessionStream:
    """One open ``Session`` stream of node session ``node`` (one call at a time)."""

    def __init__(self, stub, metadata, key: bytes | None, node: pb.NodeId) -> None:  # noqa: ANN001
        self.node, self._key = node, key
        self.nonce = os.urandom(16)
        self.n = 0
        self.broken = False
        self.expired = False  # the watchdog cancelled it: the reply was overdue
        self.answered = False  # the server answered on it (a reply, or a refusal)
        self.port = 0  # the server's session port it went to (0: the server's own)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(pb.SessionRequest(n=0, node=node, nonce=self.nonce))
        self._call = stub.Session(self._outgoing(), metadata=metadata)
        self._replies = iter(self._call)

    def _outgoing(self) -> Iterator[pb.SessionRequest]:
        while True:
            msg = self._requests.get()
            if msg is None:
                return
            yield msg

    def call(self, field: str, body: bytes, timeout: float):  # noqa: ANN201 - the answer message
        """Send one call (``field``: "acquire", "report", "digest", "pull" or "push"; ``body``: the
        serialized request)
        and return its answer; ``grpc.RpcError`` when it fails."""
        if self.broken:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the session stream is closed")
        self.n += 1
        msg = pb.SessionRequest(n=self.n, **{field: body})
        if self._key is not None:
            msg.mac = session_mac(self._key, self.nonce, self.n, FIELDS[field], body)
        self._requests.put(msg)
        WATCHDOG.watch(self, self.n, time.monotonic() + timeout)
        try:
            reply = next(self._replies)
        except StopIteration:
            self.close()
            raise CallError(grpc.StatusCode.UNAVAILABLE,
                            "the global server closed the session stream") from None
        except grpc.RpcError as exc:
            self.close()
            if _from_server(exc):  # a status the server sent: the port is reachable
                self.answered = True
            if self.expired:
                raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no answer on the session stream within {timeout:g} s") from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the server is full now:
                self.answered = True  # (it answered: the port is reachable)
                raise CallError(grpc.StatusCode.UNAVAILABLE,  # the node tries again later
                                f"the global server refused a session stream: {exc.details()}"
                                ) from None
            raise
        finally:
            WATCHDOG.done(self)
        self.answered = True
        return answer_of(self, reply, field)

    @property
    def ended(self) -> bool:
        """The stream can take no more calls: it broke, was closed, or the server ended it
        (e.g. it restarted) while no call was waiting."""
        return self.broken or self._call.done()

    def close(self) -> None:
        """End the stream (idempotent)."""
        self.broken = True
        self._requests.put(None)
        self._call.cancel()

    def expire(self, n: int) -> None:
        """The watchdog's: the reply to message ``n`` is overdue (nothing, if that call is
        over: the watchdog may look just as it is answered)."""
        with WATCHDOG.lock:
            if WATCHDOG.watched(self) != n:
                return
            self.expired = True
        self._call.cancel()


def answer_of(stream, reply: pb.SessionReply, field: str):  # noqa: ANN001, ANN201
    """The answer a reply carries to ``stream``'s call ``stream.n`` (``CallError`` if it
    refused the call; the stream is closed if the reply is another call's)."""
    if reply.n != stream.n:
        stream.close()
        raise CallError(grpc.StatusCode.INTERNAL, f"session reply {reply.n} to message "
                        f"{stream.n}: the stream is out of step")
    if reply.code:
        raise CallError(CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details)
    return getattr(reply, field)


def _from_server(exc: grpc.RpcError) -> bool:
    """Whether the server itself ended the stream (its asyncio session server marks every
    status it sends), rather than the connection failing."""
    try:
        return ("lsgd-status", "server") in tuple(exc.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - an error raised locally has no trailing metadata
        return False


class _Watchdog:
    """Cancels streams whose reply is overdue: one thread per process, only while a call waits,
    looking every ``TICK`` seconds (deadlines are seconds long)."""

    TICK = 0.1

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._due: dict[SessionStream, tuple[int, float]] = {}  # message number, deadline
        self._thread: threading.Thread | None = None

    def watched(self, stream: SessionStream) -> int | None:
        """The message whose reply ``stream`` awaits (lock held)."""
        entry = self._due.get(stream)
        return None if entry is None else entry[0]

    def watch(self, stream: SessionStream, n: int, due: float) -> None:
        with self.lock:
            self._due[stream] = (n, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lsgd-session-watchdog",
                                                daemon=True)
                self._thread.start()

    def done(self, stream: SessionStream) -> None:
        with self.lock:
            self._due.pop(stream, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.TICK)
            now = time.monotonic()
            with self.lock:
                if not self._due:
                    self._thread = None  # the next watch starts another
                    return
                overdue = [(s, n) for s, (n, due) in self._due.items() if due <= now]
            for s, n in overdue:
                s.expire(n)


WATCHDOG = _Watchdog()
