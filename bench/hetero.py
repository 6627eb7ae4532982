"""Target 8: mixed node speeds. How much of its own pace a fast node keeps next to a slow one.

Two nodes, one worker each (``bench.jobs:paced``): node 0's steps take 5 ms, node 1's 50 ms
(sleeps, standing for work done elsewhere, so the two cores are left to lsgd). For each rule
(lsgd, easgd, easgd-async, downpour, gosgd) the fast node's steps per second over the window in
which both nodes train, against the baseline measured in the same run: the fast node alone
(one node, easgd-async). A synchronous rule meets in rounds, but each node's share of a period
is in proportion to its speed (lsgd/global_server/shares.py), so the fast node is not held to
the slow one's pace; an asynchronous rule has no barrier. Also per rule: the slow node's rate,
how long the fast node idles at the end of the time budget (its last ``step()`` call: the final
round waits for the credits the slow node still holds), and the CPU of the local servers (node
main processes, the sync thread included) and of the global server; and, for easgd-async, the
same with a 10M-parameter model: an exchange every 64 steps (the default) at ``SYNC_EVERY`` 0.05,
and every 4 steps at 0.05 and 1 s (the sync thread sends and fetches the whole vector at each
sync; compare these rows with each other).

    python -m bench.hetero [--quick]      # ~2 minutes (--quick: ~1); prints the table
    python -m bench --only hetero          # the same into bench/results.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .common import Result, lsgd_env, read_json, run_node
from .throughput import _sample_cpu

TARGET = "8. mixed node speeds"
FAST, SLOW = 0.005, 0.05  # seconds per step of node 0's and node 1's worker
RULES = ("lsgd", "easgd", "easgd-async", "downpour", "gosgd")
SYNCHRONOUS = {"lsgd", "easgd"}
BIG = 10_000_000  # parameters of the sync-cost runs (40 MB)
BIG_RUNS = ((64, 0.05), (4, 0.05), (4, 1.0))  # (G_COMM: steps between exchanges, SYNC_EVERY);
# exchanging every 4 steps (~25 ms), the fast node's node syncs as often as SYNC_EVERY lets it


def window_rate(workers: list[dict], who: dict) -> float:
    """Steps per second of ``who`` while every worker in ``workers`` trains.

    Each record holds ``ends``: the time each ``worker.step`` call returned. The window runs
    from the last worker's first step to the first worker's second-to-last ``step()`` return
    (the last call is the one that waits for the final round), so start-up and the end of the
    job count against no rule.
    """
    lo = max(w["ends"][0] for w in workers)
    hi = min(w["ends"][-2] for w in workers)
    if hi - lo < 0.5:
        raise RuntimeError(f"the workers trained together for {hi - lo:.2f} s only")
    ends = np.asarray(who["ends"])
    done = np.arange(1, ends.size + 1)
    return float(np.interp(hi, ends, done) - np.interp(lo, ends, done)) / (hi - lo)


def job(rule: str, nodes: int, seconds: float, run_dir: Path, size: int = 100_000,
        sync_every: float = 0.05, g_comm: int = 64) -> dict:
    """One job of ``nodes`` nodes x 1 worker through ``train.sh``; step times and CPU."""
    env = lsgd_env(ENTRY="bench.jobs:paced", NUM_GROUPS=nodes, WORKERS=1, MINUTES=seconds / 60,
                   ITERATIONS="", PORT=0, RUN_DIR=run_dir, ALGORITHM=rule, ALPHA=0.25,
                   SYNC_EVERY=sync_every, G_COMM=g_comm, L_COMM=min(16, g_comm), BENCH_SIZE=size,
                   BENCH_STEP_SECONDS=f"{FAST},{SLOW}",
                   JOB_ID=f"benchhet{rule.replace('-', '')}{nodes}-{size}-{g_comm}-{int(sync_every * 100)}")
    procs = [run_node(0, env)]
    port = run_dir / "global.port"
    end = time.monotonic() + 60
    while nodes > 1 and not (port.exists() and port.read_text().strip()):
        if procs[0].poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"node 0 did not start: {(run_dir / 'node0.log').read_text()[-2000:]}")
        time.sleep(0.05)
    if nodes > 1:
        procs.append(run_node(1, dict(env, PORT=port.read_text().strip())))
    stop, samples = threading.Event(), {}
    samplers = [threading.Thread(target=_sample_cpu, args=(p.pid, stop, samples, 1.0), daemon=True)
                for p in procs]
    for s in samplers:
        s.start()
    try:
        for i, p in enumerate(procs):
            if p.wait(seconds + 120) != 0:
                raise RuntimeError(f"{rule}: node {i} failed: "
                                   f"{(run_dir / f'node{i}.log').read_text()[-2000:]}")
    finally:
        stop.set()
        for s in samplers:
            s.join(5)
        for p in procs:
            if p.poll() is None:
                p.kill()
    workers = [json.loads(p.read_text()) for p in sorted(run_dir.glob("paced-*.json"))]
    g = read_json(run_dir / "global" / "summary.json")
    done = sum(sum(read_json(run_dir / f"node{i}" / "summary.json")["workers"].values())
               for i in range(nodes))
    if not g["counter"] == done == sum(len(w["ends"]) for w in workers):
        raise RuntimeError(f"{rule}: counter {g['counter']}, workers' iterations {done}, "
                           f"step() calls {sum(len(w['ends']) for w in workers)}")

    def busy(pid: int) -> float:  # share of one core while it trained (after a 1 s warm-up)
        s = samples.get(pid, [])
        return (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]) if len(s) > 1 else float("nan")

    syncs = [read_json(run_dir / f"node{i}" / "summary.json").get("async", {}).get("syncs")
             for i in range(nodes)]
    return {"workers": workers, "rounds": g["rounds"], "syncs": syncs,
            "local_cpu": [busy(p.pid) for p in procs], "global_cpu": busy(g["pid"])}


def run(quick: bool, seconds: float | None = None) -> list[Result]:
    seconds = seconds or (4.0 if quick else 8.0)
    out: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        alone = job("easgd-async", 1, seconds, Path(tmp) / "alone")
        (a,) = alone["workers"]
        base = window_rate([a], a)
        for rule in RULES:
            r = job(rule, 2, seconds, Path(tmp) / rule)
            out.append(_row(rule, r, base, f"fast node's steps/s next to a 10x slower node, {rule}"))
        if not quick:
            for g_comm, every in BIG_RUNS:
                r = job("easgd-async", 2, seconds, Path(tmp) / f"big{g_comm}-{every}", size=BIG,
                        sync_every=every, g_comm=g_comm)
                out.append(_row("easgd-async", r, base, "fast node's steps/s, easgd-async, 10M "
                                f"parameters, every {g_comm} steps, SYNC_EVERY={every:g}",
                                size=BIG, sync_every=every, g_comm=g_comm))
    return out


def _row(rule: str, r: dict, base: float, metric: str, size: int = 100_000,
         sync_every: float = 0.05, g_comm: int = 64) -> Result:
    fast = next(w for w in r["workers"] if w["node"] == 0)
    slow = next(w for w in r["workers"] if w["node"] == 1)
    got = window_rate(r["workers"], fast)
    synchronous = rule in SYNCHRONOUS
    # A synchronous rule still meets at every round, but each node's share of a period is in
    # proportion to its speed (shares.py), so the fast node is no longer held to the slow
    # one's pace; the first period (speeds not known yet) is shared by node count.
    bar = 0.7 if synchronous else 0.9
    goal = f">= {bar}x" + (" (shares by speed)" if synchronous else "")
    return Result(
        TARGET, metric, got, "steps/s", baseline=base,
        baseline_name="fast node alone, same run", ratio=got / base, ratio_note="value / baseline",
        goal=goal if size == 100_000 else "",
        met=(got / base >= bar) if size == 100_000 else None,
        extra={"rule": rule, "parameters": size, "sync_every": sync_every, "g_comm": g_comm,
               "syncs": r["syncs"],
               "slow_steps_per_s": window_rate(r["workers"], slow),
               "fast_steps": len(fast["ends"]), "slow_steps": len(slow["ends"]),
               "fast_idle_at_end_s": fast["ends"][-1] - fast["ends"][-2],
               "fast_seconds_in_step": fast["in_step"],
               "fast_span_s": fast["ends"][-1] - fast["start"],
               "rounds": r["rounds"], "local_server_cpu_pct": [100 * c for c in r["local_cpu"]],
               "global_server_cpu_pct": 100 * r["global_cpu"]})


def table(results: list[Result]) -> str:
    lines = ["| run | fast node steps/s | ratio to alone | slow node steps/s | fast node idle at "
             "the end, s | local servers' CPU, % of a core | global server's CPU | syncs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.extra
        name = e["rule"] + ("" if e["parameters"] == 100_000 else
                            f", {e['parameters'] / 1e6:g}M params, every {e['g_comm']} steps, "
                            f"SYNC_EVERY={e['sync_every']:g}")
        lines.append(f"| {name} | {r.value:.0f} | **{r.ratio:.2f}x** | {e['slow_steps_per_s']:.1f} | "
                     f"{e['fast_idle_at_end_s']:.2f} | "
                     f"{' + '.join(f'{c:.0f}' for c in e['local_server_cpu_pct'])} | "
                     f"{e['global_server_cpu_pct']:.0f} | "
                     f"{' + '.join('–' if n is None else str(n) for n in e.get('syncs', []))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.hetero", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 s budgets, no 10M-parameter runs")
    args = parser.parse_args()
    t0 = time.monotonic()
    results = run(args.quick)
    print(f"fast node alone: {results[0].baseline:.0f} steps/s ({FAST * 1000:g} ms steps; "
          f"slow node {SLOW * 1000:g} ms); {time.monotonic() - t0:.0f} s")
    print(table(results))
