"""``lsgd probe``: Kubernetes readiness and liveness probes, through gRPC health.

Node 0 asks its own global server (127.0.0.1:PORT); any other node asks node 0's (IP_ADDR:PORT).
The node's index comes from ``NODE``, else ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job),
else ``SLURM_PROCID``. Exit 0 when the probe passes, 1 (with one line saying why) when not.

- ``lsgd probe`` (readiness): the server answers SERVING for ``lsgd.v1.GlobalServer``; a node
  cannot train without it.
- ``lsgd probe --live`` (liveness): fails only when restarting this node's container can help.
  The server answers NOT_SERVING for ``lsgd.v1.Node/<index>``: it dropped this node more than
  RECONNECT_TIMEOUT + 10 s ago and the node has not joined again, although the probe reaches the
  server, so the node's process or loop is stuck (a node beats only while its loop runs,
  ``Heartbeat``; one cut off by a partition reattaches or exits by itself within
  RECONNECT_TIMEOUT). On node 0 also: its own global server does not answer at all. It passes
  while this container's node has not joined yet (no ``RUN_DIR/node<i>/session``: joining is
  bounded by CONNECT_TIMEOUT, after which the node exits by itself), and, on another node,
  while node 0 does not answer (restarting this node would not bring node 0 back; the node
  exits by itself after RECONNECT_TIMEOUT).

TLS as the node uses it (``TLS_CA``; ``TLS_CERT`` and ``TLS_KEY`` under ``MTLS=1``), the name
checked against node 0's certificate being ``IP_ADDR`` also when node 0 asks itself on
127.0.0.1. Health calls need no job secret (``global_server/probes.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import JobConfig
from .global_server.probes import NODE_SERVICE, SERVICE
from .security import Security, SecurityError, _read_pem

TIMEOUT = 3.0  # seconds for the health call (a probe's own timeout should be a little more)


def _index(env: Mapping[str, str]) -> int:
    for name in ("NODE", "JOB_COMPLETION_INDEX", "SLURM_PROCID"):
        if env.get(name, "") != "":
            try:
                return int(env[name])
            except ValueError:
                raise SecurityError(f"{name}={env[name]!r} is not a whole number") from None
    return 0


def check(env: Mapping[str, str], live: bool = False) -> tuple[bool, str]:
    """(passes, what was found): readiness, or liveness with ``live``."""
    node = _index(env)
    ip_addr, port = env.get("IP_ADDR") or "127.0.0.1", env.get("PORT") or "50051"
    target = f"127.0.0.1:{port}" if node == 0 else f"{ip_addr}:{port}"
    mtls = env.get("MTLS", "0").strip().lower() in ("1", "true", "yes", "on")
    tls = Security(
        ca=_read_pem(env["TLS_CA"], "TLS CA certificate") if env.get("TLS_CA") else None,
        cert=_read_pem(env["TLS_CERT"], "TLS certificate") if mtls and env.get("TLS_CERT") else None,
        key=_read_pem(env["TLS_KEY"], "TLS key", key=True) if mtls and env.get("TLS_KEY") else None,
        mtls=mtls)
    options = [("grpc.ssl_target_name_override", ip_addr)] if tls.ca is not None else []
    channel = tls.channel(target, options)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        if live:
            run_dir = Path(env.get("RUN_DIR") or JobConfig.run_dir)
            return _live(stub, node, target, (run_dir / f"node{node}" / "session").exists())
        return _ready(stub, node, target)
    finally:
        channel.close()


def _ask(stub: health_pb2_grpc.HealthStub, service: str) -> str:
    """The status name the server gives ``service``, or ``NOT_FOUND``; raises ``grpc.RpcError``
    when it does not answer."""
    try:
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return "NOT_FOUND"
        raise
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _ready(stub: health_pb2_grpc.HealthStub, node: int, target: str) -> tuple[bool, str]:
    try:
        status = _ask(stub, SERVICE)
    except grpc.RpcError as exc:
        return False, f"node {node}: the global server at {target} did not answer: {exc.details()}"
    return status == "SERVING", f"node {node}: the global server at {target} is {status}"


def _live(stub: health_pb2_grpc.HealthStub, node: int, target: str,
          joined: bool = True) -> tuple[bool, str]:
    if not joined:
        return True, f"node {node}: not in the job yet (joining is bounded by CONNECT_TIMEOUT)"
    try:
        status = _ask(stub, f"{NODE_SERVICE}{node}")
    except grpc.RpcError as exc:
        if node == 0:
            return False, (f"node 0: its own global server at {target} did not answer: "
                           f"{exc.details()}")
        return True, (f"node {node}: alive as far as can be told: the global server at {target} "
                      f"did not answer ({exc.details()}); the node gives up by itself after "
                      "RECONNECT_TIMEOUT")
    if status == "NOT_SERVING":
        return False, (f"node {node}: the global server at {target} dropped this node and it "
                       "did not come back within RECONNECT_TIMEOUT: its process or its node "
                       "loop is stuck")
    if status == "NOT_FOUND":
        return True, f"node {node}: not in the job yet (joining is bounded by CONNECT_TIMEOUT)"
    return True, f"node {node}: in the job, as the global server at {target} says"


def main(env: Mapping[str, str] | None = None, live: bool = False) -> int:
    try:
        ready, said = check(os.environ if env is None else env, live=live)
    except SecurityError as exc:
        print(f"lsgd probe: {exc}", file=sys.stderr)
        return 1
    print(f"lsgd probe: {said}", file=sys.stdout if ready else sys.stderr)
    return 0 if ready else 1
