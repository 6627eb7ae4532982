"""Bulk transfers between a node and the global server on a data connection (``BULK_PORT``).

gRPC Python copies each parameter chunk into and out of protobuf and HTTP/2 frames, which
holds the server's uploads and downloads to about a third of a plain socket's speed
(docs/benchmarks.md). This is the same data protocol as ``wire.py`` (a node's data connection),
with two kinds of transfer, both on one connection each:

1. server → node ``HELLO``: ``b"LSGDBULK"``, version, a fresh 16-byte nonce;
2. node → server ``REQUEST``: kind (upload or download), chunk size in elements, the length
   and bytes of the request the gRPC call would carry (``PushHeader`` or
   ``PullParamsRequest``, at most ``MAX_REQUEST`` bytes), the node's own nonce, MAC;
3. server → node ``REPLY`` + MAC: a status (0, or a gRPC status code's number) with one line,
   and the vector's element count. The server answers only once the request has passed every
   check the gRPC call makes (a download: once its buffer is ready), so a refusal changes
   nothing;
4. upload: node → server ``CHUNK``s (offset, elements, raw bytes, MAC), each of the request's
   chunk size but the last, then server → node ``DONE`` (status, one line) + MAC. A server that
   refuses a chunk (e.g. a non-finite value) sends its ``DONE`` at once; the node looks for it
   before each chunk and stops sending;
   download: server → node ``FRAME``s: a chunk (tag 1, offset, elements, raw bytes, MAC), or
   the end (tag 2, status, one line, MAC).

The keys are this connection's (``HMAC(secret, "lsgd-bulk-v1" + server's nonce + node's
nonce)``), and every message carries a MAC as in ``wire.py``: only a holder of the job secret
is served, and nothing can be replayed, reordered or injected. Without a secret (a job on
loopback, or ``ALLOW_INSECURE=1``, as on the gRPC port) the MACs are zeros. Nothing here knows
gRPC or the server's buffers: ``global_server/bulk.py`` and ``local_server/transfer_client.py``
are the two ends.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from typing import Callable, Iterator

import numpy as np

from .wire import _CHUNK, _HELLO, AUTH_WAIT, MAC, MAX_CHUNK, MAX_COUNT, MAX_REASON, NONCE, \
    TO_RECEIVER, TO_SENDER, TransferError, _Channel

MAGIC, VERSION = b"LSGDBULK", 1
LABEL = b"lsgd-bulk-v1"
UPLOAD, DOWNLOAD = 1, 2
MAX_REQUEST = 4096  # bytes of the gRPC request a transfer carries
_REQUEST = struct.Struct("<BII")  # kind, chunk (elements), request length
_REPLY = struct.Struct("<HHQ")  # status, reason length, elements
_DONE = struct.Struct("<HH")  # status, reason length
_FRAME = struct.Struct("<BQI")  # tag; chunk: offset, elements; end: status, reason length
CHUNK_TAG, END_TAG = 1, 2
DRAIN = 2.0  # seconds a server that refused an upload midway reads what is still coming


class BulkStatus(Exception):
    """The server's answer to a transfer it did not complete: a gRPC status code's number and
    the one line the gRPC call would have carried."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Unreached(TransferError):
    """The server took no request: it closed the connection at once (it was full), or the port
    does not speak lsgd's bulk protocol (``foreign``). Nothing was sent; the gRPC call may be
    made instead."""

    def __init__(self, why: str, foreign: bool = False) -> None:
        super().__init__(why)
        self.foreign = foreign


class SizeMismatch(TransferError):
    """The server's vector and the node's differ in size (nothing was moved)."""


def _reason(text: str) -> bytes:
    return text.encode()[:MAX_REASON]


# ---------------------------------------------------------------------------- the node's end
def _open(sock: socket.socket, secret: bytes | None, kind: int, request: bytes, chunk: int,
          timeout: float) -> tuple[_Channel, int]:
    """Say the request and read the server's reply: (the channel, the vector's elements)."""
    if len(request) > MAX_REQUEST:
        raise TransferError(f"a request of {len(request)} bytes (at most {MAX_REQUEST})")
    ch = _Channel(sock, secret, time.monotonic() + min(timeout, AUTH_WAIT))
    try:
        magic, version, nonce = _HELLO.unpack(ch.read(_HELLO.size))
    except TransferError as exc:
        raise Unreached(f"the server did not say hello: {exc}") from None
    if magic != MAGIC or version != VERSION:
        raise Unreached(f"the port does not speak lsgd's bulk protocol version {VERSION} (it "
                        f"says {magic!r}, version {version})", foreign=True)
    mine = os.urandom(NONCE)
    ch.keyed(nonce + mine, LABEL)
    ch.deadline = time.monotonic() + timeout
    ch.send(TO_RECEIVER, _REQUEST.pack(kind, chunk, len(request)), request, mine)
    reply = ch.read(_REPLY.size)
    status, length, count = _REPLY.unpack(reply)
    _said(ch, reply, status, length)
    return ch, count


def upload(sock: socket.socket, secret: bytes | None, request: bytes, vec: np.ndarray,
           dtype: np.dtype, chunk: int, timeout: float, stall: float | None = None) -> None:
    """Send the flat vector ``vec`` as ``dtype`` (converted chunk by chunk when it is not
    ``vec``'s own), for the upload ``request``. Raises ``BulkStatus`` with the server's refusal,
    ``Unreached``, or ``TransferError``."""
    ch, count = _open(sock, secret, UPLOAD, request, chunk, timeout)
    if count != vec.size:
        raise SizeMismatch(f"the server takes {count} elements, not {vec.size}")
    ch.stall = stall
    stage = None if dtype == vec.dtype else np.empty(min(chunk, vec.size), dtype)
    early = select.poll()
    early.register(sock, select.POLLIN)
    try:
        for lo in range(0, vec.size, chunk):
            if early.poll(0):  # the server refused the upload midway: its DONE says why
                break
            src = vec[lo : lo + chunk]
            if stage is not None:
                np.copyto(stage[: src.size], src, casting="unsafe")
                src = stage[: src.size]
            elif not src.flags.c_contiguous:
                src = np.ascontiguousarray(src)
            ch.send(TO_RECEIVER, _CHUNK.pack(lo, src.size), bulk=memoryview(src.view(np.uint8)))
    except TransferError as exc:  # a server that refused midway may have said why first
        try:
            _finish(ch)
        except (TransferError, BulkStatus) as told:
            if isinstance(told, BulkStatus):
                raise told from None
        raise exc
    _finish(ch)


def _finish(ch: _Channel) -> None:
    raw = ch.read(_DONE.size)
    _said(ch, raw, *_DONE.unpack(raw))


def _said(ch: _Channel, head: bytes, status: int, length: int) -> None:
    """Read the reason that follows ``head`` and the MAC over both; raise a refusal."""
    if length > MAX_REASON:
        raise TransferError(f"the server sent a reason of {length} bytes")
    reason = ch.read(length) if length else b""
    ch.check(TO_SENDER, head, reason)
    if status:
        raise BulkStatus(status, reason.decode(errors="replace"))


def download(sock: socket.socket, secret: bytes | None, request: bytes, out: np.ndarray,
             dtype: np.dtype, chunk: int, timeout: float, stall: float | None = None) -> None:
    """Receive the vector of the download ``request`` (sent as ``dtype``) into the flat vector
    ``out``. Chunks land in ``out`` as they come (a float32 ``out`` straight from the socket):
    on an error ``out`` holds a part, as after a broken gRPC download."""
    ch, count = _open(sock, secret, DOWNLOAD, request, chunk, timeout)
    if count != out.size:
        raise SizeMismatch(f"the server's vector has {count} elements, this node's {out.size}")
    ch.stall = stall
    item = dtype.itemsize
    raw = out.dtype == dtype and out.dtype.isnative and out.flags.c_contiguous
    dst = memoryview(out.view(np.uint8)) if raw else None
    bounce = None if raw else memoryview(np.empty(min(chunk, count) * item, np.uint8))
    frame, mac = bytearray(_FRAME.size), bytearray(MAC)
    pos = 0
    while True:
        ch.read_into(memoryview(frame))
        tag, a, b = _FRAME.unpack(frame)
        if tag == END_TAG:
            if a > 0xFFFF:
                raise TransferError(f"the server ended with status {a}")
            _said(ch, bytes(frame), a, b)
            if pos != count:
                raise TransferError(f"the download ended at {pos} of {count} elements")
            return
        if tag != CHUNK_TAG or a != pos or not 1 <= b <= min(chunk, count - pos):
            raise TransferError(f"a frame ({tag}, {a}, {b}) where a chunk at {pos} was due")
        view = dst[pos * item:(pos + b) * item] if dst is not None else bounce[:b * item]
        ch.read_into(view, memoryview(mac))
        ch.check(TO_SENDER, bytes(frame), mac=bytes(mac), bulk=view)
        if dst is None:
            np.copyto(out[pos:pos + b], np.frombuffer(view, dtype), casting="unsafe")
        pos += b


# ---------------------------------------------------------------------------- the server's end
Chunks = Iterator[tuple[int, memoryview]]


class Request:
    """What the server's handler is given: the request's bytes and chunk size, and the means
    to accept it (``reader`` for an upload; returning chunks for a download)."""

    def __init__(self, ch: _Channel, kind: int, body: bytes, chunk: int) -> None:
        self._ch, self.kind, self.body, self.chunk = ch, kind, body, chunk
        self.answered = False
        self.moved = 0  # bytes of chunks taken or sent

    def reader(self, count: int, item: int) -> Chunks:
        """The upload's chunks, (offset, raw bytes: valid until the next one); the server
        accepts the upload (REPLY) when the first is asked for. Its MAC is checked before a
        chunk is handed on."""
        if not 1 <= count <= MAX_COUNT:
            raise BulkStatus(3, f"an upload of {count} elements")  # INVALID_ARGUMENT
        self._reply(0, "", count)
        ch = self._ch
        bounce = memoryview(bytearray(min(self.chunk, count) * item))
        raw, mac = memoryview(bytearray(_CHUNK.size)), memoryview(bytearray(MAC))
        pos = 0
        while pos < count:
            expect = min(self.chunk, count - pos)
            view = bounce[:expect * item]
            ch.read_chunk(raw, view, mac, pos, item)
            self.moved += len(view)
            yield pos, view
            pos += expect

    def _reply(self, status: int, reason: str, count: int = 0) -> None:
        text = _reason(reason)
        self._ch.send(TO_SENDER, _REPLY.pack(status, len(text), count), text)
        self.answered = True


def serve(sock: socket.socket, secret: bytes | None, timeout: float,
          handle: Callable[[Request], "tuple[int, int, Chunks] | None"],
          stall: float | None = None) -> None:
    """Serve one connection. ``handle(request)`` raises ``BulkStatus`` to refuse; for an upload
    it consumes ``request.reader(count, item)`` and returns None; for a download it returns
    (elements, item size, its chunks), whose first is asked for before the server accepts.
    ``timeout`` bounds the whole transfer, ``stall`` each wait on the node once the request is
    read. Raises ``TransferError`` when the connection fails (nothing more can be said on it)."""
    ch = _Channel(sock, secret, time.monotonic() + AUTH_WAIT)
    nonce = os.urandom(NONCE)
    ch._sendall([_HELLO.pack(MAGIC, VERSION, nonce)])
    head = ch.read(_REQUEST.size)  # a peer that does not say its request at once is dropped
    kind, chunk, length = _REQUEST.unpack(head)
    if length > MAX_REQUEST:
        raise TransferError(f"a request of {length} bytes (at most {MAX_REQUEST})")
    body = ch.read(length) if length else b""
    theirs = ch.read(NONCE)
    ch.keyed(nonce + theirs, LABEL)
    ch.check(TO_RECEIVER, head, body, theirs)
    ch.deadline, ch.stall = time.monotonic() + timeout, stall
    req = Request(ch, kind, body, chunk)
    try:
        if kind not in (UPLOAD, DOWNLOAD) or not 1 <= chunk <= MAX_CHUNK:
            raise BulkStatus(3, f"unknown kind {kind}, or chunk {chunk} not in 1..{MAX_CHUNK}")
        if kind == UPLOAD:
            handle(req)
            if not req.answered:  # a handler that took nothing
                raise BulkStatus(13, "the upload was not taken")  # INTERNAL
            ch.send(TO_SENDER, _DONE.pack(0, 0), b"")
            return
        count, item, chunks = handle(req)
        first = next(chunks, None)
        req._reply(0, "", count)
        offset = 0
        while first is not None:
            at, data = first
            n = len(data) // item
            ch.send(TO_SENDER, _FRAME.pack(CHUNK_TAG, at, n), bulk=memoryview(data).cast("B"))
            req.moved += len(data)
            offset = at + n
            first = next(chunks, None)
        if offset != count:
            raise BulkStatus(13, f"the download ended at {offset} of {count} elements")
        ch.send(TO_SENDER, _FRAME.pack(END_TAG, 0, 0), b"")
    except BulkStatus as exc:
        text = _reason(exc.details)
        if not req.answered:
            req._reply(exc.code, exc.details)
        elif kind == UPLOAD:
            ch.send(TO_SENDER, _DONE.pack(exc.code, len(text)), text)
            _drain(sock)
        else:
            ch.send(TO_SENDER, _FRAME.pack(END_TAG, exc.code, len(text)), text)


def _drain(sock: socket.socket) -> None:
    """After an upload refused midway: stop writing and read what the node still sends (at
    most ``DRAIN`` seconds), so that closing does not reset the connection before the node has
    read why."""
    try:
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + DRAIN
        sink = bytearray(1 << 16)
        poller = select.poll()  # (not select(): descriptors past 1024 are common on a server)
        poller.register(sock, select.POLLIN)
        while (left := end - time.monotonic()) > 0:
            if not poller.poll(left * 1000):
                return
            try:
                if not sock.recv_into(sink):
                    return
            except BlockingIOError:
                continue
    except OSError:
        return
