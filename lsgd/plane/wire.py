"""The parameter plane's data connection: one vector from one node to another (PLANE=chain,
docs/design-scale.md; ``node.py`` runs it).

One TCP connection carries one transfer. All integers are little-endian.

1. receiver → sender ``HELLO``: ``b"LSGDDATA"``, version, a fresh 16-byte nonce;
2. sender → receiver ``HEADER`` (fixed size), the sender's own 16-byte nonce, MAC: job, round,
   route epoch, kind, wire format, sender, receiver, element count, chunk size;
3. receiver → sender ``REPLY`` + MAC: accept with the offset it already holds (a re-routed sender
   resumes there), or refuse with a reason (one line), and close;
4. sender → receiver, until the vector is whole: ``CHUNK``: offset, element count, the raw
   bytes, MAC. Chunks run on from the accepted offset, each of the header's chunk size but
   the last;
5. receiver → sender ``DONE`` + MAC.

With a job secret every message carries a MAC under keys of this connection only (derived from
``HMAC(secret, "lsgd-data-v2" + receiver's nonce + sender's nonce)``: neither side can be
answered with another connection's messages) over a direction byte, the message's sequence number
in its direction and the message: nothing can be replayed from another connection, reordered or
injected. A chunk's raw bytes are authenticated by AES-GMAC (about 4x faster than HMAC-SHA256
here, so that a secret costs little of the link's speed) under a nonce made of the direction
and the sequence number, used once per key; that tag, the direction, the number and the chunk's
offset and count are then bound by HMAC-SHA256 like every other message. Without a secret (a
job on loopback only) the MACs are zeros and unchecked. Every field is bounded before anything
is written: a refused header writes nothing, a chunk reaches the receiver's staging buffer only
once its MAC, epoch and offset are checked, and the staging buffer is applied only once whole.

Each message goes out in one ``sendmsg`` and a chunk comes in with one scatter receive
(``recvmsg_into`` straight into its offset field, a buffer of this connection and its MAC):
per-chunk costs are what keeps a data connection from a plain socket's speed on fast links.

A sender that makes no progress for ``stall`` seconds (a receiver that hangs: its kernel buffers
fill and stay full) gives up with ``Stalled``, so that its route can bypass that receiver.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .route import Reception, RouteError

MAGIC, VERSION = b"LSGDDATA", 3
NONCE = 16
MAC = 32
ITEMSIZE = {0: 4, 1: 2}  # wire format code: float32, bfloat16
MAX_CHUNK = 1 << 22  # elements in one chunk (16 MiB of float32)
MAX_COUNT = 1 << 34  # elements in one vector
MAX_REASON = 200
AUTH_WAIT = 2.0  # seconds a receiver waits for a connection's authenticated header
_HELLO = struct.Struct("<8sB16s")
_HEADER = struct.Struct("<32sQIBBiiQI")  # job, round, epoch, kind, wire, sender, receiver, count, chunk
_REPLY = struct.Struct("<BQH")  # status (0 accept, 1 refuse), offset, reason length
_CHUNK = struct.Struct("<QI")  # offset, elements
_DONE = struct.Struct("<B")


class TransferError(RuntimeError):
    """The transfer cannot go on: refused, broken, forged or too slow; the message says why."""


class Stalled(TransferError):
    """The peer took nothing (or sent nothing) for the stall time."""


class Unanswered(TransferError):
    """The receiver closed the connection before it said hello (its listener was full)."""


@dataclass(frozen=True)
class Header:
    job: str
    round_id: int
    epoch: int
    kind: int  # route.Kind: 0 broadcast, 1 reduce
    wire: int  # a key of ITEMSIZE
    sender: int
    receiver: int
    count: int  # elements
    chunk: int  # elements per chunk (every chunk but the last has this many)

    def pack(self) -> bytes:
        job = self.job.encode()
        if len(job) > 32:
            raise TransferError(f"job id {self.job!r} is longer than 32 bytes")
        return _HEADER.pack(job, self.round_id, self.epoch, self.kind, self.wire, self.sender,
                            self.receiver, self.count, self.chunk)

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        job, rnd, epoch, kind, wire, sender, receiver, count, chunk = _HEADER.unpack(data)
        try:
            text = job.rstrip(b"\0").decode()
        except UnicodeDecodeError:
            raise TransferError("the header's job id is not text") from None
        h = cls(text, rnd, epoch, kind, wire, sender, receiver, count, chunk)
        if wire not in ITEMSIZE or kind not in (0, 1):
            raise TransferError(f"unknown wire format {wire} or kind {kind}")
        if not (1 <= count <= MAX_COUNT and 1 <= chunk <= MAX_CHUNK):
            raise TransferError(f"count {count} or chunk {chunk} out of bounds")
        return h


class _Channel:
    """One side of a connection: exact reads with a deadline, MACs with sequence numbers."""

    def __init__(self, sock: socket.socket, secret: bytes | None, deadline: float,
                 stall: float | None = None) -> None:
        self.sock, self.secret, self.deadline, self.stall = sock, secret, deadline, stall
        self.key: bytes | None = None
        self.gmac: AESGCM | None = None
        self.sent = self.received = 0
        self._poller: select.poll | None = None
        sock.setblocking(False)

    def keyed(self, nonce: bytes, label: bytes = b"lsgd-data-v2") -> None:
        if self.secret is not None:
            root = hmac.new(self.secret, label + nonce, hashlib.sha256).digest()
            self.key = hmac.new(root, b"messages", hashlib.sha256).digest()
            self.gmac = AESGCM(hmac.new(root, b"chunks", hashlib.sha256).digest())

    def _mac(self, direction: bytes, seq: int, parts: tuple, bulk: memoryview | None) -> bytes:
        if self.key is None:
            return bytes(MAC)
        number = seq.to_bytes(8, "little")
        h = hmac.new(self.key, direction + number, hashlib.sha256)
        for p in parts:
            h.update(p)
        if bulk is not None:  # AES-GMAC of the bulk bytes; the nonce is used once per key
            h.update(self.gmac.encrypt(direction + number + b"\0\0\0", b"", bulk))
        return h.digest()

    def send(self, direction: bytes, *parts: bytes | memoryview,
             bulk: memoryview | None = None) -> None:
        """One message: ``parts``, then ``bulk`` (a chunk's raw bytes), then its MAC."""
        mac = self._mac(direction, self.sent, parts, bulk)
        self.sent += 1
        self._sendall([*parts, *([bulk] if bulk is not None else []), mac])

    def check(self, direction: bytes, *parts: bytes | memoryview, mac: bytes | None = None,
              bulk: memoryview | None = None) -> None:
        """The next message's MAC (read now, or ``mac`` read with the message) is right."""
        mac = self.read(MAC) if mac is None else mac
        want = self._mac(direction, self.received, parts, bulk)
        self.received += 1
        if not hmac.compare_digest(mac, want):
            raise TransferError("a message's MAC does not match: forged, replayed or corrupted")

    def read_chunk(self, raw: memoryview, view: memoryview, mac: memoryview, at: int,
                   item: int) -> None:
        """The next chunk into ``raw`` (its offset and count), ``view`` (its bytes, which it must
        fill) and ``mac``: it must start at element ``at``, and its MAC must match."""
        expect = len(view) // item
        self.read_into(raw, view, mac)
        got, n = _CHUNK.unpack(raw)
        if (got, n) != (at, expect):
            raise TransferError(f"a chunk of {n} elements at {got}; expected {expect} at {at}")
        self.check(TO_RECEIVER, raw, mac=bytes(mac), bulk=view)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the transfer's deadline passed")
        return left if self.stall is None else min(left, self.stall)

    def _timed_out(self, doing: str) -> TransferError:
        if self.stall is not None and self.deadline - time.monotonic() > 0:
            return Stalled(f"the peer made no progress for {self.stall:g} s ({doing})")
        return TransferError(f"the transfer's deadline passed ({doing})")

    def _wait(self, event: int, doing: str, until: float | None = None) -> None:
        """Wait until the socket can go on (``event``), at most until the deadline, for the
        stall time, and until ``until``. The socket is non-blocking: a call is tried first, and
        only one that would block waits here, so a chunk that is there takes one system call,
        not a ``poll`` and a call as a Python socket time-out makes."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, event)
        else:
            self._poller.modify(self.sock, event)
        wait = self._left()
        if until is not None:
            wait = min(wait, until - time.monotonic())
        if wait <= 0 or not self._poller.poll(wait * 1000):
            raise self._timed_out(doing)

    def _sendall(self, parts: list) -> None:
        """All of ``parts``, in as few ``sendmsg`` calls as the socket takes them. With a stall
        time, the whole message must be taken within it (a receiver that takes a chunk's bytes
        only a trickle at a time holds up the route as a hung one does)."""
        self._left()  # the deadline holds while data flows too
        until = None if self.stall is None else time.monotonic() + self.stall
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            try:
                n = self.sock.sendmsg(views)
            except BlockingIOError:
                self._wait(select.POLLOUT, "sending", until)
                continue
            except OSError as exc:
                raise TransferError(f"send failed: {exc}") from None
            views = _advance(views, n)

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def read_into(self, *views: memoryview) -> None:
        """Fill ``views`` in order, with as few receives as the data's arrival allows."""
        self._left()
        left = [v for v in views if len(v)]
        while left:
            try:
                n = self.sock.recvmsg_into(left)[0]
            except BlockingIOError:
                self._wait(select.POLLIN, "receiving")
                continue
            except OSError as exc:
                raise TransferError(f"receive failed: {exc}") from None
            if n == 0:
                raise TransferError("the peer closed the connection")
            left = _advance(left, n)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``n`` bytes have gone."""
    for i, v in enumerate(views):
        if n < len(v):
            return [v[n:], *views[i + 1:]]
        n -= len(v)
    return []


TO_RECEIVER, TO_SENDER = b">", b"<"


def send_vector(sock: socket.socket, header: Header, data: memoryview, secret: bytes | None,
                timeout: float, chunk_ready: Callable[[int], int] | None = None,
                stall: float | None = None) -> None:
    """Send ``data`` (``header.count`` elements as raw bytes) over ``sock``.

    ``chunk_ready(end)``, if given, blocks until at least the first ``end`` elements of
    ``data`` are there (a forwarding member sends what it has received so far) and returns how
    many are; otherwise all of ``data`` is ready. ``stall``: seconds without progress on the
    socket after which the send ends with ``Stalled`` (waiting in ``chunk_ready`` is not a
    stall of this receiver).
    """
    item = ITEMSIZE[header.wire]
    if len(data) != header.count * item:
        raise TransferError(f"{len(data)} bytes for {header.count} elements of {item} bytes")
    # The handshake may wait while the receiver learns its round's route (up to its admit
    # time): no stall bound until it has answered.
    ch = _Channel(sock, secret, time.monotonic() + timeout, None)
    try:
        hello = ch.read(_HELLO.size)
    except Stalled:
        raise
    except TransferError as exc:
        raise Unanswered(f"node {header.receiver} did not answer: {exc}") from None
    magic, version, nonce = _HELLO.unpack(hello)
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"the peer does not speak lsgd's data protocol version {VERSION} "
                            f"(it says {magic!r}, version {version}): run one lsgd version on "
                            "every node")
    mine = os.urandom(NONCE)  # the keys are this connection's on both sides' word
    ch.keyed(nonce + mine)
    ch.send(TO_RECEIVER, header.pack(), mine)
    status, offset, length = _REPLY.unpack(ch.read(_REPLY.size))
    if length > MAX_REASON:
        raise TransferError(f"node {header.receiver} sent a reason of {length} bytes")
    reason = ch.read(length) if length else b""
    ch.check(TO_SENDER, _REPLY.pack(status, offset, length), reason)
    if status != 0:
        raise TransferError(f"node {header.receiver} refused the transfer: "
                            f"{reason.decode(errors='replace')}")
    if offset > header.count:
        raise TransferError(f"node {header.receiver} resumes at {offset} of {header.count}")
    ch.stall = stall
    while offset < header.count:
        end = min(offset + header.chunk, header.count)
        if chunk_ready is not None and chunk_ready(end) < end:
            raise TransferError(f"elements up to {end} are not there to send")
        ch.send(TO_RECEIVER, _CHUNK.pack(offset, end - offset),
                bulk=data[offset * item:end * item])
        offset = end
    (status,) = _DONE.unpack(ch.read(_DONE.size))
    ch.check(TO_SENDER, _DONE.pack(status))


def receive_vector(sock: socket.socket, out: memoryview | None, reception: Reception | None,
                   secret: bytes | None, timeout: float,
                   admit: Callable[[Header], "str | None | tuple[memoryview, Reception]"],
                   on_chunk: Callable[[int, int], None] | None = None,
                   lock: "threading.Lock | None" = None,
                   add: Callable[[Header], bool] | None = None) -> Header:
    """Receive one transfer into ``out`` (the staging buffer, raw bytes of the whole vector).

    ``admit(header)`` returns a one-line reason to refuse, or None to accept into ``out`` and
    ``reception``, or a pair ``(out, reception)`` to accept into those (the job, round, route
    and sender are the caller's to check); the route epoch and the resume offset come from the
    reception. Each chunk is read into a buffer of this connection, checked (MAC, epoch,
    contiguous offset) and only then copied into ``out``, under ``lock`` when given: several
    connections may feed one reception (a bypassed sender's and its replacement's), and none
    writes a byte of ``out`` that is not the current epoch's next chunk. ``on_chunk(offset,
    n)`` is called for each chunk taken (under the lock), before the next is read: a member
    forwards from there. ``add(header)`` True: each chunk is added (float32) to what ``out``
    holds there instead of replacing it (a reduce). Returns the header.
    """
    ch = _Channel(sock, secret, time.monotonic() + min(timeout, AUTH_WAIT))
    nonce = os.urandom(NONCE)
    ch._sendall([_HELLO.pack(MAGIC, VERSION, nonce)])
    raw = ch.read(_HEADER.size)  # a peer that does not authenticate at once is dropped
    theirs = ch.read(NONCE)
    ch.keyed(nonce + theirs)
    ch.check(TO_RECEIVER, raw, theirs)
    ch.deadline = time.monotonic() + timeout
    header = Header.unpack(raw)
    item = ITEMSIZE[header.wire]
    why = admit(header)
    if isinstance(why, tuple):
        (out, reception), why = why, None
    guard = lock if lock is not None else contextlib.nullcontext()
    if why is None and (out is None or reception is None or header.count != reception.count
                        or len(out) != header.count * item):
        why = f"the vector has {reception.count if reception else 0} elements, not {header.count}"
    offset = 0
    if why is None:
        with guard:
            try:
                offset = reception.open(header.epoch)
            except RouteError as exc:
                why = str(exc)
    if why is not None:
        reason = why.encode()[:MAX_REASON]
        ch.send(TO_SENDER, _REPLY.pack(1, 0, len(reason)), reason)
        raise TransferError(f"refused node {header.sender}'s transfer: {why}")
    ch.send(TO_SENDER, _REPLY.pack(0, offset, 0), b"")
    adding = add is not None and add(header)
    if adding and header.wire != 0:
        raise TransferError("a reduce is float32")
    bounce = memoryview(bytearray(min(header.chunk, header.count) * item))
    raw, mac = memoryview(bytearray(_CHUNK.size)), memoryview(bytearray(MAC))
    mine = offset  # where this sender's next chunk starts: its chunks run on from there
    while True:
        with guard:
            if reception.complete:
                break
        if mine >= header.count:
            raise TransferError(f"node {header.sender} sent the whole vector, and the "
                                "reception is still not complete")
        expect = min(header.chunk, header.count - mine)
        view = bounce[:expect * item]
        at, n = mine, expect
        ch.read_chunk(raw, view, mac, at, item)
        mine += n
        with guard:
            try:
                reception.accept(header.epoch, at, n)
            except RouteError as exc:
                raise TransferError(f"node {header.sender}: {exc}") from None
            if adding:
                region = np.frombuffer(out[at * item:(at + n) * item], dtype="<f4")
                np.add(region, np.frombuffer(view, dtype="<f4"), out=region)
            else:
                out[at * item:(at + n) * item] = view
            if on_chunk is not None:
                on_chunk(at, n)
    ch.send(TO_SENDER, _DONE.pack(0))
    return header


def as_bytes(vec: np.ndarray) -> memoryview:
    """A contiguous vector's raw bytes, without a copy."""
    return memoryview(np.ascontiguousarray(vec)).cast("B")
