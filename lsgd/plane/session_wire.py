"""The session protocol on a plain socket (``SESSION_PORT``): a node's ``Session`` messages
without gRPC.

A message on a ``grpc.aio`` stream costs the server about 70 µs of CPU before any of our code,
a message on a plain asyncio socket about 32 µs (``bench/stream_floor.py``, docs/benchmarks.md,
"Step 5"): at 512 nodes the server's messages are most of a round's time. So the node's
credit, round, digest and small-vector calls travel as the same protobuf messages
(``SessionRequest`` / ``SessionReply``, ``protos/lsgd.proto``) on one TCP connection per node
session, framed here:

1. server → node ``HELLO``: ``b"LSGDSESS"``, version, a fresh 16-byte nonce;
2. node → server, frame 0: the opening's MAC (32 bytes) and the opening (``SessionRequest``
   ``n = 0``: the node and its own 16-byte nonce). The MAC is
   ``HMAC(key, "lsgd-session-socket-v1" ‖ server's nonce ‖ SHA-256(opening))`` under the job
   secret's key (``signing.derive_key``), so an opening is good on its connection only: no
   nonce memory, no clock window;
3. then one frame per message each way: node → server ``SessionRequest`` bytes (each with the
   MAC of its number and call, ``signing.session_mac``, as on the gRPC stream); server → node
   ``SessionReply`` bytes, one per request. A reply numbered 0 with a status code ends the
   stream with that status (as a gRPC status would), and the server closes the connection.

A frame is a 4-byte big-endian length and that many bytes: an opening at most
``MAX_OPENING``, a message at most ``MAX_FRAME`` (a call beside a small vector). Without a
secret (a job on loopback, or ``ALLOW_INSECURE=1``) the MAC is zeros and not checked, as on
the gRPC port. Under TLS the port is off: its connections are authenticated, not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ..wire import SMALL_VECTOR

MAGIC, VERSION = b"LSGDSESS", 1
HELLO_SIZE = len(MAGIC) + 1 + 16
NONCE = 16
MAC_SIZE = 32
LABEL = b"lsgd-session-socket-v1"
MAX_OPENING = 4096  # bytes: an opening carries a node id and a nonce (about 60)
MAX_FRAME = SMALL_VECTOR + 64 * 1024  # bytes: a call, or a small vector whole beside it
LENGTH = 4


def hello() -> tuple[bytes, bytes]:
    """A server's hello and its nonce."""
    nonce = os.urandom(NONCE)
    return MAGIC + bytes([VERSION]) + nonce, nonce


def read_hello(data: bytes) -> bytes:
    """The server's nonce from its hello; ``ValueError`` if it is not this protocol's."""
    if len(data) != HELLO_SIZE or not data.startswith(MAGIC):
        raise ValueError("not an lsgd session port (no LSGDSESS hello)")
    if data[len(MAGIC)] != VERSION:
        raise ValueError(f"session protocol version {data[len(MAGIC)]}, this node speaks "
                         f"{VERSION}: run the same lsgd version on every node")
    return data[len(MAGIC) + 1:]


def frame(*parts: bytes) -> bytes:
    """One message on the stream: its length, then ``parts`` (its encoding, in pieces)."""
    return b"".join([sum(len(p) for p in parts).to_bytes(LENGTH, "big"), *parts])


def opening_mac(key: bytes | None, server_nonce: bytes, opening: bytes) -> bytes:
    """The MAC of an opening on the connection whose hello carried ``server_nonce`` (zeros
    without a secret)."""
    if key is None:
        return bytes(MAC_SIZE)
    text = LABEL + server_nonce + hashlib.sha256(opening).digest()
    return hmac.new(key, text, hashlib.sha256).digest()


def opening_ok(key: bytes | None, server_nonce: bytes, mac: bytes, opening: bytes) -> bool:
    return key is None or hmac.compare_digest(mac, opening_mac(key, server_nonce, opening))
