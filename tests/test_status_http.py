"""The status page, /metrics and the gRPC probes of a real global server on 127.0.0.1:0.

Fake nodes join and heartbeat with reports over gRPC; the pages are read over HTTP.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from lsgd import probe
from lsgd.config import JobConfig
from lsgd.global_server.server import build_servicer, create_server, serve
from lsgd.leader import Candidate
from lsgd.local_server.global_client import GlobalClient
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.security import Security
from lsgd.status import status_token
from lsgd.status import http as status_http
from lsgd.status.http import MAX_PER_CLIENT, MAX_REQUESTS, start_status_page, status_host

SECRET = "s3cret-for-the-status-tests-0123456789"
JOB = "obs"


class Job:
    """A global server (gRPC and status page) in this process, and its fake nodes."""

    def __init__(self, tmp_path, secret: str | None = None) -> None:
        self.config = JobConfig(num_groups=2, workers=2, job_id=JOB, l_comm=2, g_comm=4,
                                iterations=4000, port=0, run_dir=str(tmp_path),
                                node_timeout=60.0)
        self.security = Security(secret=secret)
        self.servicer = build_servicer(self.config)
        self.server, port = create_server("127.0.0.1:0", self.servicer, self.security)
        self.addr = f"127.0.0.1:{port}"
        out = tmp_path / "global"
        out.mkdir(exist_ok=True)
        self.page = start_status_page(self.config, self.servicer, secret, out)
        assert self.page is not None
        self.url = f"http://127.0.0.1:{self.page.port}"
        self.token = status_token(secret.encode()) if secret else None
        self.clients: list[GlobalClient] = []

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.page.stop()
        self.server.stop(grace=0.5).wait(5)

    def node(self, index: int) -> GlobalClient:
        c = GlobalClient(self.addr, JOB, index, round_timeout=5.0, security=self.security)
        c.join(workers=2, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        self.clients.append(c)
        return c

    def beat(self, c: GlobalClient, report: pb.NodeReport | None = None) -> pb.HeartbeatResponse:
        stub = pb_grpc.GlobalServerStub(c._channel)  # the node's own (signed) channel
        req = pb.HeartbeatRequest(node=pb.NodeId(job_id=JOB, node_index=c.node_index,
                                                 session=c.session))
        if report is not None:
            req.report.CopyFrom(report)
        return stub.Heartbeat(req, timeout=5)

    def get(self, path: str, token: str | None = "default", headers: dict | None = None):
        """(status, content type, body) of GET ``path``."""
        headers = dict(headers or {})
        token = self.token if token == "default" else token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.headers["Content-Type"], resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read()

    def json(self, path: str) -> dict:
        code, ctype, body = self.get(path)
        assert code == 200 and ctype == "application/json", (code, body[:200])
        return json.loads(body)

    def metrics(self) -> dict:
        code, ctype, body = self.get("/metrics")
        assert code == 200 and ctype.startswith("text/plain"), code
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


@pytest.fixture
def secret_job(tmp_path):
    j = Job(tmp_path, secret=SECRET)
    yield j
    j.close()


def node_report(index: int, rnd: int = 0, evaluations=(), start: int = 0) -> pb.NodeReport:
    r = pb.NodeReport(steps=8, rate=4.0, workers_training=2, evaluations_from=start,
                      has_local_leader=True,
                      local_leader=pb.Candidate(worker_id=2 * index + 1, loss=0.25))
    for k in range(2):
        r.workers.append(pb.WorkerStat(worker_id=2 * index + k, iterations=4, loss=0.5 - k / 4,
                                       distance=0.1 * k, distance_to="global_leader",
                                       training=True, round_id=rnd))
    r.evaluations.extend(evaluations)
    return r


def run_until_round(a: GlobalClient, b: GlobalClient, seen: int) -> tuple[int, int]:
    """Both nodes take and use credits until a round opens; returns its (id, kind). What a
    node holds stays with it (``held`` on its client), those a round's answer carried too."""
    for _ in range(200):
        for c in (a, b):
            ans = c.acquire(consumed=getattr(c, "held", 0), late=0, released=0, want=100,
                            last_round_seen=seen, max_wait=0)
            c.held = ans.grant
            if ans.round_id > seen:
                return ans.round_id, ans.round_kind
    raise AssertionError("no round opened")


def test_status_history_and_metrics_follow_the_job(job):
    a, b = job.node(0), job.node(1)
    assert job.json("/status.json")["job"]["state"] == "running"
    rid, kind = run_until_round(a, b, 0)
    assert (rid, kind) == (1, pb.ROUND_KIND_LOCAL)
    rid, kind = run_until_round(a, b, 1)
    assert (rid, kind) == (2, pb.ROUND_KIND_GLOBAL)
    answers = {}
    t = threading.Thread(target=lambda: answers.setdefault(0, a.report_round(rid, Candidate(1, 0.4), 2)))
    t.start()
    answers[1] = b.report_round(rid, Candidate(2, 0.3), 2)
    t.join(10)
    assert answers[0].leader_node == 1
    b.push("global_leader", np.arange(10, dtype=np.float32), rid)  # 40 bytes in
    out = np.zeros(10, np.float32)
    a.pull("global_leader", out, rid)  # 40 bytes out
    evals = [pb.Evaluation(round_id=2, iteration=16, target="leader", metric="accuracy",
                           value=0.75, worker_id=2)]
    assert job.beat(a, node_report(0, rid, evals)).evaluations_held == 1
    assert job.beat(b, node_report(1, rid)).evaluations_held == 0
    assert job.beat(a).evaluations_held == 1  # without a report: what the server holds

    snap = job.json("/status.json")
    j = snap["job"]
    assert (j["id"], j["state"], j["counter"], j["workers_per_node"]) == (JOB, "running", 16, 2)
    assert j["budget"] == {"iterations": 4000, "minutes": None} and j["restarts"] == 0
    assert j["rounds"] == {"local": 1, "global": 1, "final": 0, "total": 2}
    assert snap["leader"] == {"worker": 2, "node": 1, "loss": 0.3, "round": 2, "iteration": 16}
    assert [(n["index"], n["alive"], n["steps"], n["rate"]) for n in snap["nodes"]] == \
        [(0, True, 8, 4.0), (1, True, 8, 4.0)]
    assert snap["nodes"][1]["local_leader"] == {"worker": 3, "loss": 0.25}
    assert [(w["id"], w["loss"], w["round"]) for w in snap["workers"]] == \
        [(0, 0.5, 2), (1, 0.25, 2), (2, 0.5, 2), (3, 0.25, 2)]
    assert snap["evaluations"] == [{"round": 2, "iteration": 16, "target": "leader",
                                    "metric": "accuracy", "value": 0.75, "worker": 2}]

    hist = job.json("/history.json?since=0")
    assert [(r["id"], r["kind"], r["leader"]) for r in hist["rounds"]] == \
        [(1, "local", None), (2, "global", 2)]
    assert hist["rounds"][1]["latency_s"] >= 0 and hist["rounds"][0]["latency_s"] is None
    assert sorted(p["worker"] for p in hist["points"]) == [0, 1, 2, 3]
    assert all(p["iteration"] == 16 for p in hist["points"])
    assert hist["next"] == snap["history"]["next"] == 2 + 4 + 1 + 1
    assert job.json(f"/history.json?since={hist['next']}")["rounds"] == []
    assert job.get("/history.json?since=-1")[0] == 400

    m = job.metrics()
    assert m[("lsgd_iterations", ())] == 16
    assert m[("lsgd_iteration_budget", ())] == 4000
    assert m[("lsgd_rounds_total", (("kind", "local"),))] == 1
    assert m[("lsgd_rounds_total", (("kind", "global"),))] == 1
    assert m[("lsgd_nodes_alive", ())] == 2 and m[("lsgd_nodes_expected", ())] == 2
    assert m[("lsgd_round_latency_seconds_count", ())] == 1
    assert m[("lsgd_round_latency_seconds_bucket", (("le", "+Inf"),))] == 1
    assert m[("lsgd_param_bytes_total", (("direction", "in"),))] == 40
    assert m[("lsgd_param_bytes_total", (("direction", "out"),))] == 40
    assert m[("lsgd_job_stopped", ())] == 0
    assert m[("lsgd_iterations_per_second", ())] >= 0


def test_a_hostile_report_is_invalid_argument_and_changes_nothing(job):
    a = job.node(0)
    job.beat(a, node_report(0))
    board, node = job.servicer.board, job.servicer.coord.nodes[0]
    before = (dict(board.reports), list(board.points), board._seq, node.last_seen)
    hostile = [node_report(0), node_report(0), node_report(0)]
    hostile[0].workers[1].worker_id = 7  # a worker of another node
    hostile[1].workers.extend([pb.WorkerStat(worker_id=1)] * 1000)  # far too many
    hostile[2].evaluations.extend([pb.Evaluation(target="leader", metric="x" * 10_000)])
    for bad in hostile:
        with pytest.raises(grpc.RpcError) as e:
            job.beat(a, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (dict(board.reports), list(board.points), board._seq, node.last_seen) == before
    m = job.metrics()
    assert m[("lsgd_rpc_errors_total", (("code", "INVALID_ARGUMENT"), ("method", "Heartbeat")))] == 3


def test_endpoints_ask_for_the_token_when_the_job_has_a_secret(secret_job):
    job = secret_job
    for path in ("/status.json", "/history.json", "/metrics", "/"):
        code, ctype, body = job.get(path, token=None)
        assert code == 401 and ctype == "application/json", path
        assert "token" in json.loads(body)["error"]
        assert job.get(path, token="0" * 32)[0] == 401
    assert job.get("/status.json")[0] == 200  # Authorization: Bearer <token>
    with urllib.request.urlopen(f"{job.url}/metrics?token={job.token}", timeout=5) as resp:
        assert resp.status == 200
    code, ctype, _ = job.get("/")
    assert (code, ctype.split(";")[0]) in ((200, "text/html"), (404, "text/plain"))
    assert job.page.host == "127.0.0.1"  # the job's address is loopback


def test_the_page_binds_loopback_unless_a_secret_guards_it(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    remote = JobConfig(ip_addr="10.1.2.3", secret_file=str(secret_file))
    insecure = JobConfig(ip_addr="10.1.2.3", allow_insecure=True)
    assert status_host(remote, SECRET) == "0.0.0.0"  # where the gRPC port listens
    assert status_host(insecure, None) == "127.0.0.1"  # no secret: never beyond loopback
    assert status_host(JobConfig(), SECRET) == "127.0.0.1"


def test_without_a_secret_the_page_is_not_reachable_beyond_loopback(job):
    assert job.page.host == "127.0.0.1" and job.get("/status.json")[0] == 200
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: finds this host's outward address
        own = probe.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no non-loopback IPv4 address")
    finally:
        probe.close()
    if own.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(OSError):
        socket.create_connection((own, job.page.port), timeout=2).close()


def test_health_and_reflection_work_unsigned_while_the_job_refuses_unsigned_calls(secret_job):
    job = secret_job
    a = job.node(0)
    channel = grpc.insecure_channel(job.addr)  # a probe: no secret, no signature
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "lsgd.v1.GlobalServer"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GlobalServerStub(channel).Heartbeat(
                pb.HeartbeatRequest(node=pb.NodeId(job_id=JOB, node_index=0, session=a.session)),
                timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"lsgd.v1.GlobalServer", "grpc.health.v1.Health"} <= names
        a.leave(consumed=0, late=0, stop_job="interrupted")  # node 0 stops the job
        job.servicer.tick()  # the server loop's pass tells the health service
        for service in ("", "lsgd.v1.GlobalServer"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        channel.close()
    m = job.metrics()
    assert m[("lsgd_job_stopped", ())] == 1
    assert m[("lsgd_rpc_errors_total", (("code", "UNAUTHENTICATED"), ("method", "Heartbeat")))] == 1
    assert job.json("/status.json")["job"]["state"] == "stopped"


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the page from ``source`` (any 127.x.y.z: a client of its own)."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _raw(port: int, request: bytes, source: str = "127.0.0.1") -> bytes:
    with _connect(port, source) as s:
        try:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data


def test_requests_are_bounded(job):
    port = job.page.port
    assert _raw(port, b"POST /status.json HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 501")
    assert job.get("/nowhere")[0] == 404 and job.get("/favicon.ico")[0] == 404
    big = b"GET /status.json HTTP/1.0\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
    answer = _raw(port, big)
    assert not answer.startswith(b"HTTP/1.0 200")  # 431, or the connection is cut
    # one client may hold MAX_PER_CLIENT requests; all clients together MAX_REQUESTS
    idle = [_connect(port) for _ in range(MAX_PER_CLIENT)]
    try:
        assert _raw(port, b"GET /status.json HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 503")
        assert _raw(port, b"GET /status.json HTTP/1.0\r\n\r\n", "127.0.0.2").startswith(
            b"HTTP/1.0 200")  # another client is still served
        idle += [_connect(port, f"127.0.0.{3 + i // MAX_PER_CLIENT}")
                 for i in range(MAX_REQUESTS - MAX_PER_CLIENT)]
        time.sleep(0.2)  # accepted and counted by the server
        answer = _raw(port, b"GET /status.json HTTP/1.0\r\n\r\n", "127.0.0.9")
        assert answer.startswith(b"HTTP/1.0 503"), answer[:100]
    finally:
        for s in idle:
            s.close()
    end = time.monotonic() + 5
    refused = 0  # the slots come back as the idle ones close; until then, more 503s
    while (code := job.get("/status.json")[0]) != 200:
        assert code == 503 and time.monotonic() < end, code
        refused += 1
        time.sleep(0.05)
    assert job.page._server.busy == 2 + refused  # every refusal counted, and only those
    # without a secret, a page that a browser reached through some other name is refused
    assert job.get("/status.json", headers={"Host": "rebind.example:80"})[0] == 403
    assert job.get("/status.json", headers={"Host": f"localhost:{port}"})[0] == 200
    assert job.get("/status.json", headers={"Host": f"[::1]:{port}"})[0] == 200


def test_a_restarted_server_serves_again_on_the_same_status_port(tmp_path):
    config = JobConfig(num_groups=1, workers=1, job_id=JOB, port=0, run_dir=str(tmp_path),
                       iterations=100, join_timeout=60.0)
    ports = []
    for restore in (False, True):
        ready, stop = _Ready(), threading.Event()
        t = threading.Thread(target=serve, args=(config,),
                             kwargs=dict(ready=ready, stop_event=stop, restore=restore))
        t.start()
        try:
            assert ready.event.wait(10) and ready.value[0] == "ready", ready.value
            port = int((tmp_path / "global" / "status.port").read_text())
            end = time.monotonic() + 5
            while not (tmp_path / "global" / "state.json").exists():
                assert time.monotonic() < end
                time.sleep(0.02)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as r:
                ports.append((port, json.loads(r.read())["job"]["restarts"]))
        finally:
            stop.set()
            t.join(15)
        assert not t.is_alive()
    assert ports[1] == (ports[0][0], 1) and ports[0][1] == 0


class _Ready:
    """Stands for the pipe on which serve() says it listens."""

    def __init__(self) -> None:
        self.event, self.value = threading.Event(), None

    def send(self, value: object) -> None:
        self.value = value
        self.event.set()


def test_a_port_in_use_is_one_warning_and_the_job_goes_on(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        config = JobConfig(job_id=JOB, run_dir=str(tmp_path), status_port=taken.getsockname()[1])
        servicer = build_servicer(config)
        with caplog.at_level("WARNING", logger="lsgd.status.http"):
            assert start_status_page(config, servicer, None, tmp_path) is None
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "in use; set STATUS_PORT" in lines[0]
        assert not (tmp_path / "status.port").exists()
    finally:
        taken.close()


def test_https_with_node_0s_certificate_and_a_silent_client_blocks_nobody(tmp_path):
    import ssl

    from lsgd.security import make_certs

    make_certs(tmp_path / "certs", ["127.0.0.1"])
    certs = tmp_path / "certs"
    config = JobConfig(job_id=JOB, run_dir=str(tmp_path), port=0, tls_ca=str(certs / "ca.pem"),
                       tls_cert=str(certs / "node0.pem"), tls_key=str(certs / "node0-key.pem"),
                       secret_file=str(certs / "secret"))
    secret = (certs / "secret").read_text().strip()
    page = start_status_page(config, build_servicer(config), secret, tmp_path)
    assert page is not None and page.scheme == "https"
    silent = socket.create_connection(("127.0.0.1", page.port), timeout=5)  # never handshakes
    try:
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        req = urllib.request.Request(f"https://127.0.0.1:{page.port}/status.json",
                                     headers={"Authorization": f"Bearer {status_token(secret.encode())}"})
        t = time.monotonic()
        with urllib.request.urlopen(req, context=context, timeout=5) as resp:
            assert resp.status == 200 and json.loads(resp.read())["job"]["id"] == JOB
        assert time.monotonic() - t < 2.0
        with pytest.raises(OSError):  # plain HTTP is not served (the handshake fails)
            urllib.request.urlopen(f"http://127.0.0.1:{page.port}/status.json", timeout=5)
    finally:
        silent.close()
        page.stop()


def test_a_client_that_trickles_its_request_is_cut_off(job, monkeypatch):
    # each byte restarts a socket read's timeout: only a deadline on the whole request helps
    monkeypatch.setattr(status_http, "REQUEST_DEADLINE", 1.0)
    slow = [_connect(job.page.port) for _ in range(MAX_PER_CLIENT)]
    try:
        for s in slow:
            s.sendall(b"GET /status.json HTTP/1.0\r\nX-Pad: ")
        start = time.monotonic()
        cut = set()
        while len(cut) < len(slow) and time.monotonic() - start < 8:
            for i, s in enumerate(slow):
                if i in cut:
                    continue
                try:
                    s.sendall(b"a")
                    s.settimeout(0.01)
                    if s.recv(1) == b"":
                        cut.add(i)
                except (socket.timeout, BlockingIOError):
                    pass
                except OSError:
                    cut.add(i)
            time.sleep(0.1)
        assert len(cut) == len(slow), f"{len(cut)} of {len(slow)} cut in 8 s"
        assert time.monotonic() - start < 4
    finally:
        for s in slow:
            s.close()
    assert job.get("/status.json")[0] == 200  # and the page serves again


def test_pages_asked_for_too_fast_get_429(job):
    codes = [job.get("/status.json")[0] for _ in range(3 * int(status_http.MAX_PER_SECOND))]
    assert codes.count(200) >= status_http.MAX_PER_SECOND * 0.9, codes
    assert 429 in codes, codes
    time.sleep(1.0)
    assert job.get("/status.json")[0] == 200  # the allowance comes back


def test_lsgd_status_reads_the_real_page_with_the_secret(secret_job, tmp_path, capsys,
                                                          monkeypatch):
    """`python -m lsgd status` against this server's page: found through RUN_DIR, the token
    derived from the secret, the nodes and workers the heartbeats reported in its tables."""
    from lsgd.cli import main

    c0, c1 = secret_job.node(0), secret_job.node(1)
    secret_job.beat(c0, node_report(0))
    secret_job.beat(c1, node_report(1))
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    monkeypatch.delenv("LSGD_SECRET", raising=False)
    monkeypatch.delenv("SECRET_FILE", raising=False)
    monkeypatch.delenv("TLS_CA", raising=False)
    assert main(["status", "--run-dir", str(tmp_path)]) == 1  # no secret: refused, one line
    out, err = capsys.readouterr()
    assert "secret" in (out + err) and len((out + err).strip().splitlines()) == 1, out + err
    assert main(["status", "--run-dir", str(tmp_path), "--secret-file", str(secret)]) == 0
    out = capsys.readouterr().out
    assert f"job {JOB} (lsgd)" in out
    nodes = out.split("\nnodes\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [row.split()[:2] for row in nodes] == [["0", "yes"], ["1", "yes"]], out
    workers = out.split("\nworkers\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [row.split()[:2] for row in workers] == [["0", "0"], ["1", "0"], ["2", "1"], ["3", "1"]], out
    assert main(["status", "--run-dir", str(tmp_path), "--secret-file", str(secret), "--url"]) == 0
    url = capsys.readouterr().out.strip()
    assert url == f"{secret_job.url}/?token={secret_job.token}"
    code, _, _ = secret_job.get(url[len(secret_job.url):], token=None)  # the URL works as given
    assert code == 200


def test_lsgd_probe_is_ready_while_the_server_serves_and_not_after(secret_job, tmp_path):
    # a Kubernetes readiness probe: node 0 asks its own server, another node asks node 0's
    job = secret_job
    a = job.node(0)
    port = job.addr.rsplit(":", 1)[1]
    for env in ({"NODE": "0", "PORT": port},
                {"JOB_COMPLETION_INDEX": "1", "IP_ADDR": "127.0.0.1", "PORT": port}):
        ready, said = probe.check(env)
        assert ready, said
        assert said.endswith(f"the global server at 127.0.0.1:{port} is SERVING")
    a.leave(consumed=0, late=0, stop_job="interrupted")
    job.servicer.tick()
    ready, said = probe.check({"NODE": "0", "PORT": port})
    assert not ready and said.endswith("is NOT_SERVING"), said
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = free.getsockname()[1]
    free.close()
    ready, said = probe.check({"NODE": "0", "PORT": str(closed)})
    assert not ready and f"127.0.0.1:{closed} did not answer" in said
    assert probe.main({"NODE": "x"}) == 1  # one line, not a traceback


def test_lsgd_probe_live_fails_only_for_a_node_dropped_for_good_or_a_silent_own_server(
        secret_job, tmp_path):
    # a Kubernetes liveness probe: restart the container only where that can help
    job = secret_job
    port = job.addr.rsplit(":", 1)[1]
    run = tmp_path / "probe-run"
    node0 = {"NODE": "0", "PORT": port, "RUN_DIR": str(run)}
    node1 = {"JOB_COMPLETION_INDEX": "1", "IP_ADDR": "127.0.0.1", "PORT": port, "RUN_DIR": str(run)}
    alive, said = probe.check(node1, live=True)  # not joined yet: still starting
    assert alive and "not in the job yet" in said, said
    for i in (0, 1):  # the nodes join and keep their sessions, as a node does
        c = job.node(i)
        (run / f"node{i}").mkdir(parents=True)
        (run / f"node{i}" / "session").write_text(json.dumps({"session": c.session}))
    for env in (node0, node1):
        alive, said = probe.check(env, live=True)
        assert alive and "in the job" in said, said
    channel = grpc.insecure_channel(job.addr)
    stub = health_pb2_grpc.HealthStub(channel)
    for bad in ("lsgd.v1.Node/x", "lsgd.v1.Node/", "lsgd.v1.Node/-1", "lsgd.v1.Node/1234567",
                "lsgd.v1.Node/7"):
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service=bad), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, bad
    channel.close()
    real_clock = job.servicer.clock
    job.servicer.clock = lambda: real_clock() + 120  # both nodes silent past node_timeout (60 s)
    job.servicer.tick()
    # dropped, but a node cut off by a partition has RECONNECT_TIMEOUT to come back by itself
    assert job.servicer.drop_grace == job.config.reconnect_timeout + 10
    for env in (node0, node1):
        alive, said = probe.check(env, live=True)
        assert alive, said
    job.servicer.clock = lambda: real_clock() + 120 + job.servicer.drop_grace + 1
    for env in (node0, node1):  # still dropped after that: stuck
        alive, said = probe.check(env, live=True)
        assert not alive and "dropped this node" in said, said
    assert probe.main(node1, live=True) == 1
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = str(free.getsockname()[1])
    free.close()
    alive, said = probe.check(dict(node0, PORT=closed), live=True)  # its own server: dead
    assert not alive and "its own global server" in said and "did not answer" in said, said
    alive, said = probe.check(dict(node1, PORT=closed), live=True)  # node 0's: not ours to fix
    assert alive and "did not answer" in said, said
