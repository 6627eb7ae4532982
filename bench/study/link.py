"""The study's communication model, measured in the same run: the latency and bandwidth of a
parameter transfer through the real global server (``bench.params``' harness, on loopback).

A transfer of ``b`` bytes (one push, or one pull) is modelled as ``latency + b / bandwidth``:
the median push+pull time of a tiny vector gives twice the latency, and the difference between
a large and a tiny vector gives the bandwidth. ``report.py`` charges each rule's exchanges with
this model (docs/study.md, "The time axis").
"""

from __future__ import annotations

import shutil
import statistics
import tempfile

import numpy as np

TINY, LARGE = 1 << 10, 1 << 22  # float32 elements: 4 KB and 16 MB


def measure(quick: bool = False) -> dict[str, float]:
    """{"latency_s": one transfer's fixed cost, "bandwidth_Bps": bytes per second}."""
    from lsgd.local_server.global_client import GlobalClient
    from lsgd.local_server.store import NodeStore, StoreLayout

    from ..params import Node, grpc_rounds, start_server, stop_server

    rounds = 5 if quick else 15
    out: dict[str, float] = {}
    times: dict[int, float] = {}
    for n in (TINY, LARGE):
        run_dir = tempfile.mkdtemp(prefix="lsgd-study-link-")
        layout = StoreLayout.new("studylink", 0, n, slots=1, buffers=("global_leader",))
        store = NodeStore.create(layout)
        proc, clients = None, []
        try:
            src, dst = store.slot(0), store.buffer("global_leader")
            src[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
            proc, port = start_server(run_dir)
            for i in range(2):
                clients.append(GlobalClient(f"127.0.0.1:{port}", "bench", i, round_timeout=30.0))
                clients[i].join(workers=1, param_count=n, algorithm="lsgd", num_groups=2,
                                connect_timeout=20)
            got = grpc_rounds(Node(clients), src, dst, rounds, "float32")
            times[n] = statistics.median(a + b for a, b in zip(got["push_s"], got["pull_s"])) / 2
        finally:
            for c in clients:
                c.close()
            if proc is not None:
                stop_server(proc)
            store.close(unlink=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    out["latency_s"] = times[TINY]
    out["bandwidth_Bps"] = 4 * (LARGE - TINY) / max(times[LARGE] - times[TINY], 1e-9)
    out["transfer_s_tiny"], out["transfer_s_large"] = times[TINY], times[LARGE]
    return out


if __name__ == "__main__":
    print(measure(quick=True))
