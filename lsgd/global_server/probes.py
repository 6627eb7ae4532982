"""gRPC health checking and server reflection on the global server.

``grpc.health.v1.Health`` answers SERVING for the services "" and ``lsgd.v1.GlobalServer`` from
the moment the server listens (waiting for nodes included: the server is up), and NOT_SERVING
once the job has finished or was stopped, and while the server shuts down. It also answers
``Check`` for one node, ``lsgd.v1.Node/<index>`` (a liveness probe, ``lsgd probe --live``):
SERVING while that node is in the job (or has left it, or was dropped less than
``servicer.drop_grace`` ago), NOT_SERVING once it has been dropped for longer without joining
again, NOT_FOUND when no node of that index ever joined. A node
beats only while its node loop runs (``Heartbeat``), so a node whose process is up but whose loop
is stuck is dropped, and its probe fails. Server reflection
(``grpc.reflection.v1alpha``) lets ``grpcurl`` list and call the services without the proto.

A probe has no job secret: ``security.CallCheck`` lets exactly these two services through
unsigned (under mutual TLS a probe still needs a client certificate from the job's CA: that is
checked by TLS itself, before any call). They change nothing, and cannot take the server's
threads: a health ``Watch`` runs without holding a thread (grpc's non-blocking mode), and
reflection streams are capped at ``MAX_REFLECTION`` at a time, each cancelled after
``REFLECTION_LIFETIME`` seconds.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from ..proto import lsgd_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GlobalServer"].full_name  # "lsgd.v1.GlobalServer"
MAX_REFLECTION = 4  # reflection streams open at once
REFLECTION_LIFETIME = 30.0  # seconds one reflection stream may stay open
NODE_SERVICE = "lsgd.v1.Node/"  # + a node index: that node's health (Check only)
MAX_INDEX_DIGITS = 6


class _JobHealth(health.HealthServicer):
    """The standard health service, plus ``Check`` of ``lsgd.v1.Node/<index>`` answered from
    ``node_health(index)``: True (in the job), False (dropped), None (never joined)."""

    def __init__(self, node_health: Callable[[int], Optional[bool]] | None) -> None:
        super().__init__()  # non-blocking Watch (the default): no thread held
        self._node_health = node_health

    def Check(self, request, context):  # noqa: ANN001, N802 - grpc API
        if not request.service.startswith(NODE_SERVICE) or self._node_health is None:
            return super().Check(request, context)
        digits = request.service[len(NODE_SERVICE):]
        if not (digits.isdigit() and digits.isascii() and len(digits) <= MAX_INDEX_DIGITS):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"unknown service {request.service[:64]!r}: a node is "
                          f"{NODE_SERVICE}<index>")
        alive = self._node_health(int(digits))
        if alive is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"node {int(digits)} never joined this job")
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if alive
            else health_pb2.HealthCheckResponse.NOT_SERVING)


class _BoundedReflection(reflection.ReflectionServicer):
    """Server reflection whose streams cannot pile up (each holds one of the server's threads)."""

    def __init__(self, service_names: tuple[str, ...]) -> None:
        super().__init__(service_names)
        self._lock = threading.Lock()
        self._open = 0

    def ServerReflectionInfo(self, request_iterator, context):  # noqa: ANN001, N802 - grpc API
        with self._lock:
            busy = self._open >= MAX_REFLECTION
            if not busy:
                self._open += 1
        if busy:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_REFLECTION} reflection streams are open; try again later")
        timer = threading.Timer(REFLECTION_LIFETIME, context.cancel)
        timer.daemon = True
        timer.start()
        try:
            yield from super().ServerReflectionInfo(request_iterator, context)
        finally:
            timer.cancel()
            with self._lock:
                self._open -= 1


def add_probes(server: grpc.Server, serving: bool = True,
               node_health: Callable[[int], Optional[bool]] | None = None) -> Callable[[bool], None]:
    """Add health checking and reflection to ``server`` (before it starts); ``node_health``
    answers for one node (``_JobHealth``).

    Returns ``set_serving(bool)``, which sets the health of "" and ``lsgd.v1.GlobalServer``.
    """
    checker = _JobHealth(node_health)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(_BoundedReflection(names), server)

    def set_serving(up: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if up
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE):
            checker.set(name, status)

    set_serving(serving)
    return set_serving
