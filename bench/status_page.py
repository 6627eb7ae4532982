"""The status page's cost on the global server (issue 10): ``python -m bench.scale --status``.

The paced 64 x 8 run of ``bench.scale`` twice on fresh global servers: as before the status page
existed (heartbeats without reports, ``STATUS_PORT=0``), and with every heartbeat carrying its
node's report of 8 workers (``bench.scale._Beat``) and a browser (``Poller``) reading
/status.json, /history.json?since= and /metrics every second. Target: the global server's CPU
grows by less than 5% of one core.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Result
from bench.scale import CLIENT_PROCS, TARGET, Scenario, _pct, run_scenario


class Poller(threading.Thread):
    """A browser on the status page: every ``every`` s, /status.json, /history.json from the
    last answer's ``next`` (as the dashboard pages through it) and /metrics."""

    def __init__(self, port_file: Path, every: float) -> None:
        super().__init__(daemon=True)
        self.port_file, self.every = port_file, every
        self.halt = threading.Event()
        self.times: dict[str, list[float]] = {"status": [], "history": [], "metrics": []}
        self.bytes = 0
        self.errors: list[tuple[float, str]] = []  # (when, what)

    def run(self) -> None:
        import urllib.request

        end = time.monotonic() + 30
        while not self.port_file.exists() and time.monotonic() < end and not self.halt.is_set():
            time.sleep(0.05)
        try:
            base = f"http://127.0.0.1:{int(self.port_file.read_text())}"
        except (OSError, ValueError) as exc:
            self.errors.append((time.monotonic(), f"status page: no port ({exc})"))
            return
        since = 0
        while not self.halt.wait(self.every):
            for name, path in (("status", "/status.json"), ("history", f"/history.json?since={since}"),
                               ("metrics", "/metrics")):
                t = time.monotonic()
                try:
                    with urllib.request.urlopen(base + path, timeout=5) as resp:
                        body = resp.read()
                except OSError as exc:
                    if len(self.errors) < 5:
                        self.errors.append((time.monotonic(), f"status page {path}: {exc}"))
                    continue
                self.times[name].append(time.monotonic() - t)
                self.bytes += len(body)
                if name == "history":
                    since = json.loads(body)["next"]

    def errors_before(self, t: float) -> list[str]:
        """The failed requests before ``t`` (once the nodes have left, the page goes away
        with the job: a request then may meet a server that is exiting)."""
        return [what for when, what in self.errors if when < t]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": self.bytes, "errors_incl_after_the_end": len(self.errors)}
        for name, xs in self.times.items():
            ms = [x * 1000 for x in xs]
            out[name] = {"n": len(ms), "p50_ms": round(_pct(ms, 50), 2),
                         "max_ms": round(max(ms), 2) if ms else None}
        return out


def run_status(quick: bool) -> list[Result]:
    """The status page's cost on the global server: the paced 64 x 8 run without it (as before
    issue 10), and with reports in every heartbeat and a browser polling every second."""
    rounds = 16 if quick else 64
    reps = 1 if quick else 3  # alternated, so that a busy moment of the machine hits both sides
    plain = Scenario("64x8-paced-plain", nodes=64, workers=8, l_comm=16, g_comm=64,
                     rounds=rounds, step_ms=20.0)
    watched = dataclasses.replace(plain, name="64x8-paced-watched", reports=True, status=True,
                                  poll_s=1.0)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="lsgd-bench-status-") as tmp:
        for rep in range(reps):
            where = Path(tmp) / f"pair{rep}"
            where.mkdir()
            pairs.append((run_scenario(plain, CLIENT_PROCS, where),
                          run_scenario(watched, CLIENT_PROCS, where)))
    deltas = [b["server_cpu_pct"] - a["server_cpu_pct"] for a, b in pairs
              if a["server_cpu_pct"] is not None and b["server_cpu_pct"] is not None]
    cpu_a = _median([a["server_cpu_pct"] for a, _ in pairs])
    cpu_b = _median([b["server_cpu_pct"] for _, b in pairs])
    delta = round(_median(deltas), 1) if deltas else None
    ok = all(a["ok"] and b["ok"] for a, b in pairs)  # b: a failed poll before the end is an error
    keep = ("ok", "errors", "server_cpu_pct", "client_cpu_pct", "window_s", "rounds_per_s",
            "p99_ms", "polls", "server_warnings")
    extra = {"pairs": [{r["name"] if "name" in r else name: {k: v for k, v in r.items() if k in keep}
                        for name, r in ((plain.name, a), (watched.name, b))} for a, b in pairs],
             "deltas_pct_of_core": [round(d, 1) for d in deltas]}
    return [Result(TARGET, "global server CPU, 64 nodes x 8 workers (20 ms steps), heartbeats "
                   "with reports and the status page polled every second (median of "
                   f"{reps} alternated pairs)",
                   float("nan") if cpu_b is None else cpu_b, "% of one core", cpu_a,
                   "same runs without reports or status page (STATUS_PORT=0)",
                   delta, "median of the pairs' differences, % of one core",
                   "< 5% of a core more", ok and delta is not None and delta < 5.0,
                   extra=extra)]


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
