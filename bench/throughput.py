"""Targets 5 and 6: training throughput and time to accuracy on the medium workload.

Workload: ``bench.workload`` (2.1M-parameter numpy MLP, ~10 ms per step on one core, batch 64).
Baseline, measured in the same run: the same training loop alone in one process, without lsgd.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .common import REPO, Result, cpu_seconds, lsgd_env, read_json, run_node

BATCH = 64


def _plain_loop(seconds: float, eval_every: int, out) -> None:
    """The workload alone, no lsgd: (steps, seconds, curve)."""
    from .workload import NumpyMLP, make_data

    model = NumpyMLP(seed=0, lr=0.05, momentum=0.9)
    x, y = make_data(20000, seed=1)
    xt, yt = make_data(1000, seed=99)
    rng = np.random.default_rng([0, 0])
    curve, marks, steps = [], [], 0
    t0 = time.time()
    while time.time() - t0 < seconds:
        idx = rng.integers(0, len(x), BATCH)
        model.step(x[idx], y[idx])
        steps += 1
        if steps % 10 == 0:
            marks.append((time.time(), steps))
        if eval_every and steps % eval_every == 0:
            curve.append((time.time(), steps, model.accuracy(xt, yt)))
    out.put({"steps": steps, "first": t0, "last": time.time(), "curve": curve, "marks": marks,
             "final": model.accuracy(xt, yt)})


def plain(seconds: float, eval_every: int = 0, copies: int = 1) -> list[dict]:
    """Run ``copies`` independent plain loops at once (1: the baseline; 2: the machine's ceiling)."""
    ctx = mp.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plain_loop, args=(seconds, eval_every, q), daemon=True)
             for _ in range(copies)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=seconds + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(10)


def _sample_cpu(pid: int, stop: threading.Event, samples: dict[int, list[tuple[float, float]]],
                warmup: float) -> None:
    """Record (time, cpu seconds) of ``pid`` and its descendants every 0.25 s after ``warmup``."""
    from .common import children

    t0 = time.monotonic()
    while not stop.wait(0.25):
        if time.monotonic() - t0 < warmup:
            continue
        todo, seen = [pid], set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            try:
                samples.setdefault(p, []).append((time.monotonic(), cpu_seconds(p)))
                todo += children(p)
            except (OSError, IndexError):
                pass


def lsgd_run(workers: int, seconds: float, run_dir: Path, algorithm: str = "lsgd",
             eval_every: int = 0, **knobs: object) -> dict:
    """Run the workload under lsgd on one node; returns per-worker records and server CPU.
    ``knobs`` are more of the job's (``SYNC_EVERY``, ``RULE_ARGS``, ...)."""
    env = lsgd_env(ENTRY="bench.jobs:mlp", WORKERS=workers, MINUTES=seconds / 60, ITERATIONS="",
                   PORT=0, RUN_DIR=run_dir, JOB_ID=f"benchthr{workers}{algorithm}",
                   ALGORITHM=algorithm, BATCH_SIZE=BATCH, LR=0.05, MOMENTUM=0.9,
                   BENCH_EVAL_EVERY=eval_every, ALPHA=min(0.1, 0.9 / workers), **knobs)
    node = run_node(0, env, timeout=seconds + 120)
    stop, samples = threading.Event(), {}
    sampler = threading.Thread(target=_sample_cpu, args=(node.pid, stop, samples, 4.0), daemon=True)
    sampler.start()
    try:
        if node.wait(seconds + 120) != 0:
            raise RuntimeError(f"lsgd run failed: {(run_dir / 'node0.log').read_text()[-2000:]}")
    finally:
        stop.set()
        sampler.join(5)
        if node.poll() is None:
            node.kill()
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("mlp-*.json"))]
    gpid = read_json(run_dir / "global" / "summary.json")["pid"]

    def busy(pid: int) -> float:
        s = samples.get(pid, [])
        return (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]) if len(s) > 1 else float("nan")

    return {"records": records, "local_cpu": busy(node.pid), "global_cpu": busy(gpid),
            "summary": read_json(run_dir / "node0" / "summary.json")}


def rate(records: list[dict], batch: int = BATCH) -> float:
    """Steady-state samples per second of all workers together.

    Counted over the window in which every worker was training (from the last one's start to
    the first one's stop), from step marks each worker records every 10 steps, so start-up skew
    and the final round do not count against either lsgd or the plain loops.
    """
    lo = max(r["first"] for r in records)
    hi = min(r["last"] for r in records)
    if hi - lo < 1.0:
        raise RuntimeError("workers did not train at the same time for 1 s")
    total = 0.0
    for r in records:
        t, n = zip(*r["marks"])
        total += float(np.interp(hi, t, n) - np.interp(lo, t, n))
    return total * batch / (hi - lo)


def run_throughput(quick: bool) -> list[Result]:
    seconds = 15.0 if quick else 30.0
    (base,) = plain(seconds)
    base_rate = rate([base])
    ceiling = rate(plain(seconds, copies=2))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in (1, 2, 4):
            r = lsgd_run(w, seconds, Path(tmp) / f"w{w}")
            got = rate(r["records"])
            servers = (r["local_cpu"] + r["global_cpu"]) * 100
            out.append(Result(
                "5. training throughput", f"samples/s, {w} worker(s) on one node (2 cores)", got,
                "samples/s", baseline=base_rate, baseline_name="same loop alone, no lsgd",
                ratio=got / base_rate, ratio_note="lsgd / baseline",
                goal=">= 1.85x with 2 workers" if w == 2 else "",
                met=(got / base_rate >= 1.85) if w == 2 else None,
                extra={"two_plain_loops_samples_per_s": ceiling,
                       "ratio_to_two_plain_loops": got / ceiling if w == 2 else None,
                       "time_in_lsgd_pct": 100 * sum(x["in_lsgd_s"] for x in r["records"])
                       / sum(x["last"] - x["first"] for x in r["records"]),
                       "local_server_cpu_pct": r["local_cpu"] * 100,
                       "global_server_cpu_pct": r["global_cpu"] * 100,
                       "steps": sum(x["steps"] for x in r["records"]),
                       "ms_per_step_baseline": 1000 * (base["last"] - base["first"]) / base["steps"]}))
            if w == 2:
                out.append(Result(
                    "5. training throughput", "samples/s, 2 workers, against the machine's ceiling",
                    got, "samples/s", baseline=ceiling,
                    baseline_name="two independent plain loops at once, no lsgd",
                    ratio=got / ceiling, ratio_note="lsgd / ceiling", goal="lsgd costs < 3%",
                    met=got / ceiling >= 0.97))
                out.append(Result(
                    "5. training throughput", "local + global server CPU while 2 workers train",
                    servers, "% of a core", goal="< 5% of a core", met=servers < 5,
                    extra={"local_server_cpu_pct": r["local_cpu"] * 100,
                           "global_server_cpu_pct": r["global_cpu"] * 100}))
    return out


def mean_curve(curves: list[list]) -> list[tuple[float, int, float]]:
    """The workers' curves averaged point by point (no picking of the luckiest worker)."""
    n = min(len(c) for c in curves)
    return [(max(c[i][0] for c in curves), curves[0][i][1],
             sum(c[i][2] for c in curves) / len(curves)) for i in range(n)]


def time_to(curve: list, target: float, t0: float, smooth: int = 3) -> float | None:
    """Seconds until the mean of ``smooth`` consecutive evaluations reaches ``target``."""
    for i in range(smooth - 1, len(curve)):
        if sum(c[2] for c in curve[i - smooth + 1 : i + 1]) / smooth >= target:
            return curve[i][0] - t0
    return None


def run_accuracy(quick: bool, plot: Path | None = None) -> list[Result]:
    seconds = 20.0 if quick else 45.0
    target = 0.65  # on the rising part of every curve; the task plateaus near 0.70
    every = 25
    runs: dict[str, dict] = {}
    (base,) = plain(seconds, every)
    runs["single-worker SGD"] = {"t0": base["first"], "curves": [base["curve"]],
                                 "final": base["final"]}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ("lsgd", "easgd"):
            r = lsgd_run(2, seconds, Path(tmp) / algo, algorithm=algo, eval_every=every)
            ev = r["summary"].get("evaluation", {})
            final = ev.get("leader" if algo == "lsgd" else "center", {}).get("accuracy", float("nan"))
            runs[f"{algo.upper()} (2 workers)"] = {
                "t0": min(x["first"] for x in r["records"]),
                "curves": [x["curve"] for x in r["records"]], "final": final}
    out = []
    base_t = time_to(runs["single-worker SGD"]["curves"][0], target, runs["single-worker SGD"]["t0"])
    for name, run in runs.items():
        t = time_to(mean_curve(run["curves"]), target, run["t0"])
        out.append(Result(
            "6. time to accuracy",
            f"{name}: seconds to {target:.0%} test accuracy (mean over workers, 3 evaluations)",
            t if t is not None else float("nan"), "s", baseline=base_t,
            baseline_name="single-worker SGD", ratio=(base_t / t) if (t and base_t) else None,
            ratio_note="baseline time / time", met=None,
            extra={"final_accuracy": run["final"], "budget_s": seconds}))
    base_final = runs["single-worker SGD"]["final"]
    for name, run in runs.items():
        what = {"s": "its model", "L": "the final leader", "E": "the center"}[name[0]]
        out.append(Result(
            "6. time to accuracy", f"{name}: final test accuracy after {seconds:.0f} s ({what})",
            run["final"], "", baseline=base_final, baseline_name="single-worker SGD",
            ratio=run["final"] / base_final if base_final else None, ratio_note="value / baseline",
            met=None))
    if plot is not None:
        _plot(runs, target, plot)
    return out


def _plot(runs: dict, target: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, run), color in zip(runs.items(), ("black", "tab:blue", "tab:orange")):
        for i, curve in enumerate(run["curves"]):
            if curve:
                t = [c[0] - run["t0"] for c in curve]
                ax.plot(t, [c[2] for c in curve], color=color, alpha=0.8 if i == 0 else 0.4,
                        label=name if i == 0 else None)
    ax.axhline(target, color="gray", ls=":", lw=1)
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("test accuracy (each worker)")
    ax.set_title("Medium workload (2.1M-parameter MLP), 2-core machine")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    for r in run_throughput(quick=True) + run_accuracy(quick=True, plot=REPO / "docs" / "time_to_accuracy.png"):
        print(r)
