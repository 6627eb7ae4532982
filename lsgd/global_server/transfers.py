"""The global server's calls that move parameters: uploads and downloads of the leader, the
center, sums, deltas and mail, and PLANE=chain's bypasses and digests (a mixin of
``GlobalServicer``, ``servicer.py``, whose lock, coordinator and store they use).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import grpc
import numpy as np

from ..proto import lsgd_pb2 as pb
from ..wire import SMALL_VECTOR
from .buffers import DELTA, MAIL
from .coordinator import CoordinatorError
from .digests import SIZE as DIGEST_SIZE
from .params import AVERAGE, CENTER, LEADER, SUM, ParamError, _wire_dtype

BUFFERS = {pb.BUFFER_KIND_GLOBAL_LEADER: LEADER, pb.BUFFER_KIND_CENTER: CENTER,
           pb.BUFFER_KIND_NODE_SUM: SUM, pb.BUFFER_KIND_AVERAGE: AVERAGE,
           pb.BUFFER_KIND_CENTER_DELTA: DELTA, pb.BUFFER_KIND_MAIL: MAIL}
PULLABLE = {LEADER, CENTER, AVERAGE, MAIL}
SESSION_UPLOADS = {LEADER, SUM}  # a round's own uploads: taken without a wait
WIRES = {pb.WIRE_FORMAT_UNSPECIFIED: "float32", pb.WIRE_FORMAT_BFLOAT16: "bfloat16"}
DEFAULT_CHUNK = 1 << 17  # elements per download chunk when the client names none (512 KiB)
MAX_CHUNK = 1 << 20  # 4 MiB of float32: within the 8 MiB message limit


def _abort(context: grpc.ServicerContext, exc: CoordinatorError | ParamError) -> None:
    context.abort(getattr(grpc.StatusCode, exc.code), str(exc))


class TransferRPCs:
    """Parameter-moving RPCs of ``GlobalServicer`` (its state lives there)."""

    def Bypass(self, request: pb.BypassRequest, context: grpc.ServicerContext) -> pb.DataRoute:
        def bypass() -> pb.DataRoute:
            self._check(request.node)
            index = request.node.node_index
            self.coord._node(index, request.node.session, self.clock())
            before = self.routes.current
            if request.reduce and self.params.settled(request.round_id):
                raise CoordinatorError("FAILED_PRECONDITION", f"the reduce of round "
                                       f"{request.round_id} is over")
            try:
                info = self.routes.bypass(index, request.round_id, request.epoch,
                                          request.stalled, request.why, request.reduce)
            except CoordinatorError as exc:
                if exc.code == "ABORTED":  # a reduce: the round's exchange is skipped now
                    self.params.fail(request.round_id, str(exc))
                raise
            if (before is not None and info is not before
                    and info.feeds_server != before.feeds_server
                    and not self.params.reassign_upload(request.round_id, LEADER,
                                                        before.feeds_server, index)):
                info = self.routes.current = replace(info, feeds_server=before.feeds_server)
            return self.routes.message(info)

        return self._call(context, bypass)

    def Digest(self, request: pb.DigestRequest,
               context: grpc.ServicerContext) -> pb.DigestResponse:
        self.digest_check(request, context)
        return self.digest_answer(request, self.digest_wait)

    def digest_check(self, request: pb.DigestRequest, context: grpc.ServicerContext) -> None:
        """Check a ``Digest`` call, and register the digest it carries (only the source of the
        round's leader route may)."""
        def who() -> int:
            self._check(request.node)
            index = request.node.node_index
            self.coord._node(index, request.node.session, self.clock())
            if len(request.sha256) not in (0, DIGEST_SIZE):
                raise ParamError("INVALID_ARGUMENT", f"a digest is {DIGEST_SIZE} bytes, got "
                                 f"{len(request.sha256)}")
            if request.center and request.sha256:
                raise ParamError("INVALID_ARGUMENT", "the center's digest is the server's own: "
                                 "nobody registers it")
            if request.sha256:  # only the source of the round's leader route registers
                r = self.routes.current
                if r is None or r.round_id != request.round_id or r.reduce or r.route.root != index:
                    raise CoordinatorError("PERMISSION_DENIED", f"node {index} is not the "
                                           f"source of round {request.round_id}'s leader route")
                self.params.digests.register(request.round_id, bytes(request.sha256))
            return index

        self._call(context, who)

    def digest_answer(self, request: pb.DigestRequest, wait: float) -> pb.DigestResponse:
        """The answer to a checked ``Digest`` call, waiting up to ``wait`` seconds for the
        digest asked for (empty: none came)."""
        if request.sha256:
            return pb.DigestResponse(sha256=request.sha256)
        if request.center:  # outside the servicer's lock (the store has its own)
            digest = self.params.center_digest(request.round_id, wait)
        else:
            digest = self.params.digests.get(request.round_id, wait)
        return pb.DigestResponse(sha256=digest or b"")

    def PushParams(self, request_iterator: Iterator[pb.PushParamsRequest],
                   context: grpc.ServicerContext) -> pb.PushParamsResponse:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an upload starts with a header")
        received = 0

        def chunks() -> Iterator[tuple[int, bytes]]:
            nonlocal received
            for req in request_iterator:
                if not req.HasField("chunk"):
                    raise ParamError("INVALID_ARGUMENT", "only chunks may follow the header")
                received += len(req.chunk.data)
                yield req.chunk.offset, req.chunk.data

        try:
            self.take_upload(first.header, chunks(), context)
        finally:
            self.stats.moved(received=received)
        return pb.PushParamsResponse()

    @staticmethod
    def wire_name(code: int) -> str | None:
        return WIRES.get(code)

    def take_upload(self, h: pb.PushHeader, chunks: Iterator[tuple[int, bytes]],
                    context: grpc.ServicerContext, finite: bool = False) -> None:
        """An upload of ``h.buffer`` whose chunks (offset, raw bytes) come from ``chunks``:
        checked, then taken into the store (``PushParams``, the bulk port's, or a whole one on
        a session stream, whose values are ``finite``, checked before)."""
        buffer = BUFFERS.get(h.buffer)
        if buffer is None or buffer == AVERAGE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot upload buffer {h.buffer}")
        wire = WIRES.get(h.wire_format)
        if wire is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown wire format {h.wire_format}")
        self._look(context, lambda: (self._check(h.node),
                                     self.coord.heartbeat(h.node.node_index, h.node.session,
                                                          self.clock())))
        try:
            if buffer == MAIL:
                self._post_mail(h, chunks, wire)
            elif buffer == DELTA:
                if self.params.rule.synchronous:
                    raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} is "
                                     "synchronous: it takes no center deltas")
                self.params.push_delta(h.node.node_index, h.node.session, h.round_id,
                                       h.param_count, chunks, _wire_dtype(wire))
            else:
                self.params.push(h.node.node_index, h.round_id, buffer, h.param_count,
                                 h.summands, chunks, wire=wire, weight=h.weight, finite=finite)
        except ParamError as exc:
            _abort(context, exc)

    def PullParams(self, request: pb.PullParamsRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.ParamChunk]:
        chunk = request.chunk_elements or DEFAULT_CHUNK
        if BUFFERS.get(request.buffer) == MAIL:
            if not 1 <= chunk <= MAX_CHUNK:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk_elements must be in 1..{MAX_CHUNK}, got {chunk}")
            self._look(context, lambda: (self._check(request.node),
                                         self.coord.heartbeat(request.node.node_index,
                                                              request.node.session, self.clock())))
            yield from self._deliver_mail(request, chunk, context)
            return
        sent = 0
        try:
            for offset, data in self.give_download(request, chunk, context)[2]:
                yield pb.ParamChunk(offset=offset, data=data)
                sent += len(data)
        finally:
            self.stats.moved(sent=sent)

    def give_download(self, request: pb.PullParamsRequest, chunk: int,
                      context: grpc.ServicerContext,
                      views: bool = False,
                      stable: bool = False) -> tuple[int, int, Iterator[tuple[int, bytes]]]:
        """A download of ``request.buffer`` (not mail), checked now: (elements, 0 while the
        job's model size is not known, bytes per element on the wire, the chunks). The chunks
        wait until the buffer is ready for the round; a refusal then is ``context.abort`` too.
        ``views``: chunks are views (sent at once, before the next is asked for), not copies:
        of the server's buffer, or with ``stable`` of a staging buffer that no write changes
        (``ParamStore.pull``)."""
        buffer, wire = self._download_checks(request, context)
        if not 1 <= chunk <= MAX_CHUNK:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunk_elements must be in 1..{MAX_CHUNK}, got {chunk}")
        count = self.params.param_count or 0  # 0: not known yet (the chunks will wait)

        def chunks() -> Iterator[tuple[int, bytes]]:
            try:
                yield from self.params.pull(request.round_id, buffer, chunk,
                                            timeout=self.round_timeout, wire=wire, views=views,
                                            stable=stable)
            except ParamError as exc:
                _abort(context, exc)

        return count, _wire_dtype(wire).itemsize, chunks()

    def _download_checks(self, request: pb.PullParamsRequest,
                         context: grpc.ServicerContext) -> tuple[str, str]:
        """A download's checks (not mail): its buffer and wire format."""
        buffer = BUFFERS.get(request.buffer)
        if buffer not in PULLABLE or buffer == MAIL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot download buffer {request.buffer}")
        wire = WIRES.get(request.wire_format)
        if wire is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown wire format {request.wire_format}")
        self._look(context, lambda: (self._check(request.node),
                                     self.coord.heartbeat(request.node.node_index,
                                                          request.node.session, self.clock())))
        return buffer, wire

    # ------------------------------------------------------------------ on a session stream
    def small_download_check(self, request: pb.PullParamsRequest,
                             context: grpc.ServicerContext) -> tuple[str, str]:
        """A download asked for on a ``Session`` stream, checked: (buffer, wire). Only a vector
        of less than ``SMALL_VECTOR`` bytes on the wire comes whole in one reply; a larger
        one, or mail, is refused with what to use instead."""
        if BUFFERS.get(request.buffer) == MAIL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "mail is downloaded with PullParams, not on a session stream")
        buffer, wire = self._download_checks(request, context)
        count = self.params.param_count
        if count is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no node has joined: the job's "
                          "model size is not known yet")
        size = count * _wire_dtype(wire).itemsize
        if size >= SMALL_VECTOR:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a vector of {size} bytes is too large for a session message (less "
                          f"than {SMALL_VECTOR} only): download it with PullParams or on the "
                          "bulk port")
        return buffer, wire

    def small_download(self, request: pb.PullParamsRequest, buffer: str, wire: str,
                       timeout: float) -> bytes | None:
        """The whole of a checked small download (``small_download_check``), once it is ready
        within ``timeout`` seconds (0: now, or None when it is not ready yet); ``ParamError``
        when it never will be, or it changed while read."""
        try:
            data = self.params.pull_whole(request.round_id, buffer, timeout, wire)
        except ParamError as exc:
            if timeout == 0 and exc.code == "DEADLINE_EXCEEDED":
                return None  # not ready yet
            raise
        self.stats.moved(sent=len(data))
        return data

    def SessionPush(self, request: pb.SessionUpload,
                    context: grpc.ServicerContext) -> pb.PushParamsResponse:
        """A small upload on a ``Session`` stream: a round's leader or sum, whole (the other
        uploads may wait, e.g. for another seed of the center, and go on ``PushParams``)."""
        finite = self.small_upload_check(request, context)
        self.take_small_upload(request, context, finite)
        return pb.PushParamsResponse()

    def take_small_upload(self, request: pb.SessionUpload, context: grpc.ServicerContext,
                          finite: bool) -> None:
        """A small upload checked by ``small_upload_check``, taken into the store."""
        try:
            self.take_upload(request.header, iter(((0, request.data),)), context, finite=finite)
        finally:
            self.stats.moved(received=len(request.data))

    def small_upload_check(self, request: pb.SessionUpload, context: grpc.ServicerContext) -> bool:
        """The checks of a small upload that need no round: its buffer, size and values, so
        that a malformed one is refused before it is taken and changes nothing. Returns
        whether its values were found finite (the store need not look again)."""
        h = request.header
        if BUFFERS.get(h.buffer) not in SESSION_UPLOADS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"only a round's leader or sum is uploaded on a session stream, not "
                          f"buffer {h.buffer}: upload it with PushParams")
        if len(request.data) >= SMALL_VECTOR:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a vector of {len(request.data)} bytes is too large for a session "
                          f"message (less than {SMALL_VECTOR} only): upload it with PushParams "
                          "or on the bulk port")
        wire = WIRES.get(h.wire_format)
        count = self.params.param_count
        finite = False
        if wire is not None and count is not None:  # (else take_upload refuses it)
            # The whole vector is here: a wrong size or a non-finite value is refused before
            # the upload is taken, so that it changes nothing (on a stream it fails the round).
            dtype = _wire_dtype(wire)
            if h.param_count != count or len(request.data) != count * dtype.itemsize:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"an upload of {h.param_count} parameters in "
                              f"{len(request.data)} bytes of {wire}; the job's model has {count}")
            values = np.frombuffer(request.data, dtype)
            if not np.isfinite(values).all():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"upload has non-finite values at element "
                              f"{int(np.argmin(np.isfinite(values)))}")
            finite = True  # (the store need not look again)
        return finite

    def SessionPull(self, request: pb.PullParamsRequest,
                    context: grpc.ServicerContext) -> pb.ParamChunk:
        """A small download on a ``Session`` stream of the synchronous server (its thread
        waits, as ``PullParams``'s does)."""
        buffer, wire = self.small_download_check(request, context)
        try:
            data = self.small_download(request, buffer, wire, self.round_timeout)
        except ParamError as exc:
            _abort(context, exc)
        return pb.ParamChunk(offset=0, data=data)

    def _post_mail(self, h: pb.PushHeader, chunks, wire: str) -> None:
        """A gossip rule's mail for a random other node (``mail.py``)."""
        if not getattr(self.params.rule, "gossip", False) or self.params.mail is None:
            raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} sends no mail")
        if h.param_count != self.params.param_count:
            raise ParamError("INVALID_ARGUMENT", f"mail of {h.param_count} parameters; the "
                             f"job's model has {self.params.param_count}")
        with self.cond:
            live = [n.index for n in self.coord.live_nodes]
        self.params.mail.post(h.node.node_index, h.node.session, h.round_id, h.weight, live,
                              chunks, _wire_dtype(wire))

    def _deliver_mail(self, request: pb.PullParamsRequest, chunk: int,
                      context: grpc.ServicerContext) -> Iterator[pb.ParamChunk]:
        """This node's mail, delivery ``round_id`` (``mail.py``); float32 on the wire."""
        try:
            if not getattr(self.params.rule, "gossip", False) or self.params.mail is None:
                raise ParamError("FAILED_PRECONDITION", f"rule {self.params.rule.name} sends no mail")
            if request.wire_format != pb.WIRE_FORMAT_UNSPECIFIED:
                raise ParamError("INVALID_ARGUMENT", "mail is sent as float32")
            vec, weight = self.params.mail.take(request.node.node_index, request.node.session,
                                                request.round_id)
        except ParamError as exc:
            _abort(context, exc)
        if vec is None:
            yield pb.ParamChunk(offset=0, data=b"", weight=0.0)
            return
        sent = 0
        try:
            for lo in range(0, vec.size, chunk):
                data = vec[lo : lo + chunk].tobytes()
                yield pb.ParamChunk(offset=lo, data=data, weight=weight if lo == 0 else 0.0)
                sent += len(data)
        finally:
            self.stats.moved(sent=sent)
