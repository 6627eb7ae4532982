"""The ``Session`` stream: a node loop's credit, round and digest calls, one stream per node
session.

A unary call costs the server far more than a message on an open stream (HTTP/2 stream set-up,
metadata, the interceptors, a thread hand-off: ``../shared/reference/limits.md``), and the node
loop makes its calls one at a time anyway. So a node opens one stream and sends each
``AcquireCredits`` / ``ReportRound`` / ``Digest`` on it, and its transfers of small vectors
(less than 1 MiB on the wire, ``lsgd.wire.SMALL_VECTOR``: a download's reply carries the vector
whole, and so does an upload of a round's leader or sum, where ``PullParams`` / ``PushParams``
would open a stream of their own); the server answers each with one reply.

- Message 0 opens the stream: the node and a 16-byte nonce. The stream's signature covers it;
  ``lsgd.security.CallCheck`` checks every later message's MAC (``lsgd.signing``).
- Messages 1, 2, 3, ... each carry exactly one serialized call, for the opening's node. A number
  out of order ends the stream (INVALID_ARGUMENT): that is a replay or a broken client.
- A call runs through the same servicer method as its unary form, with a context whose
  ``abort`` refuses that call only: the reply carries the status code and details, and the
  node sees them as the call's ``grpc.RpcError``. The stream goes on.
- A long-poll or a round barrier blocks only its own stream, as it blocked its call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import grpc
from google.protobuf.message import DecodeError

from ..proto import lsgd_pb2 as pb
from .coordinator import CoordinatorError

if TYPE_CHECKING:
    from .servicer import GlobalServicer

NONCE_BYTES = 16


class Refused(Exception):
    """One call on a stream was refused with ``code`` (the stream goes on)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """The ``ServicerContext`` a call on a stream sees: ``abort`` refuses this call, not the
    stream; liveness and the peer are the stream's."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(code, details)

    def is_active(self) -> bool:
        return self._context.is_active()

    def peer(self) -> str:
        return self._context.peer()


# A message's call field -> (the method, its request type).
CALLS = {"acquire": ("AcquireCredits", pb.AcquireCreditsRequest),
         "report": ("ReportRound", pb.ReportRoundRequest),
         "digest": ("Digest", pb.DigestRequest),
         "pull": ("PullParams", pb.PullParamsRequest),
         "push": ("PushParams", pb.SessionUpload),
         "leave": ("Leave", pb.LeaveRequest)}
# A call whose servicer method is not its unary form's (a small vector moves whole).
HANDLERS = {"pull": "SessionPull", "push": "SessionPush"}


def opening_error(first: pb.SessionRequest | None) -> str | None:
    """Why ``first`` cannot open a session stream (None: it can)."""
    if first is None:
        return "a session stream opens with message 0"
    if (first.n != 0 or not first.HasField("node") or len(first.nonce) != NONCE_BYTES
            or any(getattr(first, f) for f in CALLS)):
        return (f"a session stream opens with message 0: the node and a {NONCE_BYTES}-byte "
                "nonce, and no call")
    return None


def serve(servicer: "GlobalServicer", requests: Iterator[pb.SessionRequest],
          context: grpc.ServicerContext) -> Iterator[pb.SessionReply]:
    """Answer one node's session stream until the node closes it."""
    first = next(requests, None)
    why = opening_error(first)
    if why:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    node = first.node
    try:
        with servicer.cond:
            servicer._check(node)
            servicer.coord._node(node.node_index, node.session, servicer.clock())
    except CoordinatorError as exc:
        context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    if servicer.admission is not None:  # the node's stream now (its older one is cancelled)
        servicer.admission.bind_session(context, node.node_index, node.session)
    expected = 1
    for req in requests:
        if req.n != expected:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"session message {req.n} out of order (expected {expected})")
        expected += 1
        try:
            field, answer = _answer(servicer, node, req, CallContext(context))
            servicer.calls.add(method_of(req))
            yield pb.SessionReply(n=req.n, **{field: answer})
        except Refused as r:
            servicer.stats.count(method_of(req), r.code.name)
            yield pb.SessionReply(n=req.n, code=r.code.value[0], details=r.details)


def _fields(req: pb.SessionRequest) -> list[str]:
    return [f for f in CALLS if getattr(req, f)]


def method_of(req: pb.SessionRequest) -> str:
    """The method a session message's call counts under (refusals included)."""
    fields = _fields(req)
    return CALLS[fields[0]][0] if fields else "ReportRound"


def parse_call(node: pb.NodeId, req: pb.SessionRequest) -> tuple[str, object]:
    """The call a session message carries, for this stream's ``node``: (its field, the parsed
    request); ``Refused`` when there is not exactly one, it does not parse, or it is another
    node's or session's. Both servers' streams read their messages with it."""
    fields = _fields(req)
    if len(fields) != 1:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"session message {req.n} must carry exactly one call")
    field = fields[0]
    try:
        call = CALLS[field][1].FromString(getattr(req, field))
    except DecodeError:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"session message {req.n}: its call does not parse") from None
    who = call.header.node if field == "push" else call.node
    if who != node:
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"session message {req.n} is for node {who.node_index} session "
                      f"{who.session}; this stream is node {node.node_index} session "
                      f"{node.session}'s (open a stream per session)")
    return field, call


def _answer(servicer: "GlobalServicer", node: pb.NodeId, req: pb.SessionRequest,
            ctx: CallContext) -> tuple[str, object]:
    """The reply's field and the call's answer; ``Refused`` when it is refused."""
    field, call = parse_call(node, req)
    return field, getattr(servicer, HANDLERS.get(field, CALLS[field][0]))(call, ctx)
