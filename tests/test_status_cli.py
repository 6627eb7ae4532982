"""`lsgd status` against a stub status page (127.0.0.1, port 0) serving the documented schema.

The real server (lsgd/status/http.py) is tested on its own; these check the client: the table,
--json, --url, the token, TLS, --watch, and the one-line errors.
"""

from __future__ import annotations

import copy
import json
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lsgd.cli import main
from lsgd.security import make_certs
from lsgd.status import client as status_client
from lsgd.status import status_token
from lsgd.status.table import render

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-for-the-status-tests-0123456789"

STATUS = {
    "time": 1795000000.0,
    "job": {"id": "demo", "algorithm": "lsgd", "num_groups": 2, "workers_per_node": 2,
            "state": "running", "counter": 2400, "budget": {"iterations": 6000, "minutes": None},
            "elapsed_s": 3.1, "rate": 812.5, "eta_s": 4.4,
            "rounds": {"local": 30, "global": 9, "total": 39}, "stop_reason": None, "restarts": 0},
    "leader": {"worker": 3, "node": 1, "loss": 0.123, "round": 39, "iteration": 2304},
    "nodes": [
        {"index": 0, "alive": True, "left": False, "last_heard_s": 0.4, "steps": 1200,
         "rate": 406.2, "workers": 2, "workers_training": 2, "reattaches": 0,
         "local_leader": {"worker": 1, "loss": 0.12}},
        {"index": 1, "alive": False, "left": False, "last_heard_s": 7.5, "steps": 1200,
         "rate": 0.0, "workers": 2, "workers_training": 1, "reattaches": 2, "local_leader": None},
    ],
    "workers": [
        {"id": w, "node": w // 2, "iterations": 600 + w, "loss": 0.2 + w / 100,
         "distance": 0.53 if w != 3 else None, "distance_to": "global_leader", "round": 39,
         "resets": 1 if w == 2 else 0, "respawns": 0, "training": w != 3}
        for w in range(4)],
    "evaluations": [
        {"round": 33, "iteration": 2048, "target": t, "metric": "accuracy", "value": v, "worker": 1}
        for t, v in (("leader", 0.9712), ("average", 0.9655))],
    "history": {"next": 1234},
}


class Stub:
    """A status page: serves ``docs`` in turn (the last one again and again)."""

    def __init__(self, docs: list, token: str | None = None, tls: tuple | None = None) -> None:
        self.docs, self.token, self.requests = list(docs), token, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                stub.requests.append((self.path, dict(self.headers)))
                if stub.token and self.headers.get("Authorization") != f"Bearer {stub.token}":
                    self._send(401, b'{"error": "token"}')
                    return
                doc = stub.docs.pop(0) if len(stub.docs) > 1 else stub.docs[0]
                self._send(200, doc if isinstance(doc, bytes) else json.dumps(doc).encode())

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def serve():
    stubs: list[Stub] = []

    def start(docs: list, **kw: object) -> Stub:
        stubs.append(Stub(docs, **kw))
        return stubs[-1]

    yield start
    for s in stubs:
        s.stop()


@pytest.fixture(autouse=True)
def no_job_env(monkeypatch):
    for var in ("LSGD_SECRET", "SECRET_FILE", "TLS_CA", "RUN_DIR"):
        monkeypatch.delenv(var, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_shows_job_leader_nodes_workers_and_evaluations(serve, capsys):
    stub = serve([STATUS])
    code, out, err = run(capsys, "--address", stub.address)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("job demo (lsgd): running")
    assert "2400 / 6000 iterations (40%)" in lines[0] and "812.5 it/s" in lines[0]
    assert "ETA 4.4 s" in lines[0] and "rounds 30 local + 9 global" in lines[0]
    assert lines[1] == "leader: worker 3 on node 1, loss 0.123 (round 39, iteration 2304)"
    node_rows = [line.split() for line in lines[lines.index("nodes") + 2:lines.index("workers") - 1]]
    assert node_rows[0][:3] == ["0", "yes", "0.4"] and node_rows[0][-2:] == ["1", "(0.12)"]
    assert node_rows[1][:3] == ["1", "no", "7.5"] and node_rows[1][-1] == "-"
    start = lines.index("workers") + 2
    workers = {int(r.split()[0]): r.split() for r in lines[start:start + 4]}
    assert workers[0][:5] == ["0", "0", "600", "0.2", "0.53"] and workers[0][5:7] == ["global", "leader"]
    assert workers[2][-3:] == ["1", "0", "yes"]  # resets, respawns, training
    assert workers[3][4] == "-" and workers[3][-1] == "no"  # no distance yet, not training
    assert "evaluations (last 2 of 2)" in out
    assert any(r.split()[2:5] == ["leader", "accuracy", "0.9712"] for r in lines)
    assert stub.requests[0][0] == "/status.json" and "Authorization" not in stub.requests[0][1]


def test_json_prints_the_page_as_served(serve, capsys):
    stub = serve([STATUS])
    code, out, _ = run(capsys, "--address", stub.address, "--json")
    assert code == 0 and json.loads(out) == STATUS


def test_url_carries_the_token_without_calling_the_page(serve, capsys, monkeypatch):
    stub = serve([STATUS])
    monkeypatch.setenv("LSGD_SECRET", SECRET)
    code, out, _ = run(capsys, "--address", stub.address, "--url")
    assert code == 0
    assert out.strip() == f"http://{stub.address}/?token={status_token(SECRET.encode())}"
    assert not stub.requests
    monkeypatch.delenv("LSGD_SECRET")
    assert run(capsys, "--address", stub.address, "--url")[1].strip() == f"http://{stub.address}/"


def test_token_from_the_secret_file_is_sent_and_a_missing_one_is_named(serve, capsys, tmp_path):
    token = status_token(SECRET.encode())
    stub = serve([STATUS], token=token)
    code, out, err = run(capsys, "--address", stub.address)
    assert code == 1 and not out
    assert err.count("\n") == 1 and "needs the job's secret" in err and "--secret-file" in err
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    code, out, err = run(capsys, "--address", stub.address, "--secret-file", str(secret))
    assert code == 0, err
    assert "job demo" in out
    assert stub.requests[-1][1]["Authorization"] == f"Bearer {token}"
    wrong = tmp_path / "wrong"
    wrong.write_text("another-secret-of-enough-length-0000")
    code, _, err = run(capsys, "--address", stub.address, "--secret-file", str(wrong))
    assert code == 1 and "refused the token" in err and err.count("\n") == 1


def test_unreachable_page_is_one_line_naming_the_address(capsys):
    port = free_port()
    code, out, err = run(capsys, "--address", f"127.0.0.1:{port}")
    assert code == 1 and not out
    assert err.count("\n") == 1
    assert f"127.0.0.1:{port}" in err and "connection refused" in err and "STATUS_PORT=0" in err


def test_default_address_is_the_port_node_0_wrote(serve, capsys, tmp_path, monkeypatch):
    stub = serve([STATUS])
    (tmp_path / "run" / "global").mkdir(parents=True)
    (tmp_path / "run" / "global" / "status.port").write_text(stub.address.split(":")[1] + "\n")
    code, out, err = run(capsys, "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert out.startswith("job demo")
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))  # train.sh's variable works too
    code, out, err = run(capsys)
    assert code == 0, err
    assert status_client.base_url(None, str(tmp_path / "none"), tls=False) == "http://127.0.0.1:50052"


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:http", "ftp://127.0.0.1:1", ":80"])
def test_bad_address_is_a_usage_error(capsys, address):
    code, out, err = run(capsys, "--address", address)
    assert code == 2 and not out and "HOST:PORT" in err and err.count("\n") == 1


def test_an_answer_that_is_not_a_status_page(serve, capsys):
    for body in (b"<html>hello</html>", b'{"no": "job"}', b"[1, 2]", b"[" * 100_000):
        stub = serve([body])
        code, _, err = run(capsys, "--address", stub.address)
        assert code == 1 and "not an lsgd status page" in err


def test_https_with_the_job_ca(serve, capsys, tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs, ["127.0.0.1"])
    stub = serve([STATUS], tls=(str(certs / "node0.pem"), str(certs / "node0-key.pem")))
    code, out, err = run(capsys, "--address", stub.address, "--tls-ca", str(certs / "ca.pem"))
    assert code == 0, err
    assert out.startswith("job demo")
    code, _, err = run(capsys, "--address", stub.address)  # plain HTTP to a TLS port
    assert code == 1 and err.count("\n") == 1 and "--tls-ca" in err
    code, _, err = run(capsys, "--address", stub.address, "--tls-ca", str(tmp_path / "missing.pem"))
    assert code == 2 and "--tls-ca" in err


def test_watch_redraws_until_the_job_is_over(serve, capsys, monkeypatch):
    monkeypatch.setattr(status_client, "WATCH_EVERY", 0.01)
    later = copy.deepcopy(STATUS)
    later["job"].update(counter=4800)
    done = copy.deepcopy(STATUS)
    done["job"].update(state="finished", counter=6000, stop_reason="iteration budget reached")
    stub = serve([STATUS, later, done])
    code, out, err = run(capsys, "--address", stub.address, "--watch")
    assert code == 0, err
    assert [line.split(": ")[1].split()[0] for line in out.splitlines() if line.startswith("job demo")] \
        == ["running", "running", "finished"]
    assert "4800 / 6000" in out and "stopped: iteration budget reached" in out
    assert len(stub.requests) == 3


def test_watch_json_prints_one_line_per_redraw(serve, capsys, monkeypatch):
    monkeypatch.setattr(status_client, "WATCH_EVERY", 0.01)
    done = copy.deepcopy(STATUS)
    done["job"]["state"] = "stopped"
    stub = serve([STATUS, done])
    code, out, _ = run(capsys, "--address", stub.address, "--watch", "--json")
    assert code == 0 and [json.loads(line)["job"]["state"] for line in out.splitlines()] \
        == ["running", "stopped"]


def test_watch_ends_when_the_page_goes_away(serve, capsys):
    stub = serve([STATUS])
    client = status_client.StatusClient(f"http://{stub.address}", timeout=1.0)
    t = threading.Timer(0.3, stub.stop)
    t.start()
    code = status_client.watch(client, as_json=False, every=0.05, grace=0.5)
    t.join()
    out, err = capsys.readouterr()
    assert code == 1  # it was running when it went away: not a normal end
    assert "job demo" in out and "cannot reach the status page" in err


def test_watch_of_a_page_never_reached_fails_at_once(capsys):
    code, _, err = run(capsys, "--address", f"127.0.0.1:{free_port()}", "--watch")
    assert code == 1 and err.count("\n") == 1


def test_render_survives_odd_and_hostile_fields():
    odd = {"job": {"state": "stopped\x1b[2J", "counter": "many", "budget": None, "rate": float("nan"),
                   "stop_reason": "bye\x1b]0;pwned\x07", "rounds": [1]},
           "leader": "nobody", "nodes": [None, {"index": 0, "alive": "yes?"}], "workers": "none",
           "evaluations": [{"value": True}]}
    text = render(odd)
    assert "\x1b" not in text and "\x07" not in text
    assert text.splitlines()[0].startswith("job - (-): stopped?[2J  - iterations")
    assert "stopped: bye?]0;pwned?" in text
    assert render({"job": {}}).splitlines()[0].startswith("job - (-): ?")


def test_a_silent_or_garbled_peer_ends_in_bounded_time():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        client = status_client.StatusClient(f"http://127.0.0.1:{port}", timeout=0.5)
        with pytest.raises(status_client.StatusError, match=r"no answer in 0.5 s"):
            client.fetch()  # accepted by the kernel, never answered

    def garble(sock: socket.socket) -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"SSH-2.0-not-http\r\n")

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        t = threading.Thread(target=garble, args=(listener,), daemon=True)
        t.start()
        client = status_client.StatusClient(f"http://127.0.0.1:{listener.getsockname()[1]}",
                                            timeout=2.0)
        with pytest.raises(status_client.StatusError, match="broke off the answer"):
            client.fetch()
        t.join(5)
