"""A node's parameter uploads and downloads to and from the global server (``GlobalClient.push``
/ ``pull`` / ``push_mail`` / ``pull_mail``).

Three paths, with the same checks and answers at the server (``global_server/transfers.py``):

- the node's **session stream** (``GlobalClient.push`` / ``pull``): a vector of less than
  ``SMALL_VECTOR`` bytes on the wire, whole in one message (``small``, ``encode``, ``fill``);

- the server's **bulk port** (``BULK_PORT``, ``global_server/bulk.py``): one data connection
  per transfer, at a plain socket's speed. Used for vectors of ``MIN_BULK`` bytes and more when
  the server named the port at the node's join and this node's ``BULK_PORT`` is not 0. A port
  that does not connect is said once, and left for a minute (then up to 10, doubling) before it
  is tried again: the gRPC calls are made meanwhile; a server that is full for a moment closes
  the connection at once, and that one transfer goes over gRPC. A job stop ends a transfer in
  progress (``abort``).
- **gRPC streams** (``PushParams`` / ``PullParams``) on ``PORT``: chunks as hand-encoded
  protobuf bytes (the wire format of lsgd.proto, unchanged). An upload copies each slice of
  shared memory once, into the message; a download copies each message's payload once, into
  ``out``. No protobuf objects, no full-size buffers.

A refusal or a failure on either path is a ``grpc.RpcError`` with the code the gRPC call would
carry, so the node loop handles both alike.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from typing import Callable, Iterator

import grpc
import numpy as np

from ..plane import bulk
from ..plane.wire import Stalled, TransferError
from ..proto import lsgd_pb2 as pb
from ..wire import SMALL_VECTOR, aligned_empty, steady_heap, varint, wire_dtype

log = logging.getLogger("lsgd.local_server.global_client")

# Elements per chunk (512 KiB of float32): chunks stay in cache through their few copies, and
# 200 messages per 100 MB keep the per-message cost of gRPC small (bench/params.py).
CHUNK = 1 << 17  # upload
PULL_CHUNK = 1 << 17  # download, asked of the server
BULK_CHUNK = 1 << 18  # elements per chunk on the bulk port (1 MiB of float32)
MIN_BULK = SMALL_VECTOR  # bytes: smaller vectors stay off the bulk port (a connection costs more than it saves)
BULK_CONNECT = 3.0  # seconds a node gives the bulk port to connect
BULK_STALL = 15.0  # seconds without progress once the vector moves (as gRPC's keepalive finds)
RETRY_FIRST, RETRY_MOST = 60.0, 600.0  # seconds on gRPC before a port that failed is tried again
WIRE_FORMATS = {"float32": pb.WIRE_FORMAT_UNSPECIFIED, "bfloat16": pb.WIRE_FORMAT_BFLOAT16}
BUFFER_KINDS = {"global_leader": pb.BUFFER_KIND_GLOBAL_LEADER, "center": pb.BUFFER_KIND_CENTER,
                "sum": pb.BUFFER_KIND_NODE_SUM, "average": pb.BUFFER_KIND_AVERAGE,
                "center_delta": pb.BUFFER_KIND_CENTER_DELTA, "mail": pb.BUFFER_KIND_MAIL}
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class TransferFailed(grpc.RpcError):
    """A bulk transfer's refusal or failure, as the gRPC call would have raised it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ParamTransfers:
    """The parameter-moving calls of one ``GlobalClient`` (its channel, metadata and node)."""

    def __init__(self, channel: grpc.Channel, metadata: tuple | None, secret: str | None,
                 address: str, node_index: int, timeout: Callable[[], float]) -> None:
        self._channel, self._md = channel, metadata
        self._secret = secret.encode() if secret else None
        self._host = address.rsplit(":", 1)[0].strip("[]")
        self.node_index = node_index
        self._timeout = timeout  # a transfer's whole deadline (round_timeout + RPC_TIMEOUT)
        self._raw_push = channel.stream_unary("/lsgd.v1.GlobalServer/PushParams",
                                              request_serializer=None,
                                              response_deserializer=pb.PushParamsResponse.FromString)
        self._raw_pull = channel.unary_stream("/lsgd.v1.GlobalServer/PullParams",
                                              request_serializer=pb.PullParamsRequest.SerializeToString,
                                              response_deserializer=None)
        self._raw_mail = channel.unary_stream("/lsgd.v1.GlobalServer/PullParams",
                                              request_serializer=pb.PullParamsRequest.SerializeToString,
                                              response_deserializer=pb.ParamChunk.FromString)
        self.bulk_port = 0  # the server's (JoinResponse.bulk_port); 0: gRPC only
        self.use_bulk = True  # False: this node's BULK_PORT=0 (gRPC only, whatever the server has)
        self._epoch = 0
        self._unreachable = (0, 0)  # (server epoch, port) that did not connect, until ...
        self._retry_at = 0.0  # ... this time (monotonic), when the port is tried again
        self._retry_delay = RETRY_FIRST
        self._sock: socket.socket | None = None  # the bulk transfer in progress
        self.moved = {"bulk": 0, "grpc": 0, "session": 0}  # transfers made on each path

    def use_bulk_port(self, epoch: int, port: int) -> None:
        """What a join answered: the server process (``epoch``) and its bulk port."""
        self._epoch, self.bulk_port = epoch, port

    def abort(self) -> None:
        """End a bulk transfer in progress now (the job was stopped: nothing waits for it)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ uploads
    def push(self, node: pb.NodeId, buffer: str, vec: np.ndarray, round_id: int,
             summands: int = 0, wire: str = "float32", weight: float = 0.0) -> None:
        dtype = wire_dtype(wire)
        steady_heap()
        if vec.ndim != 1:
            raise ValueError(f"push needs a flat vector, got shape {vec.shape}")
        header = pb.PushHeader(node=node, round_id=round_id, buffer=BUFFER_KINDS[buffer],
                               param_count=vec.size, summands=summands,
                               wire_format=WIRE_FORMATS[wire], weight=weight)
        if self._bulk(vec.size * dtype.itemsize, lambda s: bulk.upload(
                s, self._secret, header.SerializeToString(), vec, dtype, BULK_CHUNK,
                self._timeout(), BULK_STALL)):
            return
        stage = None if dtype == vec.dtype else aligned_empty(min(CHUNK, vec.size), dtype)

        def requests() -> Iterator[bytes]:
            yield pb.PushParamsRequest(header=header).SerializeToString()
            for lo in range(0, vec.size, CHUNK):
                src = vec[lo : lo + CHUNK]
                if stage is not None:  # convert (bfloat16, or another dtype) chunk by chunk
                    src = stage[: src.size]
                    np.copyto(src, vec[lo : lo + src.size], casting="unsafe")
                elif not src.flags.c_contiguous:
                    src = np.ascontiguousarray(src)
                data = src.view(np.uint8)  # raw bytes (also for dtypes without a buffer format)
                inner = b"\x08" + varint(lo) + b"\x12" + varint(data.nbytes)
                # PushParamsRequest.chunk (field 2) = ParamChunk{offset (1), data (2)}
                yield b"".join((b"\x12", varint(len(inner) + data.nbytes), inner, data))

        self._raw_push(requests(), timeout=self._timeout(), metadata=self._md)
        self.moved["grpc"] += 1

    # ------------------------------------------------------------------ downloads
    def pull(self, node: pb.NodeId, buffer: str, out: np.ndarray, round_id: int,
             wire: str = "float32") -> None:
        dtype = wire_dtype(wire)
        steady_heap()
        if out.ndim != 1:
            raise ValueError(f"pull needs a flat vector, got shape {out.shape}")
        request = pb.PullParamsRequest(node=node, round_id=round_id, buffer=BUFFER_KINDS[buffer],
                                       chunk_elements=PULL_CHUNK, wire_format=WIRE_FORMATS[wire])
        if self._bulk(out.size * dtype.itemsize, lambda s: bulk.download(
                s, self._secret, request.SerializeToString(), out, dtype, BULK_CHUNK,
                self._timeout(), BULK_STALL)):
            return
        raw = out.dtype == dtype and out.dtype.isnative and out.flags.c_contiguous
        dst = out.view(np.uint8) if raw else out
        stream = self._raw_pull(request, timeout=self._timeout(), metadata=self._md)
        pos = 0
        try:
            for msg in stream:
                offset, start, nbytes = _parse_chunk(msg)
                n = nbytes // dtype.itemsize
                if offset != pos or nbytes % dtype.itemsize or pos + n > out.size:
                    raise ValueError(f"bad chunk at {offset} ({nbytes} bytes of {wire}) for a "
                                     f"vector of {out.size} at {pos}")
                if raw:  # a byte copy: the payload need not be aligned to 4 bytes
                    s = pos * dtype.itemsize
                    dst[s : s + nbytes] = np.frombuffer(msg, np.uint8, nbytes, start)
                else:
                    np.copyto(out[pos : pos + n], np.frombuffer(msg, dtype, n, start),
                              casting="unsafe")
                pos += n
        finally:
            stream.cancel()  # no-op once complete; stops the server early on a bad chunk
        if pos != out.size:
            raise ValueError(f"download of {buffer} ended at {pos} of {out.size} elements")
        self.moved["grpc"] += 1

    @staticmethod
    def small(out: np.ndarray, wire: str) -> bool:
        """Whether ``out`` is small enough to move whole on the session stream (less than
        ``SMALL_VECTOR`` bytes on the wire)."""
        return out.ndim == 1 and ParamTransfers.small_count(out.size, wire)

    @staticmethod
    def small_count(count: int, wire: str) -> bool:
        """Whether a vector of ``count`` values is small (``small``)."""
        return count * wire_dtype(wire).itemsize < SMALL_VECTOR

    @staticmethod
    def encode(vec: np.ndarray, wire: str) -> bytes:
        """A small upload's bytes: ``vec`` in the ``wire`` encoding."""
        dtype = wire_dtype(wire)
        if vec.dtype != dtype or not vec.flags.c_contiguous:
            vec = np.asarray(vec).astype(dtype)  # bfloat16: rounded to nearest even
        return vec.view(np.uint8).tobytes()  # raw bytes (also for dtypes without a buffer format)

    def fill(self, out: np.ndarray, data: bytes, wire: str) -> None:
        """A small download that came whole (``data``, in the ``wire`` encoding) into ``out``;
        ``ValueError`` when its size is not ``out``'s."""
        dtype = wire_dtype(wire)
        if len(data) != out.size * dtype.itemsize:
            raise ValueError(f"a download of {len(data)} bytes of {wire} for a vector of "
                             f"{out.size}")
        np.copyto(out, np.frombuffer(data, dtype), casting="unsafe")
        self.moved["session"] += 1

    def pull_mail(self, node: pb.NodeId, number: int, out: np.ndarray) -> float:
        """Delivery ``number`` of this node's mail into ``out`` (gRPC: it comes with its
        weight); returns the weight (0: no mail, ``out`` untouched)."""
        stream = self._raw_mail(pb.PullParamsRequest(node=node, round_id=number,
                                                     buffer=pb.BUFFER_KIND_MAIL,
                                                     chunk_elements=PULL_CHUNK),
                                timeout=self._timeout(), metadata=self._md)
        pos, weight = 0, None
        try:
            for chunk in stream:
                if weight is None:
                    weight = chunk.weight
                    if weight == 0.0:
                        return 0.0
                n = len(chunk.data) // 4
                if chunk.offset != pos or len(chunk.data) % 4 or pos + n > out.size:
                    raise ValueError(f"bad mail chunk at {chunk.offset} for {out.size} at {pos}")
                out[pos : pos + n] = np.frombuffer(chunk.data, "<f4")
                pos += n
        finally:
            stream.cancel()
        # (a weight, not a share: the job's weights sum to 1 only until a node is lost)
        if weight is None or pos != out.size or not (0.0 < weight < math.inf):
            raise ValueError(f"mail delivery {number} ended at {pos} of {out.size} elements "
                             f"(weight {weight})")
        if not np.isfinite(out).all():
            raise ValueError(f"mail delivery {number} has non-finite values")
        return weight

    # ------------------------------------------------------------------ the bulk port
    def _bulk(self, nbytes: int, move: Callable[[socket.socket], None]) -> bool:
        """Make the transfer on the bulk port; False when it is not to be used (none, too small,
        unreachable) or did not take the request: the caller makes the gRPC call then."""
        port = self.bulk_port
        if not port or not self.use_bulk or nbytes < MIN_BULK:
            return False
        retry = (self._epoch, port) == self._unreachable
        if retry and time.monotonic() < self._retry_at:
            return False
        try:
            sock = socket.create_connection((self._host, port), timeout=BULK_CONNECT)
        except OSError as exc:
            self._give_up(port, f"no connection: {exc}", again=retry)
            return False
        if retry:
            self._unreachable, self._retry_delay = (0, 0), RETRY_FIRST
            log.warning("node %d: the global server's bulk port %d answers again; parameters "
                        "move on it", self.node_index, port)
        self._sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            move(sock)
        except bulk.Unreached as exc:
            if exc.foreign:
                self._give_up(port, str(exc))
            else:
                log.debug("node %d: the bulk port took no transfer now (%s); over gRPC",
                          self.node_index, exc)
            return False
        except bulk.SizeMismatch as exc:  # as the gRPC path says it
            raise ValueError(str(exc)) from None
        except bulk.BulkStatus as exc:
            raise TransferFailed(_CODES.get(exc.code, grpc.StatusCode.UNKNOWN),
                                 exc.details) from None
        except TransferError as exc:
            code = (grpc.StatusCode.DEADLINE_EXCEEDED
                    if "deadline" in str(exc) and not isinstance(exc, Stalled)
                    else grpc.StatusCode.UNAVAILABLE)
            raise TransferFailed(code, f"the transfer on the bulk port {port} broke: {exc}") from None
        finally:
            self._sock = None
            sock.close()
        self.moved["bulk"] += 1
        return True

    def _give_up(self, port: int, why: str, again: bool = False) -> None:
        """The port did not answer: gRPC for a while (a minute, doubling up to 10 minutes),
        then the port is tried again (a link that was down for a moment comes back)."""
        if again:
            self._retry_delay = min(self._retry_delay * 2, RETRY_MOST)
        self._unreachable, self._retry_at = (self._epoch, port), time.monotonic() + self._retry_delay
        if not again:
            log.warning("node %d: the global server's bulk port %d did not answer (%s); "
                        "parameters go over gRPC on PORT instead, at about a third of the speed, "
                        "and the port is tried again every few minutes (open BULK_PORT, PORT+3 "
                        "by default, on node 0's firewall; or BULK_PORT=0 on this node to use "
                        "gRPC only)", self.node_index, port, why)


def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(b) or shift > 63:
            raise ValueError("truncated or invalid varint in a parameter chunk")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7


def _parse_chunk(msg: bytes) -> tuple[int, int, int]:
    """(offset, payload start, payload bytes) of a serialized ``ParamChunk``; skips unknown fields."""
    offset, start, nbytes = 0, 0, 0
    i = 0
    while i < len(msg):
        key, i = _read_varint(msg, i)
        field, kind = key >> 3, key & 7
        if kind == 0:
            v, i = _read_varint(msg, i)
            if field == 1:
                offset = v
        elif kind == 2:
            n, i = _read_varint(msg, i)
            if i + n > len(msg):
                raise ValueError("truncated parameter chunk")
            if field == 2:
                start, nbytes = i, n
            i += n
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {kind} in a parameter chunk")
    if i != len(msg):
        raise ValueError("truncated parameter chunk")
    return offset, start, nbytes
