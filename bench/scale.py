"""Target 2, global server scale: 64 simulated nodes x 8 workers run rounds on one global server.

The real global server (``lsgd.global_server.server.serve``) runs in its own process. The nodes
are simulated: each is one thread driving a real ``GlobalClient`` (its own gRPC channel) and a
real ``Heartbeat`` thread, and speaks the node's side of the protocol without training:

    join -> loop { AcquireCredits(consumed=<last grant>, want=large, last_round_seen)
                   grant: "the 8 workers use it" (sleep ceil(grant/8) * step_ms)
                   round: ReportRound for GLOBAL and FINAL rounds (a LOCAL round is the
                          node's own, as in the local server); GLOBAL with more than one node: the leader's node pushes global_leader, the others
                          pull it; FINAL: leader pushes global_leader, every node pushes its
                          sum (summands=8), node 0 pulls global_leader and average; then Leave;
                          the round's answer may carry a grant too, used after the round }

Clients are Python and GIL-bound, so the 64 nodes are split over 2 client processes x 32
threads (the machine has 2 cores: more processes would only add scheduling contention, one
process would put all client-side protobuf work on one GIL). The client processes' CPU is
measured too, to show they are not what limits the server.

Round latency, per node and round: from the moment the node learns of the round (the
AcquireCredits answer that names it) to the end of its part (ReportRound answered and its
parameter exchange done). Server CPU: user+sys seconds of the server process over the measured
window (first grant of the job to the last node's final round), sampled from /proc.

Scenarios, each on a fresh server:
  64x8        2 ms per worker step (32 ms of work per round): a stress run, the server sets the
              pace. Node 63 joins 1.5 s late; the server's CPU while the other 63 long-poll with
              nothing to do is reported too (it should be a few %).
  1x8         the baseline, same run and step time (one node has only global rounds, and keeps
              its leader at home: no upload).
  64x8-paced  full mode only: 20 ms steps (320 ms of work per round), a server with headroom.

The status page's cost (``--status``, issue 10; ``bench/status_page.py``): the paced 64 x 8 run
without reports and status page, and with a report in every heartbeat (``_Beat``) and a browser
polling the page every second; the global server's CPU in both.

Standalone: ``PYTHONPATH=. python -m bench.scale [--quick] [--status]``;
``python -m bench.scale --sweep 64 256 512``: the paced scenario at each node count (issue 15);
``... --sweep 64 256 --against REV`` runs revision REV's sweep too, count by count, and prints
the ratios. ``--nodes-on asyncio``: the simulated nodes as tasks of one event loop per client
process (``bench/scale_aio.py``; they cost the host about half what the threads cost);
``--nodes-on uvloop``: the same on uvloop's event loop (the ``bench`` extra), which takes the
simulated nodes' core off the pace at 512 nodes (``rounds_cpu_pct`` shows each side's share);
``--sessions both``: each count once with the nodes' streams on the synchronous server
(``SESSION_PORT=0``) and once on the asyncio one, in the same run. ``--pin``: the server on the
first CPU, the simulated nodes on the others, so that they do not take the server's core.
``--params N``: N float32 elements in each exchanged vector (default 4096: 16 KiB).
``--repeat K``: the sweep K times, then each count's spread over the runs (issue 15's p99 is a
target for every run).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, Result, cpu_seconds

TARGET = "2. global server scale"
JOB_ID = "scale"
WANT = 1 << 30  # nodes ask for "everything"; the server caps grants at half a fair share
PARAM_COUNT = 4096  # float32 elements (16 KiB) per parameter exchange
CLIENT_PROCS = 2


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    workers: int
    l_comm: int
    g_comm: int
    rounds: int  # rounds opened in the job, the final one included
    step_ms: float  # modelled duration of one SGD step of a worker (sleep, no CPU)
    param_count: int = PARAM_COUNT
    late_join_s: float = 0.0  # the last node joins this late: the others long-poll meanwhile
    round_timeout: float = 30.0
    nodes_on: str = "threads"  # the simulated nodes: "threads" (GlobalClient), "asyncio", "uvloop"
    session_port: int | None = None  # the server's SESSION_PORT (None: its default; 0: off)
    node_timeout: float = 10.0
    join_timeout: float = 60.0
    limit_s: float = 90.0  # hard bound on the whole scenario
    reports: bool = False  # heartbeats carry a NodeReport of the node's workers
    status: bool = False  # the global server serves its status page (STATUS_PORT)
    poll_s: float = 0.0  # a browser polls the status page this often (0: nobody)
    pin: bool = False  # the server on CPU 0, the simulated nodes on the others (``--pin``)

    @property
    def round_period(self) -> int:
        """Global iterations between two rounds (local ones if the job has them)."""
        per_worker = self.l_comm if self.nodes > 1 else self.g_comm
        return self.nodes * self.workers * per_worker

    @property
    def iterations(self) -> int:
        return self.rounds * self.round_period


# ---------------------------------------------------------------------------------- node side
class _Beat(threading.Thread):
    """A node's heartbeat thread, as the local server's: every ``interval`` s (skipped as the
    local server skips it while the node's own calls are answered), on the node's
    channel, with (``sc.reports``) a ``NodeReport`` of its workers built from ``live`` (steps,
    newest round) as the local server's view would: losses, distances to the leader, a local
    leader, and on node 0 one evaluation per global round (sent until the server holds it)."""

    def __init__(self, client: Any, sc: "Scenario", live: dict[str, Any]) -> None:
        super().__init__(daemon=True, name=f"beat{client.node_index}")
        from lsgd.proto import lsgd_pb2_grpc

        self.client, self.sc, self.live = client, sc, live
        self.stub = lsgd_pb2_grpc.GlobalServerStub(client._channel)  # the node's own channel
        self.interval = min(1.0, sc.node_timeout / 5)
        self.fatal: str | None = None
        self.halt = threading.Event()
        self.held = 0  # evaluations the server holds
        self.rng = random.Random(client.node_index)

    def report(self) -> Any:
        from lsgd.proto import lsgd_pb2 as pb

        i, w, rnd = self.client.node_index, self.sc.workers, self.live["round"]
        r = pb.NodeReport(steps=self.live["steps"], rate=self.live["steps"] / max(
            1e-3, time.monotonic() - self.live["t0"]), workers_training=w, has_local_leader=True)
        losses = [2.0 / (1 + 0.01 * rnd) + 0.1 * self.rng.random() for _ in range(w)]
        best = min(range(w), key=losses.__getitem__)
        for k in range(w):
            r.workers.append(pb.WorkerStat(
                worker_id=i * w + k, iterations=self.live["steps"] // w, loss=losses[k],
                distance=0.0 if k == best else self.rng.random(),
                distance_to="local_leader" if self.live["kind"] == "local" else "global_leader",
                training=True, round_id=rnd))
        r.local_leader.worker_id, r.local_leader.loss = i * w + best, losses[best]
        if i == 0:
            evals = self.live["evaluations"]
            r.evaluations_from = self.held
            for rid, it in evals[self.held:self.held + 64]:
                r.evaluations.append(pb.Evaluation(round_id=rid, iteration=it, target="leader",
                                                   metric="accuracy", value=min(1.0, rid / 100),
                                                   worker_id=best))
        return r

    def run(self) -> None:
        from lsgd.proto import lsgd_pb2 as pb

        from lsgd.local_server.heartbeat import REPORT_EVERY

        beaten = -math.inf
        while not self.halt.wait(self.interval):
            c = self.client
            now = time.monotonic()  # as the local server's Heartbeat: skipped while the node's
            if (now - c.answered_at < self.interval  # own calls keep it alive, down to one
                    and now - beaten < REPORT_EVERY * self.interval):  # beat in REPORT_EVERY
                continue
            beaten = now
            req = pb.HeartbeatRequest(node=pb.NodeId(job_id=JOB_ID, node_index=c.node_index,
                                                     session=c.session))
            if self.sc.reports:
                req.report.CopyFrom(self.report())
            try:
                self.held = self.stub.Heartbeat(req, timeout=5.0).evaluations_held
            except Exception as exc:  # noqa: BLE001 - a failed heartbeat is a reported error
                why = exc.details() if hasattr(exc, "details") else str(exc)
                self.fatal = f"{type(exc).__name__}: {why}"

    def stop(self) -> None:
        self.halt.set()
        self.join(6.0)


def _node(index: int, address: str, sc: Scenario, out: dict[str, Any], stop: threading.Event) -> None:
    """One simulated node; fills ``out`` with its round records and errors."""
    import grpc
    import numpy as np

    from lsgd.leader import Candidate
    from lsgd.local_server.global_client import GlobalClient, RoundAnswer
    from lsgd.rules.base import RoundKind

    rng = random.Random(index)
    rounds: list[dict[str, Any]] = []
    out.update(node=index, rounds=rounds, errors=[], acquires=0, grants=0, first_grant=None,
               heartbeat_fatal=None, left=False)
    client = GlobalClient(address, JOB_ID, index, sc.round_timeout)
    hb = None
    vec = np.full(sc.param_count, float(index), dtype=np.float32)
    buf = np.empty(sc.param_count, dtype=np.float32)
    held = 0
    took = time.monotonic()
    last_round_seen = 0
    live: dict[str, Any] = {"steps": 0, "round": 0, "kind": "", "evaluations": [],
                            "t0": time.monotonic()}
    try:
        if sc.late_join_s and index == sc.nodes - 1:
            stop.wait(sc.late_join_s)
        client.join(workers=sc.workers, param_count=sc.param_count, algorithm="lsgd",
                    num_groups=sc.nodes, connect_timeout=20.0)
        out["joined"] = time.monotonic()
        hb = _Beat(client, sc, live)
        hb.start()
        while not stop.is_set():
            ans = client.acquire(consumed=held, late=0, released=0, want=WANT,
                                 last_round_seen=last_round_seen, max_wait=0.5,
                                 used=time.monotonic() - took)  # as the local server times it
            out["acquires"] += 1
            held = 0
            if ans.round_id > last_round_seen:
                t_learn = time.monotonic()
                rid, kind = ans.round_id, RoundKind(ans.round_kind)
                last_round_seen = rid
                live["round"], live["kind"] = rid, kind.name.lower()
                if kind == RoundKind.GLOBAL and index == 0:
                    live["evaluations"].append((rid, ans.round_iteration))
                best = Candidate(index * sc.workers + rng.randrange(sc.workers), rng.random())
                if kind == RoundKind.LOCAL:  # as the local server does: its own round, no call
                    r = RoundAnswer(False, best, index, sc.workers, 1)
                else:
                    r = client.report_round(rid, best, sc.workers, then_pull=(  # as the node
                        "global_leader" if kind == RoundKind.GLOBAL else None), then_push=(
                        (vec, sc.workers, 0.0) if kind == RoundKind.FINAL else None))
                t_report = time.monotonic()
                role = ""
                if not r.missed and kind == RoundKind.GLOBAL and r.leader and r.node_count > 1:
                    # As the local server does: the leader's node uploads (a lone node keeps
                    # its leader at home), every other node downloads it.
                    if r.leader_node == index:
                        client.push("global_leader", vec, rid)
                        role = "leader"
                    else:
                        client.pull("global_leader", buf, rid)
                        role = "pull"
                if not r.missed and kind == RoundKind.FINAL and r.leader and r.leader_node == index:
                    client.push("global_leader", vec, rid)
                    role = "leader"
                if kind == RoundKind.FINAL and not r.missed:
                    client.push("sum", vec, rid, summands=sc.workers)
                    if index == 0 and r.leader:
                        client.pull("global_leader", buf, rid)
                        client.pull("average", buf, rid)
                t_done = time.monotonic()
                rounds.append({"id": rid, "kind": kind.name.lower(), "learn": t_learn,
                               "report_s": t_report - t_learn, "latency_s": t_done - t_learn,
                               "missed": r.missed, "role": role,
                               "participants": r.participants})
                if kind == RoundKind.FINAL:
                    break
            took = time.monotonic()  # the steps reported next are timed from here
            if ans.grant:  # after the round when the round's answer carries it
                out["grants"] += 1
                if out["first_grant"] is None:
                    out["first_grant"] = time.monotonic()
                held = ans.grant
                live["steps"] += held
                if sc.step_ms:  # the node's workers take their share of steps in parallel
                    time.sleep(math.ceil(held / sc.workers) * sc.step_ms / 1000.0)
        hb.stop()  # a heartbeat after leaving would be refused
        client.leave(consumed=held, late=0)
        out["left"] = True
    except grpc.RpcError as exc:
        out["errors"].append(f"node {index}: {exc.code().name}: {exc.details()}")
    except Exception as exc:  # noqa: BLE001 - every failure is a reported error
        out["errors"].append(f"node {index}: {type(exc).__name__}: {exc}")
    finally:
        out["end"] = time.monotonic()
        if hb is not None:
            hb.stop()
            out["heartbeat_fatal"] = hb.fatal
        client.close()


def client_main(spec_path: str) -> int:
    """A client process: one thread per node in ``spec["nodes"]``; writes ``spec["out"]``."""
    _pin_from_env()
    spec = json.loads(Path(spec_path).read_text())
    sc = Scenario(**spec["scenario"])
    if sc.nodes_on in ("asyncio", "uvloop"):
        from bench.scale_aio import client_main as aio_main

        return aio_main(spec, sc)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    outs = [dict() for _ in spec["nodes"]]
    threads = [threading.Thread(target=_node, args=(i, spec["address"], sc, o, stop),
                                name=f"node{i}", daemon=True)
               for i, o in zip(spec["nodes"], outs)]
    for t in threads:
        t.start()
    end = time.monotonic() + sc.limit_s
    while any(t.is_alive() for t in threads) and time.monotonic() < end and not stop.is_set():
        time.sleep(0.05)
    stop.set()  # stragglers finish their current call (bounded by its deadline) and leave
    grace = time.monotonic() + 2.0
    for t in threads:
        t.join(max(0.0, grace - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    for o, t in zip(outs, threads):
        if t.is_alive():
            o.setdefault("errors", []).append(f"{t.name}: stopped before the end of the job")
    tmp = Path(spec["out"] + ".tmp")
    tmp.write_text(json.dumps({"nodes": outs, "alive": alive}, default=str))
    os.replace(tmp, spec["out"])
    return 0


# ---------------------------------------------------------------------------------- driver
def _env(cpus: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["LSGD_BENCH_CPUS"] = cpus  # "": any CPU
    return env


def _pin_from_env() -> None:
    """Run this process (and the threads it starts) on the CPUs ``LSGD_BENCH_CPUS`` names."""
    cpus = os.environ.get("LSGD_BENCH_CPUS", "")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


SERVER_CODE = """\
import json, logging, os, sys
cpus = os.environ.get("LSGD_BENCH_CPUS", "")  # as _pin_from_env, without importing the bench
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
from lsgd.config import JobConfig
from lsgd.global_server.server import serve
logging.basicConfig(level=logging.WARNING, format="%(asctime)s global %(levelname)s %(message)s")
sys.exit(serve(JobConfig(**json.loads(sys.argv[1]))))
"""


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(3)


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit status, or None if still running after ``timeout`` seconds."""
    try:
        return proc.wait(max(0.1, timeout))
    except subprocess.TimeoutExpired:
        return None


PROFILE_DIR = os.environ.get("LSGD_BENCH_PROFILE")  # a folder: py-spy the global server there


def _profile(pid: int, name: str) -> subprocess.Popen | None:
    """With LSGD_BENCH_PROFILE=<dir> (and py-spy installed; it is not a dependency): sample
    the global server for the whole scenario into ``<dir>/<scenario>.txt`` (collapsed stacks of
    the thread holding the GIL, i.e. where its Python CPU goes: ``python -m
    bench.profile_summary <file>`` reads them)."""
    if not PROFILE_DIR or shutil.which("py-spy") is None:
        return None
    Path(PROFILE_DIR).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format",
                             "raw", *os.environ.get("LSGD_BENCH_PROFILE_ARGS", "--gil").split(), "--output",
                             str(Path(PROFILE_DIR) / f"{name}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _phases(records: list[dict[str, Any]], kind: str = "global") -> dict[str, float] | None:
    """Where a round's time goes, median over the job's rounds of ``kind`` (ms): ``learn``,
    from the first node to the last learning of the round (the credit answers that name it);
    ``close``, from the last node learning of it to the first barrier answer (the last
    reports, and the round's close); ``answers``, from the first barrier answer to the last (the fan-out); ``exchange``, from
    the last answer to the last node done (the leader's upload and the downloads after it)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == kind and not r["missed"]:
            by.setdefault(r["id"], []).append(r)
    spans: dict[str, list[float]] = {"learn": [], "close": [], "answers": [], "exchange": []}
    for rs in by.values():
        learn = [r["learn"] for r in rs]
        answered = [r["learn"] + r["report_s"] for r in rs]
        done = [r["learn"] + r["latency_s"] for r in rs]
        spans["learn"].append(max(learn) - min(learn))
        spans["close"].append(min(answered) - max(learn))
        spans["answers"].append(max(answered) - min(answered))
        spans["exchange"].append(max(done) - max(answered))
    if not by:
        return None
    return {k: round(_pct([x * 1000 for x in v], 50), 1) for k, v in spans.items()}


def _round_cpu(records: list[dict[str, Any]], sampler: "_Sampler",
               kind: str) -> dict[str, float] | None:
    """The CPU the server and the simulated nodes (all client processes together) used while
    the job's rounds of ``kind`` ran, in % of one core: from the first node learning of each
    round to the last done, over all such rounds (which side sets a round's pace)."""
    spans: dict[int, list[float]] = {}
    for r in records:
        if r["kind"] == kind and not r["missed"]:
            s = spans.setdefault(r["id"], [math.inf, -math.inf])
            s[0], s[1] = min(s[0], r["learn"]), max(s[1], r["learn"] + r["latency_s"])
    if not spans:
        return None
    used: dict[str, float] = {}
    wall = sum(b - a for a, b in spans.values())
    for name in sampler.pids:
        side = "server" if name == "server" else "clients"
        for a, b in spans.values():
            x, y = sampler.at(name, a), sampler.at(name, b)
            if x is None or y is None:
                return None
            used[side] = used.get(side, 0.0) + (y - x)
    return {k: round(100.0 * v / wall, 1) for k, v in used.items()} if wall > 0 else None


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


SAMPLE_EVERY = 0.01  # seconds: a 512-node round's phases take 20-60 ms each


class _Sampler(threading.Thread):
    """Samples (time, CPU seconds) of the server and client processes every ``SAMPLE_EVERY``."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.take()
            self.halt.wait(SAMPLE_EVERY)

    def take(self) -> None:
        row: dict[str, float] = {}
        for name, pid in self.pids.items():
            try:
                row[name] = cpu_seconds(pid)
            except (OSError, IndexError, ValueError):
                pass
        self.samples.append((time.monotonic(), row))

    def at(self, name: str, t: float) -> float | None:
        """CPU seconds of ``name`` at time ``t`` (linear interpolation between samples)."""
        pts = [(ts, row[name]) for ts, row in self.samples if name in row]
        if not pts:
            return None
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
        return pts[-1][1]

    def usage(self, name: str, t0: float, t1: float) -> float | None:
        a, b = self.at(name, t0), self.at(name, t1)
        return None if a is None or b is None or t1 <= t0 else 100.0 * (b - a) / (t1 - t0)


def run_scenario(sc: Scenario, procs: int, workdir: Path) -> dict[str, Any]:
    """Run one simulated cluster against a fresh global server; returns its measurements."""
    run_dir = workdir / sc.name
    run_dir.mkdir(parents=True)
    from lsgd.config import JobConfig

    config = dict(num_groups=sc.nodes, workers=sc.workers, algorithm="lsgd", l_comm=sc.l_comm,
                  g_comm=sc.g_comm, iterations=sc.iterations, port=0, run_dir=str(run_dir),
                  job_id=JOB_ID, round_timeout=sc.round_timeout, node_timeout=sc.node_timeout,
                  join_timeout=sc.join_timeout, status_port=None if sc.status else 0,
                  session_port=sc.session_port)
    JobConfig(**config)  # validate here, with a clear error
    server: subprocess.Popen | None = None
    clients: list[subprocess.Popen] = []
    sampler: _Sampler | None = None
    poller: Any = None  # bench.status_page.Poller
    t_begin = time.monotonic()
    hard_end = t_begin + sc.limit_s + 15
    try:
        log = (run_dir / "global.log").open("w")
        cpus = sorted(os.sched_getaffinity(0))
        pinned = sc.pin and len(cpus) >= 2
        server_cpus = str(cpus[0]) if pinned else ""
        client_cpus = ",".join(str(c) for c in cpus[1:]) if pinned else ""
        server = subprocess.Popen([sys.executable, "-c", SERVER_CODE, json.dumps(config)],
                                  env=_env(server_cpus), cwd=str(REPO), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        port_file = run_dir / "global.port"
        while not port_file.exists() or not port_file.read_text().strip():
            if server.poll() is not None or time.monotonic() > t_begin + 30:
                raise RuntimeError(f"global server did not start: {(run_dir / 'global.log').read_text()[-2000:]}")
            time.sleep(0.02)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        groups = [list(range(sc.nodes))[k::procs] for k in range(procs)]
        groups = [g for g in groups if g]
        outs = []
        for k, nodes in enumerate(groups):
            spec = run_dir / f"client{k}.spec.json"
            out = run_dir / f"client{k}.json"
            spec.write_text(json.dumps({"scenario": asdict(sc), "nodes": nodes, "address": address,
                                        "out": str(out)}))
            clog = (run_dir / f"client{k}.log").open("w")
            clients.append(subprocess.Popen([sys.executable, "-m", "bench.scale", "--client", str(spec)],
                                            env=_env(client_cpus), cwd=str(REPO), stdout=clog,
                                            stderr=subprocess.STDOUT, start_new_session=True))
            outs.append(out)
        pids = {"server": server.pid} | {f"client{k}": c.pid for k, c in enumerate(clients)}
        spy = _profile(server.pid, sc.name)
        sampler = _Sampler(pids)
        sampler.start()
        if sc.poll_s:
            from bench.status_page import Poller

            poller = Poller(run_dir / "global" / "status.port", sc.poll_s)
            poller.start()
        client_errors: list[str] = []
        for k, c in enumerate(clients):
            if _wait(c, hard_end - time.monotonic()) is None:
                client_errors.append(f"client process {k} still running after {sc.limit_s:g} s: stopped")
                c.send_signal(signal.SIGTERM)  # it stops its nodes and writes what it has
                _wait(c, 5.0)
        if poller is not None:  # the job is over: its page goes away with the server
            clients_done = time.monotonic()
            poller.halt.set()
            poller.join(10)
            client_errors += poller.errors_before(clients_done)
        # Every node has left: the server writes its summary and exits by itself.
        server_rc = _wait(server, 10.0)
        if server_rc is None:
            client_errors.append("global server did not exit 10 s after every node left")
            server.send_signal(signal.SIGTERM)
            server_rc = _wait(server, 5.0)
        sampler.halt.set()
        sampler.join()
        if spy is not None:  # py-spy ends with the server
            _wait(spy, 20.0)
        summary_path = run_dir / "global" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        nodes: list[dict[str, Any]] = []
        for k, out in enumerate(outs):
            if out.exists():
                nodes += json.loads(out.read_text())["nodes"]
            else:
                client_errors.append(f"client process {k} wrote no results "
                                     f"(rc {clients[k].returncode}): "
                                     f"{(run_dir / f'client{k}.log').read_text()[-500:]}")
        result = _measure(sc, nodes, summary, server_rc, sampler, client_errors,
                          (run_dir / "global.log").read_text(), len(clients))
        if poller is not None:
            result["polls"] = poller.summary()
        return result
    finally:
        if sampler is not None:
            sampler.halt.set()
        if poller is not None:
            poller.halt.set()
        for c in clients:
            _kill(c)
        _kill(server)


def _measure(sc: Scenario, nodes: list[dict[str, Any]], summary: dict[str, Any], server_rc: int,
             sampler: _Sampler, client_errors: list[str], server_log: str, procs: int) -> dict[str, Any]:
    errors = client_errors + [e for n in nodes for e in n.get("errors", [])]
    errors += [f"node {n['node']}: heartbeat: {n['heartbeat_fatal']}" for n in nodes
               if n.get("heartbeat_fatal")]
    warnings = [line for line in server_log.splitlines() if " WARNING " in line or " ERROR " in line]
    records = [r for n in nodes for r in n.get("rounds", [])]
    # A late report of a LOCAL round (the next period was used up first) only skips nothing:
    # local rounds have no exchange. A missed GLOBAL/FINAL round is a failure.
    missed = sum(1 for r in records if r["missed"] and r["kind"] != "local")
    missed_local = sum(1 for r in records if r["missed"] and r["kind"] == "local")
    lat = [r["latency_s"] * 1000 for r in records]
    by_kind = {}
    for kind in ("local", "global", "final"):
        xs = [r["latency_s"] * 1000 for r in records if r["kind"] == kind]
        # the control plane's part: until the round's answer (a global round's barrier), before
        # the parameter exchange (on the star: the leader's downloads from the server)
        rs = [r["report_s"] * 1000 for r in records if r["kind"] == kind]
        if xs:
            by_kind[kind] = {"n": len(xs), "p50_ms": round(_pct(xs, 50), 2),
                             "p99_ms": round(_pct(xs, 99), 2), "max_ms": round(max(xs), 2),
                             "answer_p50_ms": round(_pct(rs, 50), 2),
                             "answer_p99_ms": round(_pct(rs, 99), 2)}
    firsts = [n["first_grant"] for n in nodes if n.get("first_grant")]
    finals = [n["rounds"][-1]["learn"] + n["rounds"][-1]["latency_s"] for n in nodes
              if n.get("rounds") and n["rounds"][-1]["kind"] == "final"]
    t0 = min(firsts) if firsts else None
    t1 = max(finals) if finals else None
    window = (t1 - t0) if t0 is not None and t1 is not None else float("nan")
    rounds = summary.get("rounds", 0)
    calls = summary.get("calls", {})
    total_calls = sum(calls.values())
    completed = sum(1 for n in nodes if n.get("left") and n.get("rounds")
                    and n["rounds"][-1]["kind"] == "final")
    # Rounds a node never heard of: possible for local rounds (no barrier), never for global.
    seen = {n["node"]: len(n.get("rounds", [])) for n in nodes}
    cpu = {name: (round(sampler.usage(name, t0, t1), 1) if t0 is not None and t1 is not None
                  and sampler.usage(name, t0, t1) is not None else None)
           for name in sampler.pids}
    # Server CPU while all nodes but the late one long-poll and nothing can happen.
    idle_cpu, idle_s = None, None
    late = [n.get("joined") for n in nodes if n["node"] == sc.nodes - 1]
    early = [n.get("joined") for n in nodes if n["node"] != sc.nodes - 1]
    if sc.late_join_s and late and late[0] and early and all(early):
        a, b = max(early) + 0.1, late[0] - 0.05
        if b - a > 0.3 and sampler.usage("server", a, b) is not None:
            idle_cpu, idle_s = round(sampler.usage("server", a, b), 1), round(b - a, 2)
    ok = (not errors and missed == 0 and completed == sc.nodes and len(nodes) == sc.nodes
          and summary.get("finished") is True and server_rc == 0 and rounds == sc.rounds
          and summary.get("counter") == sc.iterations)
    return {
        "scenario": asdict(sc), "client_processes": procs, "ok": ok,
        "errors": errors[:20], "error_count": len(errors), "missed_global_reports": missed,
        "missed_local_reports": missed_local,
        "server_warnings": warnings[:10], "server_warning_count": len(warnings),
        "nodes_completed": completed, "server_rc": server_rc,
        "rounds": rounds, "round_records": len(records), "window_s": round(window, 3),
        "rounds_per_s": round(rounds / window, 2) if window and window > 0 else None,
        "p50_ms": round(_pct(lat, 50), 2), "p99_ms": round(_pct(lat, 99), 2),
        "max_ms": round(max(lat), 2) if lat else None, "by_kind": by_kind,
        "global_phases_ms": _phases(records), "final_phases_ms": _phases(records, "final"),
        "rounds_cpu_pct": {k: _round_cpu(records, sampler, k) for k in ("global", "final")},
        "server_cpu_pct": cpu.get("server"),
        "idle_longpoll_server_cpu_pct": idle_cpu, "idle_longpoll_window_s": idle_s,
        "client_cpu_pct": {k: v for k, v in cpu.items() if k != "server"},
        "calls": calls, "calls_per_round": round(total_calls / rounds, 1) if rounds else None,
        "acquires_per_node_round": round(sum(n.get("acquires", 0) for n in nodes)
                                         / max(1, sc.nodes * rounds), 2),
        "counter": summary.get("counter"), "expected_counter": sc.iterations,
        # A node may skip a local round (no barrier) if the others used the next period first.
        "rounds_skipped": sum(sc.rounds - v for v in seen.values()),
    }


def run(quick: bool) -> list[Result]:
    """64 x 8 (and, full mode, a paced 64 x 8) against the 1 x 8 baseline; quick ~15 s, full ~1.5 min."""
    rounds = 24 if quick else 120
    # Stress: 2 ms per worker step, so the server, not the modelled work, sets the pace.
    # 64 nodes: a local round every 16 steps per worker, a global one every 64 (the defaults);
    # node 63 joins 1.5 s late, so 63 nodes long-poll with nothing to do meanwhile.
    big = Scenario("64x8", nodes=64, workers=8, l_comm=16, g_comm=64, rounds=rounds, step_ms=2.0,
                   late_join_s=1.5)
    # One node has only global rounds: the same work per round (16 steps per worker).
    base = Scenario("1x8", nodes=1, workers=8, l_comm=16, g_comm=16, rounds=rounds, step_ms=2.0)
    # Paced (full mode): 20 ms steps, 320 ms of work per round: a server with headroom.
    paced = Scenario("64x8-paced", nodes=64, workers=8, l_comm=16, g_comm=64, rounds=32,
                     step_ms=20.0)
    with tempfile.TemporaryDirectory(prefix="lsgd-bench-scale-") as tmp:
        b = run_scenario(base, 1, Path(tmp))
        m = run_scenario(big, CLIENT_PROCS, Path(tmp))
        p = None if quick else run_scenario(paced, CLIENT_PROCS, Path(tmp))
    met = bool(m["ok"]) and (p is None or bool(p["ok"]))
    shared = {"64x8": m, "1x8": b} | ({"64x8-paced": p} if p else {})
    gb = lambda d, k: d["by_kind"].get("global", {}).get(k)  # noqa: E731
    goal = ("64 nodes x 8 workers finish every round on one global server: 0 RPC errors, "
            "0 missed global rounds, no node dropped, exact counter")

    def ratio(a: float | None, c: float | None) -> float | None:
        return round(a / c, 2) if a is not None and c else None

    def nan(x: float | None) -> float:
        return float("nan") if x is None else x

    out = [
        Result(TARGET, "p99 round latency, 64 nodes x 8 workers, 2 ms steps (all rounds: "
               "local + global + final)", m["p99_ms"], "ms", b["p99_ms"],
               "1 node x 8 workers, same run: no barrier, no exchange (control-path floor)", ratio(m["p99_ms"], b["p99_ms"]),
               "value/baseline (growth from 1 to 64 nodes)", goal, met, extra=shared),
        Result(TARGET, "p99 global-round latency (64-node barrier + leader upload + 63 downloads)",
               nan(gb(m, "p99_ms")), "ms", gb(b, "p99_ms"), "1 node x 8 workers, global rounds (no barrier, no exchange)",
               ratio(gb(m, "p99_ms"), gb(b, "p99_ms")), "value/baseline", "", None,
               extra={"64x8": m["by_kind"], "1x8": b["by_kind"]}),
        Result(TARGET, "p50 round latency, 64 nodes x 8 workers", m["p50_ms"], "ms", b["p50_ms"],
               "1 node x 8 workers", ratio(m["p50_ms"], b["p50_ms"]), "value/baseline", "", None),
        Result(TARGET, "global server CPU, 64 nodes x 8 workers", nan(m["server_cpu_pct"]),
               "% of one core", b["server_cpu_pct"], "1 node x 8 workers",
               ratio(m["server_cpu_pct"], b["server_cpu_pct"]), "value/baseline", "", None,
               extra={"client_cpu_pct": m["client_cpu_pct"], "machine_cores": os.cpu_count()}),
        Result(TARGET, "rounds per second, 64 nodes x 8 workers", nan(m["rounds_per_s"]),
               "rounds/s", b["rounds_per_s"], "1 node x 8 workers",
               ratio(m["rounds_per_s"], b["rounds_per_s"]), "value/baseline", "", None,
               extra={"calls_per_round": m["calls_per_round"], "calls": m["calls"],
                      "baseline_calls_per_round": b["calls_per_round"],
                      "baseline_calls": b["calls"]}),
        Result(TARGET, "global server CPU while 63 nodes long-poll with nothing to do "
               "(node 63 joins 1.5 s late)", nan(m["idle_longpoll_server_cpu_pct"]),
               "% of one core", None, "", None, "",
               "a few % (each node polls twice a second)", None,
               extra={"window_s": m["idle_longpoll_window_s"]}),
    ]
    if p is not None:
        out.append(Result(TARGET, "p99 round latency, 64 nodes x 8 workers, 20 ms steps (paced)",
                          p["p99_ms"], "ms", b["p99_ms"], "1 node x 8 workers, 2 ms steps",
                          ratio(p["p99_ms"], b["p99_ms"]), "value/baseline", "", None,
                          extra={"server_cpu_pct": p["server_cpu_pct"],
                                 "rounds_per_s": p["rounds_per_s"], "by_kind": p["by_kind"],
                                 "ok": p["ok"], "errors": p["errors"]}))
    return out


def sweep(counts: list[int], rounds: int = 16, nodes_on: str = "threads",
          sessions: tuple[int | None, ...] = (None,), pin: bool = False,
          params: int = PARAM_COUNT) -> list[dict[str, Any]]:
    """The paced scenario (20 ms steps: 320 ms of work per round) at each node count, 8 workers
    each, one fresh server per count: round latency, server CPU and calls per round as the job
    grows (issue 15's 64, 256 and 512 nodes). The simulated nodes' own CPU is reported too: on a
    small host it, not the server, may set the pace. ``nodes_on``: the simulated nodes' kind
    (``scale_aio.py``); ``sessions``: each count once per SESSION_PORT value given (0: the
    streams on the synchronous server; None: the asyncio one), one after the other; ``params``:
    the float32 elements of each exchanged vector."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="lsgd-bench-scale-") as tmp:
        for n, session in [(n, s) for n in counts for s in sessions]:
            tag = {None: "", 0: "-sync"}.get(session, f"-session{session}")
            sc = Scenario(f"{n}x8-paced{tag}", nodes=n, workers=8, l_comm=16, g_comm=64,
                          rounds=rounds, step_ms=20.0, limit_s=300.0, join_timeout=120.0,
                          node_timeout=30.0, nodes_on=nodes_on, session_port=session, pin=pin,
                          param_count=params)
            m = run_scenario(sc, CLIENT_PROCS, Path(tmp))
            g = m["by_kind"].get("global", {})
            row = {"nodes": n, "params": params,
                   "sessions": "sync" if session == 0 else "asyncio", "pinned": pin,
                   "nodes_on": nodes_on, "ok": m["ok"], "errors": m["error_count"],
                   "p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"],
                   "global_p50_ms": g.get("p50_ms"), "global_p99_ms": g.get("p99_ms"),
                   "global_answer_p99_ms": g.get("answer_p99_ms"),
                   "final_p99_ms": m["by_kind"].get("final", {}).get("p99_ms"),
                   "rounds_per_s": m["rounds_per_s"], "server_cpu_pct": m["server_cpu_pct"],
                   "server_cpu_s_per_round": (round(m["server_cpu_pct"] / 100 / m["rounds_per_s"], 3)
                                              if m["server_cpu_pct"] and m["rounds_per_s"] else None),
                   "calls_per_round": m["calls_per_round"], "calls": m["calls"],
                   "client_cpu_pct": m["client_cpu_pct"],
                   "clients_cpu_s_per_round": (round(sum(v or 0 for v in m["client_cpu_pct"].values())
                                                     / 100 / m["rounds_per_s"], 3)
                                               if m["rounds_per_s"] else None),
                   "global_phases_ms": m["global_phases_ms"],
                   "final_phases_ms": m["final_phases_ms"],
                   "rounds_cpu_pct": m["rounds_cpu_pct"],
                   "load_before": round(os.getloadavg()[0], 2), "first_errors": m["errors"][:5]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def spread(rows: list[dict[str, Any]], goal_ms: float = 100.0) -> str:
    """Each node count's runs of a repeated sweep (``--repeat``): how many had a p99 over all
    rounds within ``goal_ms`` (issue 15: every run), and the range of each measure."""
    lines = [f"| nodes | runs | ok | p99 <= {goal_ms:g} ms | p99, all rounds (ms) | global rounds "
             "p99 | final round p99 | server CPU per round (s) |", "|---|---|---|---|---|---|---|---|"]

    def span(xs: list[Any]) -> str:
        xs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
        return f"{min(xs):g}-{max(xs):g}" if xs else "-"

    for n in sorted({r["nodes"] for r in rows}):
        rs = [r for r in rows if r["nodes"] == n]
        p99 = [r["p99_ms"] for r in rs]
        within = sum(1 for r in rs if r["ok"] and r["p99_ms"] <= goal_ms)
        lines.append(f"| {n} | {len(rs)} | {sum(r['ok'] for r in rs)} | {within} of {len(rs)} | "
                     f"{', '.join(f'{x:.0f}' for x in p99)} | "
                     f"{span([r['global_p99_ms'] for r in rs])} | "
                     f"{span([r['final_p99_ms'] for r in rs])} | "
                     f"{span([r['server_cpu_s_per_round'] for r in rs])} |")
    return "\n".join(lines)


def compare(counts: list[int], against: str, nodes_on: str = "threads") -> int:
    """The sweep of this checkout and of revision ``against`` (its own server, nodes and
    harness, from a git worktree), one after the other at each node count, so that both see the
    same host; then the ratios (this checkout / ``against``)."""
    from bench.against import cell, json_rows, short, worktree

    rev = short(against)
    pairs = []
    with worktree(rev) as tree:
        for n in counts:
            old = json_rows(["-m", "bench.scale", "--sweep", str(n), "--nodes-on", nodes_on],
                            tree, tree)[0] | {"rev": rev}
            print(json.dumps(old), flush=True)
            new = sweep([n], nodes_on=nodes_on)[0] | {"rev": "this checkout"}
            pairs.append((old, new))
    print(f"\nthis checkout against {rev}, same host, one after the other:")
    print("| nodes | result (old → new) | p99 round latency | global rounds p99 | final round p99 "
          "| server CPU | CPU per round | calls per round |")
    print("|---|---|---|---|---|---|---|---|")
    for old, new in pairs:
        ok = f"{'ok' if old['ok'] else 'failed'} → {'ok' if new['ok'] else 'failed'}"
        print(f"| {new['nodes']} | {ok} ({old['errors']} → {new['errors']} errors) | "
              f"{cell(old['p99_ms'], new['p99_ms'], ' ms')} | "
              f"{cell(old.get('global_p99_ms'), new.get('global_p99_ms'), ' ms')} | "
              f"{cell(old.get('final_p99_ms'), new.get('final_p99_ms'), ' ms')} | "
              f"{cell(old['server_cpu_pct'], new['server_cpu_pct'], '%')} | "
              f"{cell(old['server_cpu_s_per_round'], new['server_cpu_s_per_round'], ' s')} | "
              f"{cell(old['calls_per_round'], new['calls_per_round'])} |")
    return 0 if all(new["ok"] for _, new in pairs) else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--client":
        return client_main(argv[1])
    if argv and argv[0] == "--sweep":
        args = argv[1:]
        against = None
        if "--against" in args:
            k = args.index("--against")
            if k + 1 >= len(args):
                print("bench.scale: --against needs a git revision, e.g. --against HEAD~3",
                      file=sys.stderr)
                return 2
            against, args = args[k + 1], args[:k] + args[k + 2:]
        nodes_on, sessions = "threads", (None,)
        if "--nodes-on" in args:
            k = args.index("--nodes-on")
            nodes_on, args = args[k + 1], args[:k] + args[k + 2:]
            if nodes_on not in ("threads", "asyncio", "uvloop"):
                print(f"bench.scale: --nodes-on {nodes_on}: one of threads, asyncio, uvloop",
                      file=sys.stderr)
                return 2
            if nodes_on == "uvloop" and importlib.util.find_spec("uvloop") is None:
                print("bench.scale: --nodes-on uvloop needs uvloop: pip install -e '.[bench]'",
                      file=sys.stderr)
                return 2
        if "--sessions" in args:  # "both": each count with the streams on each server
            k = args.index("--sessions")
            sessions = {"both": (0, None), "sync": (0,), "asyncio": (None,)}[args[k + 1]]
            args = args[:k] + args[k + 2:]
        pin = "--pin" in args
        args = [a for a in args if a != "--pin"]
        params, repeat = PARAM_COUNT, 1
        if "--params" in args:  # float32 elements per exchanged vector
            k = args.index("--params")
            params, args = int(args[k + 1]), args[:k] + args[k + 2:]
        if "--repeat" in args:  # the whole sweep K times, then each count's spread
            k = args.index("--repeat")
            repeat, args = int(args[k + 1]), args[:k] + args[k + 2:]
        counts = [int(a) for a in args] or [64, 256, 512]
        if against is not None:
            if pin:
                print("bench.scale: --pin does not go with --against (the other revision's "
                      "harness may not have it)", file=sys.stderr)
                return 2
            return compare(counts, against, nodes_on)
        rows = [r for _ in range(repeat)
                for r in sweep(counts, nodes_on=nodes_on, sessions=sessions, pin=pin,
                               params=params)]
        if repeat > 1:
            print(spread(rows))
        return 0 if all(r["ok"] for r in rows) else 1
    quick = "--quick" in argv
    t = time.monotonic()
    if "--status" in argv:
        from bench.status_page import run_status

        results = run_status(quick)
        for r in results:
            print(json.dumps(r.to_dict(), default=str))
        print(f"total {time.monotonic() - t:.1f} s")
        return 0 if results[0].met else 1
    results = run(quick)
    for r in results:
        d = r.to_dict()
        extra = d.pop("extra")
        print(json.dumps(d))
        if "64x8" in extra:
            for name in ("64x8", "1x8", "64x8-paced"):
                if name in extra:
                    e = {k: v for k, v in extra[name].items() if k != "scenario"}
                    print(f"  {name}: {json.dumps(e)}")
    print(f"total {time.monotonic() - t:.1f} s")
    return 0 if results[0].met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
