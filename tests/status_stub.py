"""A stand-in for node 0's status server, to develop and test the dashboard without a job.

It serves ``lsgd/status/dashboard.html`` at ``/`` and a simulated LSGD job in the schema of
docs/observability.md at ``/status.json`` and ``/history.json?since=N``: the job's clock runs
from ``started_s`` seconds in the past, so the page has a history to draw from its first poll.
Every request is logged (path and Authorization header) for the tests to check.

To look at the page by hand, or to make the docs' screenshot::

    python tests/status_stub.py --port 8765              # then open http://127.0.0.1:8765/
    python tests/status_stub.py --screenshot docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

DASHBOARD = Path(__file__).resolve().parents[1] / "lsgd" / "status" / "dashboard.html"
ROUND_EVERY = 256  # global iterations between global rounds
EVAL_EVERY = 4096
PAGE = 5000  # entries per list and call, as the real server


class StubJob:
    """A job that evolves with the wall clock: ``rate`` iterations a second up to ``budget``."""

    def __init__(self, nodes: int = 2, workers_per_node: int = 2, budget: int = 60000,
                 rate: float = 800.0, started_s: float = 30.0, seed: int = 1, restarts: int = 0) -> None:
        self.nodes, self.wpn, self.budget, self.rate = nodes, workers_per_node, budget, rate
        self.t0 = time.time() - started_s
        self.seed, self.restarts = seed, restarts
        self.entries: list[tuple[str, dict]] = []  # (list name, entry); seq = index + 1
        self.last: dict[int, dict] = {}  # newest point of each worker
        self.leader: dict | None = None
        self.rounds = 0
        self.lock = threading.Lock()

    def _loss(self, worker: int, it: int, rng: random.Random) -> float:
        return (2.3 * math.exp(-it / 9000) + 0.05) * (1 + 0.06 * worker) * rng.uniform(0.85, 1.15)

    def _advance(self, now: float) -> int:
        """Generate the rounds, points and evaluations up to the counter at ``now``."""
        counter = min(self.budget, int((now - self.t0) * self.rate))
        while (self.rounds + 1) * ROUND_EVERY <= counter:
            self.rounds += 1
            it, rid, t = self.rounds * ROUND_EVERY, self.rounds, self.rounds * ROUND_EVERY / self.rate
            rng = random.Random(self.seed * 100003 + rid)
            losses = {w: self._loss(w, it, rng) for w in range(self.nodes * self.wpn)}
            leader = min(losses, key=losses.get)
            self.leader = {"worker": leader, "node": leader // self.wpn, "loss": losses[leader],
                           "round": rid, "iteration": it}
            self._add("rounds", {"id": rid, "kind": "global", "iteration": it, "t": t, "leader": leader,
                                 "leader_node": leader // self.wpn, "loss": losses[leader],
                                 "latency_s": rng.uniform(0.002, 0.01)})
            for w, loss in losses.items():
                gap = loss / losses[leader] - 1  # the further behind, the further away
                far = 0.0 if w == leader else 0.6 * math.exp(-it / 20000) * (0.3 + gap) + 0.01
                point = {"t": t, "iteration": it, "worker": w, "node": w // self.wpn, "round": rid,
                         "loss": loss, "distance": far, "distance_to": "global_leader"}
                self.last[w] = point
                self._add("points", point)
            if it % EVAL_EVERY == 0:
                acc = 1 - 0.88 * math.exp(-it / 7000)
                for target, value in (("leader", acc), ("average", acc * 0.97 - 0.02)):
                    self._add("evaluations", {"t": t, "round": rid, "iteration": it, "target": target,
                                              "metric": "accuracy", "value": value, "worker": leader})
                    self._add("evaluations", {"t": t, "round": rid, "iteration": it, "target": target,
                                              "metric": "loss", "value": (1 - value) * 2.5,
                                              "worker": leader})
        return counter

    def _add(self, kind: str, entry: dict) -> None:
        self.entries.append((kind, {"seq": len(self.entries) + 1, **entry}))

    def status(self, now: float) -> dict:
        with self.lock:
            counter = self._advance(now)
            elapsed = now - self.t0
            done = counter >= self.budget
            workers = []
            for w in range(self.nodes * self.wpn):
                p = self.last.get(w, {})
                workers.append({"id": w, "node": w // self.wpn, "iterations": counter // (self.nodes * self.wpn),
                                "loss": p.get("loss"), "distance": p.get("distance"),
                                "distance_to": p.get("distance_to", ""), "round": p.get("round", 0),
                                "resets": 0, "respawns": 1 if w == 3 else 0, "training": not done})
            nodes = []
            for n in range(self.nodes):
                mine = [w for w in workers if w["node"] == n and w["loss"] is not None]
                best = min(mine, key=lambda w: w["loss"]) if mine else None
                nodes.append({"index": n, "alive": True, "left": False, "last_heard_s": 0.1 + 0.3 * n,
                              "steps": counter // self.nodes, "rate": self.rate / self.nodes,
                              "workers": self.wpn, "workers_training": 0 if done else self.wpn,
                              "reattaches": n % 2, "local_leader": best and {"worker": best["id"],
                                                                              "loss": best["loss"]}})
            evals = [e for kind, e in self.entries if kind == "evaluations"][-100:]
            return {"time": now, "job": {
                        "id": "demo", "algorithm": "lsgd", "num_groups": self.nodes,
                        "workers_per_node": self.wpn, "state": "finished" if done else "running",
                        "counter": counter, "budget": {"iterations": self.budget, "minutes": None},
                        "elapsed_s": elapsed, "rate": 0.0 if done else self.rate,
                        "eta_s": None if done else (self.budget - counter) / self.rate,
                        "rounds": {"local": 3 * self.rounds, "global": self.rounds, "total": 4 * self.rounds},
                        "stop_reason": "iteration budget reached" if done else None,
                        "restarts": self.restarts},
                    "leader": self.leader, "nodes": nodes, "workers": workers,
                    "evaluations": [{k: v for k, v in e.items() if k not in ("seq", "t")} for e in evals],
                    "history": {"next": len(self.entries) + 1}}

    def history(self, since: int, now: float) -> dict:
        with self.lock:
            self._advance(now)
            out: dict[str, list] = {"rounds": [], "points": [], "evaluations": []}
            nxt = len(self.entries) + 1
            for kind, entry in self.entries[max(0, since - 1):]:
                if len(out[kind]) == PAGE:  # a full list: the rest comes with the next call
                    nxt = entry["seq"]
                    break
                out[kind].append(entry)
            return {**out, "next": nxt}


class StubServer:
    """The HTTP side: a thread serving a ``StubJob`` on 127.0.0.1 (any free port).

    ``token``: require ``Authorization: Bearer <token>`` on the JSON endpoints. ``fail_after``:
    after that many answers to /status.json, drop every JSON request (a server that went away).
    ``restart``: ``(answers, job)``: after that many answers, serve ``job`` instead (a global
    server that was started again, its history numbered anew).
    """

    def __init__(self, job: StubJob | None = None, token: str | None = None,
                 fail_after: int | None = None, restart: tuple[int, StubJob] | None = None) -> None:
        self.job, self.token, self.fail_after, self.restart = job or StubJob(), token, fail_after, restart
        self.requests: list[tuple[str, str | None]] = []  # (path with query, Authorization)
        self.status_answers = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                stub.requests.append((self.path, self.headers.get("Authorization")))
                url = urlsplit(self.path)
                if url.path == "/":
                    return self._send(200, DASHBOARD.read_bytes(), "text/html; charset=utf-8")
                if url.path not in ("/status.json", "/history.json"):
                    return self._send(404, b"not found", "text/plain")
                if stub.fail_after is not None and stub.status_answers >= stub.fail_after:
                    self.close_connection = True  # no answer at all: the browser sees a network error
                    return None
                if stub.token and self.headers.get("Authorization") != f"Bearer {stub.token}":
                    return self._send(401, b'{"error": "unauthorized"}', "application/json")
                if url.path == "/status.json":
                    if stub.restart and stub.status_answers == stub.restart[0]:
                        stub.job = stub.restart[1]
                    stub.status_answers += 1
                    body = stub.job.status(time.time())
                else:
                    since = int(parse_qs(url.query).get("since", ["0"])[0])
                    body = stub.job.history(since, time.time())
                return self._send(200, json.dumps(body).encode(), "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def paths(self, endpoint: str) -> list[str]:
        return [p for p, _ in self.requests if urlsplit(p).path == endpoint]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="serve until Ctrl-C (0: any free port)")
    parser.add_argument("--screenshot", metavar="PNG", help="save a screenshot of the page and exit")
    parser.add_argument("--started", type=float, default=45.0, help="seconds the job has been running")
    args = parser.parse_args()
    server = StubServer(StubJob(started_s=args.started))
    try:
        if args.screenshot:
            import headless  # tests/headless.py, next to this file

            headless.screenshot(headless.find_browser() or "chromium", server.url, Path(args.screenshot),
                                window=(1280, 1000))
            print(f"wrote {args.screenshot}")
            return
        if args.port:  # serve on the port asked for instead
            server.close()
            server.httpd = ThreadingHTTPServer(("127.0.0.1", args.port), server.httpd.RequestHandlerClass)
        print(f"serving a simulated job at http://127.0.0.1:{server.httpd.server_address[1]}/ (Ctrl-C stops)")
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


if __name__ == "__main__":
    main()
