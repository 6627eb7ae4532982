"""What ``bench.scale`` measures of a finished scenario: latency per round and kind, where a
round's time goes (its phases), and the CPU of the server and the simulated nodes (sampled from
``/proc`` every ``SAMPLE_EVERY`` seconds while the scenario runs)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from bench.common import cpu_seconds

if TYPE_CHECKING:
    from bench.scale import Scenario

def _rounds(records: list[dict[str, Any]], kind: str) -> dict[int, list[dict[str, Any]]]:
    """The records of the job's rounds of ``kind`` that were not missed, by round."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == kind and not r["missed"]:
            by.setdefault(r["id"], []).append(r)
    return by


def _phases(records: list[dict[str, Any]], kind: str = "global") -> dict[str, float] | None:
    """Where a round's time goes, median over the job's rounds of ``kind`` (ms): ``learn``,
    from the first node to the last learning of the round (the credit answers that name it);
    ``close``, from the last node learning of it to the first barrier answer (the last
    reports, and the round's close); ``answers``, from the first barrier answer to the last
    (the fan-out); ``exchange``, from the last answer to the last node done (the leader's
    upload and the downloads after it)."""
    by = _rounds(records, kind)
    if not by:
        return None
    spans: dict[str, list[float]] = {"learn": [], "close": [], "answers": [], "exchange": []}
    for rs in by.values():
        learn = [r["learn"] for r in rs]
        answered = [r["learn"] + r["report_s"] for r in rs]
        done = [r["learn"] + r["latency_s"] for r in rs]
        spans["learn"].append(max(learn) - min(learn))
        spans["close"].append(min(answered) - max(learn))
        spans["answers"].append(max(answered) - min(answered))
        spans["exchange"].append(max(done) - max(answered))
    return {k: round(_pct([x * 1000 for x in v], 50), 1) for k, v in spans.items()}


def _round_cpu(records: list[dict[str, Any]], sampler: "_Sampler",
               kind: str) -> dict[str, float] | None:
    """The CPU the server and the simulated nodes (all client processes together) used while
    the job's rounds of ``kind`` ran, in % of one core: from the first node learning of each
    round to the last done, over all such rounds (which side sets a round's pace)."""
    spans = [(min(r["learn"] for r in rs), max(r["learn"] + r["latency_s"] for r in rs))
             for rs in _rounds(records, kind).values()]
    wall = sum(b - a for a, b in spans)
    if wall <= 0:
        return None
    used: dict[str, float] = {}
    for name in sampler.pids:
        side = "server" if name == "server" else "clients"
        for a, b in spans:
            x, y = sampler.at(name, a), sampler.at(name, b)
            if x is None or y is None:
                return None
            used[side] = used.get(side, 0.0) + (y - x)
    return {k: round(100.0 * v / wall, 1) for k, v in used.items()}


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
