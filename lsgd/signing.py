"""Signed calls: every call proves the job secret without the secret crossing the network.

A node signs each call to the global server (as Horovod signs its driver messages): metadata
key ``x-lsgd-signature`` carries ``1.<unix ms>.<nonce>.<mac>`` where

- ``nonce`` is 16 random bytes (hex), new for every call;
- ``mac`` = HMAC-SHA256(key, ``lsgd-call-v1`` LF method LF ms LF nonce LF SHA-256(request)),
  hex, with ``key`` = HMAC-SHA256(secret, ``lsgd call signing key v1``);
- ``request`` is the serialized bytes of the call's request message as sent; for a client
  stream (``PushParams``) its first message, the header that names node, round and buffer.

The server (``CallCheck`` in ``lsgd.security``) recomputes the mac over the bytes it received
and answers UNAUTHENTICATED, before any handler runs, to a missing or wrong signature, a
timestamp more than ``MAX_SKEW`` seconds from its own clock, or a nonce it has seen (a replay).
An observer of a plaintext link so learns neither the secret nor a usable call: a session id
read off the wire is worthless without the key. Nonces are remembered for as long as their
timestamp is acceptable, at most ``MAX_NONCES`` of them; when that many calls arrive within
the window, the oldest are forgotten and every timestamp up to theirs is refused from then on.
They live in the server process: a restarted global server does not know those of the last
``MAX_SKEW`` seconds (a call captured then meets only the coordinator's session and request
number checks).

A ``Session`` stream (one per node session: the node loop's credit and round calls) is signed
like any call over its first message, which carries a random stream nonce; every later message
carries ``session_mac`` over that nonce, its number and its call, and the server checks both
the MAC and that the numbers run 1, 2, 3, ... So a message can be neither altered, replayed,
reordered nor moved to another stream.

Not covered without TLS: the chunks after an upload's header (their integrity rests on TCP,
i.e. on nobody altering the stream in flight; the server still refuses non-finite values),
the server's answers, and confidentiality of the parameters. TLS covers all three.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import threading
import time
from collections import namedtuple
from typing import Callable, Iterator

import grpc

SIGNATURE_KEY = "x-lsgd-signature"  # gRPC metadata key
VERSION = "1"
MAX_SKEW = 30.0  # seconds a call's timestamp may differ from the server's clock
MAX_NONCES = 1 << 16  # nonces remembered (about 13 MB at most)
_KEY_LABEL = b"lsgd call signing key v1"
_MAC_LABEL = b"lsgd-call-v1"
_SESSION_LABEL = b"lsgd-session-v1"
SESSION_METHOD = "/lsgd.v1.GlobalServer/Session"
# SessionRequest's call fields
ACQUIRE_FIELD, REPORT_FIELD, DIGEST_FIELD, PULL_FIELD, PUSH_FIELD, LEAVE_FIELD = 4, 5, 7, 8, 9, 10


def derive_key(secret: str) -> bytes:
    """The signing key of a job secret (the secret itself is never used as a key directly)."""
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def request_bytes(request: object) -> bytes:
    """The bytes of a request message as gRPC sends it (raw bytes pass through)."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        return bytes(request)
    # No maps in lsgd.proto: SerializeToString is deterministic, the same call gRPC makes.
    return request.SerializeToString()  # type: ignore[attr-defined]


def _mac(key: bytes, method: str, ms: int, nonce: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    text = b"\n".join((_MAC_LABEL, method.encode(), str(ms).encode(), nonce.encode(),
                       digest.encode()))
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def session_mac(key: bytes, nonce: bytes, n: int, field: int, body: bytes) -> bytes:
    """The MAC of message ``n`` of a ``Session`` stream opened with ``nonce``, carrying ``body``
    (a serialized call) in field number ``field`` (``protos/lsgd.proto``, ``SessionRequest``)."""
    text = b"\n".join((_SESSION_LABEL, nonce.hex().encode(), str(n).encode(), str(field).encode(),
                       hashlib.sha256(body).hexdigest().encode()))
    return hmac.new(key, text, hashlib.sha256).digest()


def sign(key: bytes, method: str, body: bytes, now: float | None = None,
         nonce: str | None = None) -> str:
    """The signature (metadata value) of one call of ``method`` with request bytes ``body``."""
    ms = int((time.time() if now is None else now) * 1000)
    nonce = nonce or secrets.token_hex(16)
    return f"{VERSION}.{ms}.{nonce}.{_mac(key, method, ms, nonce, body)}"


class NonceMemory:
    """The nonces of accepted calls, for as long as their timestamps are acceptable; bounded.

    ``floor`` rises to the timestamp of every nonce forgotten early (when ``limit`` were
    remembered), and timestamps at or below it are refused, so a forgotten nonce can never be
    replayed.
    """

    def __init__(self, limit: int = MAX_NONCES) -> None:
        self.limit = limit
        self.floor = float("-inf")
        self._seen: set[str] = set()
        self._by_time: list[tuple[float, str]] = []  # heap of (timestamp, nonce)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: str, ts: float, oldest: float) -> str | None:
        """Remember ``nonce`` (stamped ``ts``) and forget those stamped before ``oldest``.

        Returns None, or why the call is refused (the nonce was seen, or ``ts`` is too old).
        """
        with self._lock:
            heap = self._by_time
            while heap and heap[0][0] < oldest:
                self._seen.discard(heapq.heappop(heap)[1])
            if nonce in self._seen:
                return "a replayed call (its nonce was seen before)"
            while len(heap) >= self.limit:  # forget the oldest early; refuse up to its time
                t, old = heapq.heappop(heap)
                self._seen.discard(old)
                self.floor = max(self.floor, t)
            if ts <= self.floor:
                return (f"a call older than the newest one forgotten (over {self.limit} calls "
                        "within the accepted clock window); send it again")
            heapq.heappush(heap, (ts, nonce))
            self._seen.add(nonce)
            return None


class Verifier:
    """Checks call signatures for one server process (see the module docstring)."""

    def __init__(self, secret: str, clock: Callable[[], float] = time.time,
                 max_skew: float = MAX_SKEW, limit: int = MAX_NONCES) -> None:
        self._key = derive_key(secret)
        self.clock, self.max_skew = clock, max_skew
        self.nonces = NonceMemory(limit)

    def check(self, signature: str | bytes | None, method: str, body: bytes) -> str | None:
        """None if the call is genuine and new; else why it is refused (one line)."""
        if isinstance(signature, bytes):
            signature = signature.decode("ascii", "replace")
        parts = (signature or "").split(".")
        ms_text = parts[1] if len(parts) == 4 else ""
        if parts[0] != VERSION or not (ms_text.isascii() and ms_text.isdigit()) or len(ms_text) > 16:
            return ("missing or malformed call signature: every node needs the job secret "
                    "(SECRET_FILE or LSGD_SECRET must match node 0's)")
        nonce, mac = parts[2], parts[3]
        ms = int(ms_text)
        if len(nonce) != 32 or not hmac.compare_digest(_mac(self._key, method, ms, nonce, body), mac):
            return ("call signature does not match: wrong job secret (SECRET_FILE or LSGD_SECRET "
                    "must match node 0's), or the request was altered on the way")
        now = self.clock()
        off = ms / 1000 - now
        if abs(off) > self.max_skew:
            return (f"call signed {abs(off):.0f} s {'ahead of' if off > 0 else 'behind'} the "
                    f"global server's clock (more than {self.max_skew:g} s): a replay, or a node "
                    "whose clock is off; keep the nodes' clocks synchronized (NTP)")
        return self.nonces.add(nonce, ms / 1000, oldest=now - self.max_skew)

    def check_message(self, nonce: bytes, request: object) -> str | None:
        """None if ``request``, a later message of the ``Session`` stream opened with ``nonce``,
        carries the MAC of its number and call; else why the stream is refused."""
        calls = ((ACQUIRE_FIELD, request.acquire), (REPORT_FIELD, request.report),  # type: ignore[attr-defined]
                 (DIGEST_FIELD, request.digest), (PULL_FIELD, request.pull),  # type: ignore[attr-defined]
                 (PUSH_FIELD, request.push), (LEAVE_FIELD, request.leave))  # type: ignore[attr-defined]
        field, body = next(((f, b) for f, b in calls if b), (REPORT_FIELD, b""))
        mac = session_mac(self._key, nonce, request.n, field, body)  # type: ignore[attr-defined]
        if not hmac.compare_digest(mac, request.mac):  # type: ignore[attr-defined]
            return (f"session message {request.n} has no valid MAC: wrong job secret, or the "  # type: ignore[attr-defined]
                    "message was altered on the way")
        return None


# ------------------------------------------------------------------ client side
class _Details(namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                       "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class Signer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Client interceptor that signs every call (``grpc.intercept_channel(channel, Signer(s))``)."""

    def __init__(self, secret: str, clock: Callable[[], float] = time.time) -> None:
        self._key = derive_key(secret)
        self.clock = clock

    def _details(self, details: grpc.ClientCallDetails, body: bytes) -> _Details:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        md = list(details.metadata or ())
        md.append((SIGNATURE_KEY, sign(self._key, method, body, self.clock())))
        return _Details(details.method, details.timeout, md, details.credentials,
                        details.wait_for_ready, getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001 - grpc API
        return continuation(self._details(details, request_bytes(request)), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001 - grpc API
        return continuation(self._details(details, request_bytes(request)), request)

    def _stream(self, continuation, details, requests: Iterator):  # noqa: ANN001 - grpc API
        first = next(requests, None)  # the header: made by the caller, never blocks on the network
        if first is None:
            return continuation(self._details(details, b""), iter(()))

        def chained() -> Iterator:
            yield first
            yield from requests

        return continuation(self._details(details, request_bytes(first)), chained())

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001
        return self._stream(continuation, details, iter(request_iterator))

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001
        return self._stream(continuation, details, iter(request_iterator))
