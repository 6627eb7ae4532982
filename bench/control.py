"""Target 1, control plane: the worker-observed cost of the per-iteration request.

lsgd: ``worker.step`` timed around every call in a real node (2 workers, no training), so the
number includes the rare credit refills and rounds. Baseline, measured in the same run: the
reference design's per-iteration relay (worker -> multiprocessing.Queue -> local relay process
-> unary gRPC to the global server -> back). Also: global-server calls per 1,000 iterations
with 1, 2 and 4 nodes.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import Result, lsgd_env, read_json, run_node

TARGET = "1. control plane"


def _relay_server(port_q) -> None:
    import logging

    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer, create_server

    logging.disable(logging.WARNING)
    servicer = build_servicer(JobConfig(minutes=30, iterations=None, job_id="relay"))
    server, port = create_server("127.0.0.1:0", servicer)
    port_q.put(port)
    time.sleep(3600)


def _relay(port: int, inbox, outbox) -> None:
    from lsgd.local_server.global_client import GlobalClient

    client = GlobalClient(f"127.0.0.1:{port}", "relay", 0, round_timeout=5)
    client.join(workers=2, param_count=1000, algorithm="lsgd", num_groups=1, connect_timeout=10)
    while True:
        msg = inbox.get(timeout=30)
        if msg is None:
            return
        client.heartbeat()  # one tiny unary round trip to the global server per iteration
        outbox.put(msg)


def _relay_worker(n: int, inbox, outbox, result_q) -> None:
    clock = time.perf_counter_ns
    ns = np.zeros(n, np.int64)
    for i in range(n):
        t0 = clock()
        inbox.put(i)
        outbox.get(timeout=30)
        ns[i] = clock() - t0
    result_q.put(ns)


def relay_baseline(n: int) -> np.ndarray:
    """Per-iteration latencies (ns) of the reference per-iteration relay."""
    ctx = mp.get_context("spawn")
    port_q, inbox, outbox, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_relay_server, args=(port_q,), daemon=True)
    server.start()
    procs = [server]
    try:
        port = port_q.get(timeout=30)
        relay = ctx.Process(target=_relay, args=(port, inbox, outbox), daemon=True)
        worker = ctx.Process(target=_relay_worker, args=(n, inbox, outbox, result_q), daemon=True)
        procs += [relay, worker]
        relay.start()
        worker.start()
        ns = result_q.get(timeout=120)
        inbox.put(None)
        return ns
    finally:
        for p in procs:
            p.terminate()
            p.join(5)


def lsgd_steps(iterations: int, run_dir: Path) -> np.ndarray:
    env = lsgd_env(ENTRY="bench.jobs:step_timer", ITERATIONS=iterations, PORT=0, WORKERS=2,
                   RUN_DIR=run_dir, JOB_ID="benchctl")
    node = run_node(0, env, timeout=300)
    if node.wait(300) != 0:
        raise RuntimeError(f"lsgd run failed: {(run_dir / 'node0.log').read_text()[-2000:]}")
    return np.concatenate([np.load(p) for p in sorted(run_dir.glob("step_ns-*.npy"))])


def calls_per_1000(nodes: int, iterations: int, run_dir: Path) -> tuple[float, float, dict]:
    """(calls per 1,000 iterations, rounds per 1,000 iterations, call counts) for ``nodes`` nodes."""
    knobs = dict(ENTRY="bench.jobs:step_timer", ITERATIONS=iterations, WORKERS=2,
                 NUM_GROUPS=nodes, RUN_DIR=run_dir, JOB_ID=f"benchcalls{nodes}")
    procs = [run_node(0, lsgd_env(PORT=0, **knobs), timeout=300)]
    port_file = run_dir / "global.port"
    end = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < end:
        time.sleep(0.05)
    port = int(port_file.read_text())
    procs += [run_node(i, lsgd_env(PORT=port, **knobs), timeout=300) for i in range(1, nodes)]
    try:
        for i, p in enumerate(procs):
            if p.wait(300) != 0:
                raise RuntimeError(f"node {i} failed: {(run_dir / f'node{i}.log').read_text()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    summary = read_json(run_dir / "global" / "summary.json")
    calls = summary["calls"]
    total = sum(calls.values())
    return 1000 * total / summary["counter"], 1000 * summary["rounds"] / summary["counter"], calls


def run(quick: bool) -> list[Result]:
    n_relay = 1000 if quick else 3000
    iterations = 20000 if quick else 100000
    base = relay_baseline(n_relay)
    with tempfile.TemporaryDirectory() as tmp:
        ours = lsgd_steps(iterations, Path(tmp) / "steps")
        calls = {k: calls_per_1000(k, (5000 if quick else 20000) * k, Path(tmp) / f"calls{k}")
                 for k in (1, 2, 4)}
    med_ours, med_base = float(np.median(ours)) / 1000, float(np.median(base)) / 1000
    mean_ours = float(np.mean(ours)) / 1000
    ratio = med_base / med_ours
    mean_base = float(np.mean(base)) / 1000
    out = [Result(TARGET, "worker-observed cost of worker.step() between rounds, median "
                          "(2 workers, no training)", med_ours, "us",
                  baseline=med_base, baseline_name="per-iteration relay (queue + unary gRPC)",
                  ratio=ratio, ratio_note="baseline / lsgd", goal="<= 50 us and >= 15x below",
                  met=med_ours <= 50 and ratio >= 15,
                  extra={"p99_us": float(np.percentile(ours, 99)) / 1000, "mean_us": mean_ours,
                         "baseline_p99_us": float(np.percentile(base, 99)) / 1000,
                         "iterations": int(ours.size), "baseline_iterations": n_relay}),
           Result(TARGET, "worker.step() mean over all steps, refills and rounds included (no "
                          "training, so a round every 64 steps of each worker)", mean_ours, "us",
                  baseline=mean_base, baseline_name="per-iteration relay, mean",
                  ratio=mean_base / mean_ours, ratio_note="baseline / lsgd", met=None,
                  extra={"p99_us": float(np.percentile(ours, 99)) / 1000,
                         "baseline_p99_us": float(np.percentile(base, 99)) / 1000})]
    for k, (per1000, rounds, counts) in calls.items():
        out.append(Result(TARGET, f"global-server calls per 1,000 iterations, {k} node(s) x 2 workers",
                          per1000, "calls", baseline=1000.0,
                          baseline_name="per-iteration relay (1 call per iteration)",
                          ratio=1000.0 / per1000, ratio_note="baseline / lsgd",
                          goal="O(rounds x nodes)", met=None,
                          extra={"rounds_per_1000": rounds, "calls": counts}))
    return out


if __name__ == "__main__":
    for r in run(quick=True):
        print(r)
