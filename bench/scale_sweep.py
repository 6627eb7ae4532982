"""``python -m bench.scale --sweep N ...``: the paced scenario at each node count, each on a fresh
global server (issue 15), with ``--repeat`` spreads and ``--against REV`` comparisons, and the
command line of ``bench.scale`` (``main``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scale import CLIENT_PROCS, PARAM_COUNT, Scenario, client_main, run, run_scenario

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
