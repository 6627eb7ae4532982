"""Target 3, parameter plane: a 25M-parameter float32 vector (100 MB) between node shared
memory and the global server, through the real protocol, against a plain TCP socket.

What is measured, all in one run:

* **baseline**: a plain TCP socket on 127.0.0.1 between two processes: ``sendall`` of a
  page-aligned 100 MB buffer, ``recv_into`` a preallocated page-aligned buffer, 1-byte ack;
  repeated before the gRPC rounds, after them, and between the data connection's batches.
* **push / pull**: the real global server (``lsgd.global_server.server.process_main``) in a
  subprocess; this process acts as node 0 with ``GlobalClient``: it joins with 25M parameters,
  takes a credit until a global round opens, reports itself as the round's leader, then times
  ``push("global_leader", slot, rid)`` (shm -> server) and ``pull("global_leader", other, rid)``
  (server -> shm), both vectors in a real ``NodeStore`` segment. Median over a few rounds;
  the download is checked equal to the upload. A second, idle node (node 1, no candidate)
  reports in every round: the server expects the leader's upload only in multi-node rounds.
* **peak extra memory** of the client and of the server during one push and one pull: a
  thread samples ``RssAnon`` of both processes every ~1 ms; the value right before the
  transfer (after a warm-up round, so fixed buffers are already touched) is subtracted.
* **bfloat16 wire** (when ``ml_dtypes`` is installed): same rounds with ``wire="bfloat16"``;
  the speed-up over float32 and the largest absolute error of the round trip.
* **PLANE=chain's data connection** node to node (``lsgd/plane/node.py``), without and with a
  job secret, in batches of 3 transfers interleaved with the baseline's.

Standalone: ``PYTHONPATH=. python -m bench.params [--quick]``.
"""

from __future__ import annotations

import json
import logging
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from .common import Result

TARGET = "3. parameter plane"
N = 25_000_000  # float32 parameters
NBYTES = N * 4  # 100 MB
GB, MB = 1e9, 1e6
GOAL_GBPS, GOAL_TCP_FRACTION, GOAL_MEM_MB = 1.0, 0.40, 64.0
PLANE_GOAL = 0.8  # issue 15: bulk transfers node to node at >= 0.8x a plain TCP socket
BENCH_SECRET = "bench secret of 32 characters!!"

# ---------------------------------------------------------------------------- TCP baseline
_TCP_RECEIVER = r"""
import mmap, socket, sys
port, nbytes = int(sys.argv[1]), int(sys.argv[2])
buf = mmap.mmap(-1, nbytes)          # page-aligned, preallocated
buf.write(b"\1" * nbytes)            # touched: no first-touch faults in the timing
view = memoryview(buf)
s = socket.create_connection(("127.0.0.1", port), timeout=30)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    got = 0
    while got < nbytes:
        n = s.recv_into(view[got:], nbytes - got)
        if not n:
            sys.exit(0 if not got else 1)  # EOF between transfers: the sender is done
        got += n
    s.sendall(b"k")
"""


class TcpBaseline:
    """A plain TCP socket to a receiver process; ``send()`` times one 100 MB transfer.

    The connection stays open, so baseline transfers can be spread over the run (before and
    after the gRPC rounds, and right before and after each transfer that is compared with
    them: ``Paired``) and see the same machine conditions.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last: float | None = None  # the newest transfer's time, until something else ran
        self.buf = mmap.mmap(-1, NBYTES)
        np.frombuffer(self.buf, dtype=np.uint8)[:] = 7  # touched before timing
        self.view = memoryview(self.buf)
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(1)
        self.lsock.settimeout(30)
        self.child = subprocess.Popen([sys.executable, "-c", _TCP_RECEIVER,
                                       str(self.lsock.getsockname()[1]), str(NBYTES)])
        self.conn: socket.socket | None = None

    def send(self) -> float:
        """Seconds for one transfer (and its 1-byte acknowledgement)."""
        if self.conn is None:
            self.conn, _ = self.lsock.accept()
            self.conn.settimeout(30)
            self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        self.conn.sendall(self.view)
        if self.conn.recv(1) != b"k":
            raise RuntimeError("TCP receiver broke")
        self.times.append(time.perf_counter() - t0)
        self.last = self.times[-1]
        return self.last

    def apart(self) -> None:
        """Something else ran since the last transfer: a ``Paired`` one needs one of its own
        right before it."""
        self.last = None

    def close(self) -> None:
        try:
            if self.conn is not None:
                self.conn.close()  # the receiver exits at EOF
            self.child.wait(timeout=30)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait(5)
            self.lsock.close()
            self.view.release()
            self.buf.close()


class Paired:
    """Transfers of one path, each timed right between two of the plain socket's.

    Loopback speed on a small VM drifts by half between minutes and comes in two clusters
    (docs/benchmarks.md), so a path's median against the run's median socket time depends on
    where each landed. Here each transfer is compared with the mean of the socket transfers
    just before and just after it (shared with the transfers next to it, of whichever path),
    and the ratio reported is the median of those per-transfer ratios.
    """

    def __init__(self, tcp: TcpBaseline) -> None:
        self.tcp = tcp
        self.path_s: list[float] = []
        self.tcp_s: list[float] = []

    def time(self, transfer: Callable[[], None], keep: bool = True) -> None:
        """Run ``transfer`` between socket transfers; ``keep`` False: a warm-up, not counted."""
        before = self.tcp.last if self.tcp.last is not None else self.tcp.send()
        self.tcp.last = None
        t0 = time.perf_counter()
        transfer()
        took = time.perf_counter() - t0
        after = self.tcp.send()
        if keep:
            self.path_s.append(took)
            self.tcp_s.append((before + after) / 2)

    def ratios(self) -> list[float]:
        """Speed against the socket's, per transfer (above 1: faster than the socket)."""
        return [t / p for p, t in zip(self.path_s, self.tcp_s)]

    def summary(self) -> dict[str, Any]:
        r = sorted(self.ratios())
        q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
        return {"ratio": statistics.median(r), "ratio_q1_q3": [round(q[0], 3), round(q[2], 3)],
                "gbps": NBYTES / statistics.median(self.path_s) / GB,
                "tcp_gbps": NBYTES / statistics.median(self.tcp_s) / GB,
                "seconds": [round(x, 4) for x in self.path_s],
                "tcp_seconds": [round(x, 4) for x in self.tcp_s]}


# ---------------------------------------------------------------------------- memory sampling
def rss_anon(pid: int) -> int:
    """Anonymous resident memory of a process, bytes (``RssAnon`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


class PeakSampler:
    """Samples ``RssAnon`` of some processes every ~1 ms; ``peaks()``: max minus start, bytes."""

    def __init__(self, pids: dict[str, int], period: float = 0.001) -> None:
        self.pids, self.period = pids, period
        self.base = {k: rss_anon(p) for k, p in pids.items()}
        self.peak = dict(self.base)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, p in self.pids.items():
                v = rss_anon(p)
                if v > self.peak[k]:
                    self.peak[k] = v
            self.samples += 1
            time.sleep(self.period)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for k, p in self.pids.items():  # one last look
            self.peak[k] = max(self.peak[k], rss_anon(p))

    def peaks(self) -> dict[str, int]:
        return {k: self.peak[k] - self.base[k] for k in self.pids}


# ---------------------------------------------------------------------------- gRPC path
def start_server(run_dir: str, algorithm: str = "lsgd", workers: int = 1,
                 secret: str | None = None, **knobs: Any) -> tuple[mp.Process, int]:
    """The real global server process (two nodes of ``workers`` workers, a global round every
    step), with the job ``secret`` if given; ``knobs``: more ``JobConfig`` fields."""
    from lsgd.security import Security

    from lsgd.config import JobConfig
    from lsgd.global_server.server import process_main

    config = JobConfig(num_groups=2, workers=workers, l_comm=1, g_comm=1, algorithm=algorithm,
                       iterations=None, minutes=30, port=0, run_dir=run_dir, job_id="bench",
                       round_timeout=30.0, node_timeout=30.0, **knobs)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=process_main, args=(config, child, logging.WARNING,
                                                  Security(secret=secret) if secret else None),
                       name="lsgd-global-bench", daemon=True)
    proc.start()
    child.close()
    if not parent.poll(30):
        proc.kill()
        raise RuntimeError("global server did not start within 30 s")
    status, value = parent.recv()
    if status != "ready":
        raise RuntimeError(f"global server failed: {value}")
    return proc, int(value)


def stop_server(proc: mp.Process) -> None:
    if proc.is_alive():
        proc.terminate()  # SIGTERM: graceful stop
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


class Node:
    """This process acting as the job's nodes: node 0 (one worker) leads every global round.

    A second node (node 1, no eligible candidate) takes part so that the leader's upload is
    needed: the server expects it only when more than one node reported. Each node reports
    ``participants`` participants (the most a node may sum in a round).
    """

    def __init__(self, clients: list[Any], participants: int = 1) -> None:
        self.clients = clients
        self.client = clients[0]
        self.participants = participants
        self.kind = 0  # the kind of the last round opened (lsgd.rules.base.RoundKind)
        self.held = [0] * len(clients)
        self.last_round = 0

    def next_round(self, timeout: float = 20.0, report: bool = True) -> int:
        """Use credits until a new global round opens; report (node 0 leads) unless not
        ``report``; its id."""
        end = time.monotonic() + timeout
        seen = [False] * len(self.clients)
        rid = 0
        while not all(seen):
            if time.monotonic() > end:
                raise RuntimeError(f"no round opened within {timeout:g} s")
            for i, c in enumerate(self.clients):
                if seen[i]:
                    continue
                ans = c.acquire(consumed=self.held[i], late=0, released=0, want=1,
                                last_round_seen=self.last_round, max_wait=0.05)
                self.held[i] = ans.grant
                if ans.round_id > self.last_round:
                    seen[i], rid, self.kind = True, ans.round_id, ans.round_kind
        self.last_round = rid
        if report:
            self.report(rid, timeout)
        return rid

    def report(self, rid: int, timeout: float = 20.0) -> None:
        """Every node reports round ``rid`` at once (node 0 with the best candidate)."""
        from lsgd.leader import Candidate

        answers: dict[int, Any] = {}

        def report(i: int) -> None:
            best = Candidate(0, 1.0) if i == 0 else None
            answers[i] = self.clients[i].report_round(rid, best, self.participants)

        threads = [threading.Thread(target=report, args=(i,)) for i in range(1, len(self.clients))]
        for t in threads:
            t.start()
        report(0)
        for t in threads:
            t.join(timeout)
        out = answers.get(0)
        if out is None or out.missed or out.leader_node != 0 or out.node_count != len(self.clients):
            raise RuntimeError(f"round {rid}: this node does not lead a multi-node round ({out})")


def _wire_kwargs(wire: str) -> dict[str, str]:
    return {} if wire == "float32" else {"wire": wire}


def grpc_rounds(node: Node, src: np.ndarray, dst: np.ndarray, rounds: int, wire: str,
                paired: "dict[str, Paired] | None" = None) -> dict[str, Any]:
    """Time ``rounds`` pushes and pulls (after one warm-up round); check the round trip.
    ``paired`` ("push" and "pull"): each transfer is timed between socket transfers there."""
    kw = _wire_kwargs(wire)
    push_s, pull_s = [], []
    for i in range(rounds + 1):
        rid = node.next_round()
        dst.fill(0.0)  # the check below sees this round's download
        # round 0 warms up the server's buffer, the channel and the allocators
        if paired is not None:
            paired["push"].time(lambda: node.client.push("global_leader", src, rid, **kw), i > 0)
            paired["pull"].time(lambda: node.client.pull("global_leader", dst, rid, **kw), i > 0)
            continue
        t0 = time.perf_counter()
        node.client.push("global_leader", src, rid, **kw)
        t1 = time.perf_counter()
        node.client.pull("global_leader", dst, rid, **kw)
        t2 = time.perf_counter()
        if i:
            push_s.append(t1 - t0)
            pull_s.append(t2 - t1)
    err = _max_abs_error(src, dst)
    top = _max_abs_error(src, np.zeros(0, src.dtype))
    if wire == "float32" and err != 0.0:
        raise AssertionError(f"float32 round trip changed the vector (max error {err})")
    if err > top * 2.0**-8:  # bfloat16 keeps 8 significant bits, rounded to nearest
        raise AssertionError(f"{wire} round trip error {err} exceeds half an ulp of {top}")
    return {"push_s": push_s, "pull_s": pull_s, "max_abs_error": err, "max_abs_value": top}


def _max_abs_error(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> float:
    """max |a - b| chunk by chunk (``b`` empty: max |a|)."""
    worst = 0.0
    for lo in range(0, a.size, chunk):
        d = a[lo : lo + chunk] - b[lo : lo + chunk] if b.size else a[lo : lo + chunk]
        worst = max(worst, float(np.max(np.abs(d))))
    return worst


def memory_round(node: Node, src: np.ndarray, dst: np.ndarray, server_pid: int,
                 wire: str) -> dict[str, int]:
    """Peak extra RssAnon (bytes) of client and server during one push and one pull."""
    kw = _wire_kwargs(wire)
    pids = {"client": os.getpid(), "server": server_pid}
    rid = node.next_round()
    with PeakSampler(pids) as push_mem:
        node.client.push("global_leader", src, rid, **kw)
    with PeakSampler(pids) as pull_mem:
        node.client.pull("global_leader", dst, rid, **kw)
    return {f"{k}_{d}": v for d, s in (("push", push_mem), ("pull", pull_mem))
            for k, v in s.peaks().items()} | {"samples": push_mem.samples + pull_mem.samples}


def bf16_available() -> bool:
    import inspect

    from lsgd.local_server.global_client import GlobalClient

    if "wire" not in inspect.signature(GlobalClient.push).parameters:
        return False
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def _plane_receiver(count: int, secret: str | None, conn: Any) -> None:
    """Node 1 of the data-connection rows: a ``DataPlane`` that takes each round's vector."""
    from lsgd.plane.node import DataPlane

    def refuse(*args: Any) -> Any:
        raise RuntimeError("no bypass here")

    plane = DataPlane(job_id="bench", index=1, count=count, secret=secret, host="127.0.0.1",
                      timeout=60.0, bypass=refuse)
    conn.send(plane.address)
    while (info := conn.recv()) is not None:
        plane.begin(info)
        got = plane.receive()
        conn.send(None if got is None else float(got[-1]))
    plane.close()


def data_connection_rounds(src: np.ndarray, reps: int, secret: str | None,
                           paired: Paired) -> None:
    """PLANE=chain's data connection (``lsgd/plane/node.py``), node 0 -> node 1 on loopback:
    ``reps`` transfers of 100 MB, each timed in ``paired`` from the send's start to node 1's
    acknowledgement (its ``DONE``), node 1 in a process of its own. With a secret every chunk
    carries a MAC (an AES-GMAC of its bytes)."""
    from lsgd.plane.node import DataPlane, RouteInfo, chunk_for
    from lsgd.plane.route import Kind, plan

    def refuse(*args: Any) -> Any:
        raise RuntimeError("no bypass here")

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_plane_receiver, args=(src.size, secret, there), daemon=True)
    child.start()
    plane = DataPlane(job_id="bench", index=0, count=src.size, secret=secret, host="127.0.0.1",
                      timeout=60.0, bypass=refuse)
    try:
        other = here.recv()
        for r in range(1, reps + 1):
            route = plan(Kind.BROADCAST, [0, 1], 0)  # chunks as a job's route has them
            info = RouteInfo(r, route, {0: plane.address, 1: other}, 0,
                             chunk_for(src.size, route.depth()))
            here.send(info)
            plane.begin(info)

            def send() -> None:
                if not plane.send(src):
                    raise RuntimeError("the data connection failed")

            paired.time(send)
            if here.recv() != float(src[-1]):
                raise RuntimeError("the vector arrived changed")
        here.send(None)
    finally:
        plane.close()
        child.join(10)
        if child.is_alive():
            child.kill()


def measure(quick: bool) -> dict[str, Any]:
    from lsgd.local_server.global_client import GlobalClient
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.security import Security

    rounds = 5 if quick else 11
    batches = 2 if quick else 4  # of 3 transfers of each path, each between socket transfers
    out: dict[str, Any] = {"rounds": rounds}
    run_dir = tempfile.mkdtemp(prefix="lsgd-bench-params-")
    layout = StoreLayout.new("bench", 0, N, slots=1, buffers=("global_leader",))
    store = NodeStore.create(layout)
    tcp = proc = None
    clients: list[Any] = []
    try:
        tcp = TcpBaseline()
        for _ in range(2):  # before the gRPC rounds, after them, and between the others
            tcp.send()
        src, dst = store.slot(0), store.buffer("global_leader")
        rng = np.random.default_rng(0)
        for lo in range(0, N, 1 << 22):  # realistic weights; touches the whole segment
            hi = min(lo + (1 << 22), N)
            rng.standard_normal(dtype=np.float32, out=src[lo:hi])
            src[lo:hi] *= np.float32(0.05)
        dst.fill(0.0)
        proc, port = start_server(run_dir)
        out["server_pid"] = proc.pid
        for i in range(2):
            clients.append(GlobalClient(f"127.0.0.1:{port}", "bench", i, round_timeout=30.0))
            clients[i].join(workers=1, param_count=N, algorithm="lsgd", num_groups=2,
                            connect_timeout=20)
        node = Node(clients)
        bulk_port = clients[0].transfers.bulk_port
        if not bulk_port:
            raise RuntimeError("the global server named no bulk port")

        def path(bulk: bool) -> None:  # the same server, its bulk port or its gRPC streams
            for c in clients:
                c.transfers.bulk_port = bulk_port if bulk else 0

        path(False)
        before = {"client": rss_anon(os.getpid()), "server": rss_anon(proc.pid)}
        out["float32"] = grpc_rounds(node, src, dst, rounds, "float32")
        # What the transfers keep for good (heap, gRPC buffers); the server's global-leader
        # vector (100 MB, first written by the first upload) is not counted.
        out["retained"] = {"client": rss_anon(os.getpid()) - before["client"],
                           "server": rss_anon(proc.pid) - before["server"] - NBYTES}
        out["float32"]["memory"] = memory_round(node, src, dst, proc.pid, "float32")
        if bf16_available():
            out["bfloat16"] = grpc_rounds(node, src, dst, rounds, "bfloat16")
            out["bfloat16"]["memory"] = memory_round(node, src, dst, proc.pid, "bfloat16")
        for _ in range(2):
            tcp.send()
        # the bulk port and the gRPC streams in alternating batches, each transfer between two
        # of the socket's
        paired = {key: {way: Paired(tcp) for way in ("push", "pull")}
                  for key in ("bulk", "grpc", "bulk_mac")}
        tcp.apart()
        for _ in range(batches):
            for bulk, key in ((True, "bulk"), (False, "grpc")):
                path(bulk)
                grpc_rounds(node, src, dst, 3, "float32", paired[key])
        path(True)
        out["bulk"], out["grpc"] = ({way: p.summary() for way, p in paired[key].items()}
                                    for key in ("bulk", "grpc"))
        out["bulk"]["memory"] = memory_round(node, src, dst, proc.pid, "float32")
        out["bulk_moved"] = dict(clients[0].transfers.moved)
        # the bulk port of a job with a secret (a MAC per chunk), on a server of its own
        for c in clients:
            c.close()
        clients.clear()
        stop_server(proc)
        proc, port = start_server(run_dir, secret=BENCH_SECRET)
        security = Security(secret=BENCH_SECRET)
        for i in range(2):
            clients.append(GlobalClient(f"127.0.0.1:{port}", "bench", i, round_timeout=30.0,
                                        security=security))
            clients[i].join(workers=1, param_count=N, algorithm="lsgd", num_groups=2,
                            connect_timeout=20)
        node = Node(clients)
        tcp.apart()  # (a server was started since)
        for _ in range(batches):
            grpc_rounds(node, src, dst, 3, "float32", paired["bulk_mac"])
        out["bulk_mac"] = {way: p.summary() for way, p in paired["bulk_mac"].items()}
        if clients[0].transfers.moved["grpc"]:
            raise RuntimeError(f"transfers went over gRPC: {clients[0].transfers.moved}")
        # the data connection's transfers, each between two of the socket's
        plane = {key: Paired(tcp) for key in ("plane", "plane_mac")}
        for _ in range(batches):
            for key, secret in (("plane", None), ("plane_mac", BENCH_SECRET)):
                tcp.apart()  # (a process was started since)
                data_connection_rounds(src, 3, secret, plane[key])
        out.update({key: p.summary() for key, p in plane.items()})
        out["tcp_s"] = tcp.times
    finally:
        if tcp is not None:
            tcp.close()
        for c in clients:
            c.close()
        if proc is not None:
            stop_server(proc)
        store.close(unlink=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _paired_row(what: str, p: dict[str, Any], extra: dict[str, Any] | None = None) -> Result:
    """A path timed by ``Paired``: its speed, and the median of its per-transfer ratios to the
    socket transfers right before and after each (the goal's measure)."""
    return Result(
        TARGET, what, round(p["gbps"], 3), "GB/s", baseline=round(p["tcp_gbps"], 3),
        baseline_name="plain TCP socket, 100 MB sendall/recv_into, right before and after "
                      "each transfer",
        ratio=round(p["ratio"], 3),
        ratio_note="median of per-transfer ratios (socket time / path time)",
        goal=f">= {PLANE_GOAL:.0%} of TCP (issue 15)", met=p["ratio"] >= PLANE_GOAL,
        extra={**{k: p[k] for k in ("ratio_q1_q3", "seconds", "tcp_seconds")}, **(extra or {})})


def run(quick: bool) -> list[Result]:
    m = measure(quick)
    tcp = NBYTES / statistics.median(m["tcp_s"]) / GB
    f32 = m["float32"]
    mem = f32["memory"]
    results = []
    for way, key, what in (("push", "push_s", "shm -> global server (PushParams)"),
                           ("pull", "pull_s", "global server -> shm (PullParams)")):
        gbps = NBYTES / statistics.median(f32[key]) / GB
        ratio = gbps / tcp
        results.append(Result(
            TARGET, f"{way} 100 MB float32, {what}", round(gbps, 3), "GB/s",
            baseline=round(tcp, 3), baseline_name="plain TCP socket, 100 MB sendall/recv_into",
            ratio=round(ratio, 3), ratio_note="value / baseline",
            goal=f">= {GOAL_GBPS} GB/s and >= {GOAL_TCP_FRACTION:.0%} of TCP",
            met=gbps >= GOAL_GBPS and ratio >= GOAL_TCP_FRACTION,
            extra={"seconds": [round(s, 4) for s in f32[key]],
                   "tcp_seconds": [round(s, 4) for s in m["tcp_s"]], "rounds": m["rounds"]}))
    for way in ("push", "pull"):
        bulk, grpc_ = m["bulk"][way], m["grpc"][way]
        results.append(_paired_row(
            f"{way} 100 MB float32 on the server's bulk port (BULK_PORT)", bulk,
            {"grpc_same_batches": {k: grpc_[k] for k in ("ratio", "ratio_q1_q3", "gbps")},
             "vs_grpc": round(bulk["gbps"] / grpc_["gbps"], 3),
             "peak_extra_mb": {side: round(m["bulk"]["memory"][f"{side}_{way}"] / MB, 1)
                               for side in ("client", "server")},
             "transfers": m["bulk_moved"]}))
        results.append(_paired_row(
            f"{way} 100 MB float32 on the bulk port, job secret (a MAC per chunk)",
            m["bulk_mac"][way]))
    for key, what in (("plane", "no secret (a loopback job)"),
                      ("plane_mac", "job secret: a MAC per chunk (AES-GMAC of its bytes)")):
        results.append(_paired_row(
            f"PLANE=chain data connection, 100 MB node to node, {what}", m[key]))
    for side in ("client", "server"):
        peak = max(mem[f"{side}_push"], mem[f"{side}_pull"]) / MB
        results.append(Result(
            TARGET, f"peak extra memory ({side}) during a 100 MB push/pull", round(peak, 1), "MB",
            baseline=NBYTES / MB, baseline_name="model size",
            ratio=round(peak / (NBYTES / MB), 3), ratio_note="value / model size",
            goal=f"<= {GOAL_MEM_MB:g} MB", met=peak <= GOAL_MEM_MB,
            extra={"push_mb": round(mem[f"{side}_push"] / MB, 1),
                   "pull_mb": round(mem[f"{side}_pull"] / MB, 1),
                   "samples": mem["samples"],
                   "retained_after_first_transfers_mb": round(m["retained"][side] / MB, 1),
                   "note": "peak RssAnon during the transfer minus RssAnon right before it, "
                           "after warm-up rounds; retained_*: RssAnon growth from before the "
                           "first transfer (server: beyond its 100 MB leader vector)"}))
    bf = m.get("bfloat16")
    if bf is None:
        results.append(Result(TARGET, "bfloat16 wire (ml_dtypes not installed or not supported)",
                              float("nan"), "x", met=None))
    else:
        t32 = statistics.median(f32["push_s"]) + statistics.median(f32["pull_s"])
        t16 = statistics.median(bf["push_s"]) + statistics.median(bf["pull_s"])
        bmem = bf["memory"]
        results.append(Result(
            TARGET, "bfloat16 wire: push+pull of 100 MB float32 (50 MB on the wire)",
            round(2 * NBYTES / t16 / GB, 3), "GB/s", baseline=round(2 * NBYTES / t32 / GB, 3),
            baseline_name="float32 wire, same run", ratio=round(t32 / t16, 3),
            ratio_note="speed-up (float32 time / bfloat16 time)", met=None,
            extra={"max_abs_error": bf["max_abs_error"], "max_abs_value": bf["max_abs_value"],
                   "wire_bytes_per_transfer": NBYTES // 2,
                   "push_gbps_f32_equiv": round(NBYTES / statistics.median(bf["push_s"]) / GB, 3),
                   "pull_gbps_f32_equiv": round(NBYTES / statistics.median(bf["pull_s"]) / GB, 3),
                   "peak_extra_mb": {k: round(v / MB, 1) for k, v in bmem.items()
                                     if k != "samples"}}))
        results.append(Result(
            TARGET, "bfloat16 wire: max absolute error of a round trip (weights ~ N(0, 0.05))",
            bf["max_abs_error"], "abs", met=None))
    return results


if __name__ == "__main__":
    t0 = time.perf_counter()
    res = run("--quick" in sys.argv)
    for r in res:
        print(json.dumps(r.to_dict()))
    print(f"# {time.perf_counter() - t0:.1f} s", file=sys.stderr)
