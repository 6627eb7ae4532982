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

What a finished scenario's numbers are made of: ``bench/scale_measure.py``; the sweep and the
command line: ``bench/scale_sweep.py``.
"""

from __future__ import annotations

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

from bench.common import REPO, Result
from bench.scale_measure import _measure, _Sampler

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


if __name__ == "__main__":
    from bench.scale_sweep import main

    sys.exit(main(sys.argv[1:]))
