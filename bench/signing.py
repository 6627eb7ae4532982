"""The per-call cost of signed calls and of the mutual-TLS node check: ``python -m bench.signing``.

1. In process: signing a typical control request (``AcquireCredits``) on the client, and
   checking it on the server (HMAC-SHA256, SHA-256 of the request, nonce memory).
2. Over loopback, the median round trip of a ``Heartbeat`` against a real global server:
   plaintext without a secret (the baseline) vs plaintext with signed calls; and mutual TLS
   with a secret, with and without the node check (certificates from ``make_certs``).

Round trips are measured in interleaved batches so that drift on a shared machine hits every
variant alike. Not part of ``python -m bench`` (no target); numbers are quoted in the README.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

SECRET = "bench-signing-secret-0123456789abcdef"


def in_process(n: int = 20000) -> dict[str, float]:
    from lsgd.proto import lsgd_pb2 as pb
    from lsgd.signing import Verifier, derive_key, request_bytes, sign

    req = pb.AcquireCreditsRequest(node=pb.NodeId(job_id="job", node_index=3, session=2**62 + 7),
                                   consumed=96, want=128, last_round_seen=41, max_wait_ms=500,
                                   seq=12345)
    key, method = derive_key(SECRET), "/lsgd.v1.GlobalServer/AcquireCredits"
    v = Verifier(SECRET)
    t0 = time.perf_counter()
    sigs = [sign(key, method, request_bytes(req)) for _ in range(n)]
    t1 = time.perf_counter()
    body = req.SerializeToString()
    for s in sigs:
        assert v.check(s, method, body) is None
    t2 = time.perf_counter()
    return {"sign_us": (t1 - t0) / n * 1e6, "check_us": (t2 - t1) / n * 1e6}


def _server(security):
    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer, create_server

    servicer = build_servicer(JobConfig(num_groups=2, workers=1, job_id="job", minutes=30,
                                        iterations=None, node_timeout=60))
    return create_server("127.0.0.1:0", servicer, security=security)


def round_trips(batches: int = 20, per_batch: int = 200) -> dict[str, dict[str, float]]:
    import logging

    from lsgd.local_server.global_client import GlobalClient
    from lsgd.security import Security, make_certs

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        make_certs(Path(tmp) / "c", ["127.0.0.1"])
        d = Path(tmp) / "c"
        mtls = Security(secret=SECRET, ca=(d / "ca.pem").read_bytes(), mtls=True,
                        cert=(d / "node0.pem").read_bytes(), key=(d / "node0-key.pem").read_bytes())
        variants = {"plaintext, no secret": (Security(), None),
                    "plaintext, signed": (Security(secret=SECRET), None),
                    "mTLS, signed, no node check": (mtls, False),
                    "mTLS, signed, node check": (mtls, True)}
        clients, servers = {}, []
        for name, (sec, check) in variants.items():
            srv, port = _server(_NoNodeCheck(sec) if check is False else sec)
            servers.append(srv)
            c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5, security=sec)
            c.join(workers=1, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=10)
            clients[name] = c
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(batches):
            for name, c in clients.items():
                for _ in range(per_batch):
                    t0 = time.perf_counter_ns()
                    c.heartbeat()
                    samples[name].append((time.perf_counter_ns() - t0) / 1000)
        for c in clients.values():
            c.close()
        for srv in servers:
            srv.stop(0)
    return {name: {"median_us": float(np.median(s)), "p90_us": float(np.percentile(s, 90))}
            for name, s in samples.items()}


class _NoNodeCheck:
    """A Security whose server does not check node certificates (for the comparison only)."""

    def __init__(self, security) -> None:
        self._s = security

    def __getattr__(self, name):
        return getattr(self._s, name)

    def server_interceptors(self):
        from lsgd.security import CallCheck

        return [CallCheck(self._s.secret, check_nodes=False)]


if __name__ == "__main__":
    print("in process, per call:", {k: round(v, 2) for k, v in in_process().items()})
    for name, r in round_trips().items():
        print(f"Heartbeat round trip, {name}: median {r['median_us']:.0f} us, "
              f"p90 {r['p90_us']:.0f} us")
