"""``lsgd probe``: is this node's job ready, through gRPC health (a Kubernetes readiness probe).

Node 0 asks its own global server (127.0.0.1:PORT); any other node asks node 0's (IP_ADDR:PORT),
which it cannot train without. Ready: the server answers SERVING for ``lsgd.v1.GlobalServer``.
Exit 0 when ready, 1 (with one line saying why) when not. The node's index comes from
``NODE``, else ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job), else ``SLURM_PROCID``.

TLS as the node uses it (``TLS_CA``; ``TLS_CERT`` and ``TLS_KEY`` under ``MTLS=1``), the name
checked against node 0's certificate being ``IP_ADDR`` also when node 0 asks itself on
127.0.0.1. Health calls need no job secret (``global_server/probes.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .global_server.probes import SERVICE
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


def check(env: Mapping[str, str]) -> tuple[bool, str]:
    """(ready, what was found)."""
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
        answer = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return False, f"node {node}: the global server at {target} did not answer: {exc.details()}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return answer.status == health_pb2.HealthCheckResponse.SERVING, \
        f"node {node}: the global server at {target} is {status}"


def main(env: Mapping[str, str] | None = None) -> int:
    try:
        ready, said = check(os.environ if env is None else env)
    except SecurityError as exc:
        print(f"lsgd probe: {exc}", file=sys.stderr)
        return 1
    print(f"lsgd probe: {said}", file=sys.stdout if ready else sys.stderr)
    return 0 if ready else 1
