"""The algorithm study: which rule reaches a target accuracy first, measured the same way for all.

    python -m bench.study                 # the full study (hours): tune, run, report
    python -m bench.study --quick         # a small version of everything (under 10 minutes)
    python -m bench.study --rules lsgd easgd --workers 8 --workloads cnn   # a part of it
    python -m bench.study --report        # only the table, plots and docs/study.md block

Resumable: each finished run is saved in the results file at once, under a key naming its
configuration, and is not run again (pass --again to redo). Splittable: ``--rules``,
``--workers``, ``--seeds`` and ``--workloads`` pick a part; the invocations share the file (one
at a time: a second one waits for the first, they would share the cores). Tuning comes first for
each rule (``grid.py``); the study runs use the setting and the model it picked. Each invocation
measures the step time and the link again (``link.py``); the report times every run with the
medians over all invocations, so all rules are timed on the same modelled cluster.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..common import REPO, machine
from . import grid, link, report, run, workloads

RESULTS = REPO / "bench" / "study_results.json"
DOC = REPO / "docs" / "study.md"
# A worker's step costs ~2x more CPU inside a job of many processes than alone (caches, the
# local and global servers, the rounds); 3x leaves the room to keep every worker on time.
PACE_FACTOR = 3.0
TRIES = 3  # runs of one configuration at most, each at a 1.6x slower pace than the last


def fair(rec: "run.Record", cfg: "run.Config") -> bool:
    """The workers stayed together: each took its budget within 3%, and their clocks were never
    more than two exchange periods of steps apart at a snapshot."""
    close = all(abs(s - cfg.steps) <= 0.03 * cfg.steps for s in rec.steps)
    return close and rec.lag_s <= 2 * grid.PERIOD * rec.pace_s


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": {}, "tuned": {}, "invocations": []}


def save(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def step_time(name: str, data: dict, steps: int = 300) -> float:
    """Median seconds of one training step of ``name``, alone on this machine (best of 3)."""
    x, y = data["train"]
    best = []
    for rep in range(3):
        task = workloads.task(name, rep, run.LR, run.MOMENTUM)
        rng = np.random.default_rng(rep)
        times = []
        for i in range(steps + 20):
            idx = rng.integers(0, len(x), run.BATCH)
            t0 = time.perf_counter()
            task.step(x[idx], y[idx])
            if i >= 20:
                times.append(time.perf_counter() - t0)
        best.append(statistics.median(times))
    return min(best)


def pace_for(workers: int, t_step: float) -> float:
    """Seconds between a worker's steps, so that ``workers`` workers keep up on this machine's
    cores with room for lsgd's own processes (how far apart they got is measured)."""
    cores = os.cpu_count() or 1
    return max(0.002, PACE_FACTOR * workers * t_step / cores + 0.001)


def validation_score(rec: dict, model: str) -> float:
    """A run's validation accuracy at the budget: the mean of its last two marks and its end."""
    values = rec["val"].get(model)
    if not values:
        return float("nan")
    return float(np.mean(values[-3:]))


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.path = Path(args.results)
        self.results = load(self.path)
        self.work = Path(tempfile.mkdtemp(prefix="lsgd-study-"))
        self.budgets = grid.QUICK if args.quick else grid.BUDGETS
        self.context: dict = {}

    def measure(self, names: list[str]) -> None:
        print("measuring the link and the step times ...", flush=True)
        self.context = {"link": link.measure(quick=self.args.quick), "t_step": {},
                        "machine": machine(), "data": {}}
        for name in names:
            path = workloads.make_data(name, self.work / f"{name}.npz")
            self.context["data"][name] = (path, workloads.load_data(path))
            self.context["t_step"][name] = step_time(name, self.context["data"][name][1],
                                                     steps=100 if self.args.quick else 300)
        info = {k: v for k, v in self.context.items() if k != "data"}
        print(json.dumps(info["link"]), json.dumps(info["t_step"]), flush=True)
        self.results["invocations"].append(info | {"argv": sys.argv[1:]})
        save(self.path, self.results)

    def config(self, name: str, rule: grid.Rule, workers: int, seed: int, setting: int) -> run.Config:
        b = self.budgets[name]
        knobs = grid.resolve(rule.base + rule.grid[setting], workers)
        return run.Config(name, rule.name, rule.algorithm, 1 if rule.single else workers, seed,
                          knobs, b.steps, b.mark)

    def run(self, cfg: run.Config) -> dict | None:
        """Run ``cfg`` (unless the file has it). A run whose workers drifted apart (``fair``)
        is run again at a slower pace, up to ``TRIES`` times in all: rules whose rounds take
        longer than the pace's slack (BSP meets after every step) need more time per step on
        this machine to keep every worker on the same step, as equal devices would."""
        runs = self.results["runs"]
        if cfg.key in runs and runs[cfg.key]["ok"] and not self.args.again:
            return runs[cfg.key]
        path, data = self.context["data"][cfg.workload]
        t_step = self.context["t_step"][cfg.workload]
        pace = pace_for(cfg.workers, t_step) * grid.RULES[cfg.rule].pace
        for attempt in range(1, TRIES + 1):
            t0 = time.monotonic()
            rec = run.run(cfg, path, data, self.work, pace, t_step)
            out = asdict(rec) | {"t_step": t_step, "link": self.context["link"],
                                 "attempt": attempt, "fair": rec.ok and fair(rec, cfg)}
            runs[cfg.key] = out
            save(self.path, self.results)
            ends = {m: v[-1] for m, v in rec.test.items() if m in grid.MODELS and v}
            print(f"  {cfg.key}: {'ok' if rec.ok else 'FAILED'} in {time.monotonic() - t0:.0f} s"
                  + (f", at the end {json.dumps(ends)}, steps {min(rec.steps)}-{max(rec.steps)}, "
                     f"apart {rec.lag_s / rec.pace_s:.0f} steps, pace {pace * 1000:.0f} ms"
                     if ends else "")
                  + (f"\n    {rec.error[-400:]}" if rec.error else ""), flush=True)
            if not rec.ok or out["fair"]:
                break
            pace *= 1.6
        return out if rec.ok else None

    def tuned(self, name: str, rule: grid.Rule) -> tuple[int, str]:
        """The grid setting and the model (leader, average or center) of ``rule`` with the best
        validation accuracy at the budget, tuning it first (one run per setting)."""
        key = f"{name}/{rule.name}/{self.budgets[name].steps}/{run.METHOD}"
        grid_now = [list(map(list, g)) for g in rule.grid]
        known = self.results["tuned"].get(key)
        if known and known["grid"] == grid_now and not self.args.again:
            return known["setting"], known["model"]
        if self.args.quick:  # no tuning in the quick form: the middle setting, the product
            return len(rule.grid) // 2, rule.product
        scores: list[dict[str, float]] = []
        for setting in range(len(rule.grid)):
            rec = self.run(self.config(name, rule, grid.TUNE_WORKERS, grid.TUNE_SEED, setting))
            if rec is None:
                raise RuntimeError(f"tuning {name}/{rule.name}: setting {rule.grid[setting]} "
                                   "failed; fix it and run again (nothing was picked)")
            scores.append({m: validation_score(rec, m) for m in grid.MODELS if m in rec["val"]})
        best = max(((s, m) for s, sc in enumerate(scores) for m in sc if math.isfinite(sc[m])),
                   key=lambda sm: scores[sm[0]][sm[1]])
        self.results["tuned"][key] = {"setting": best[0], "model": best[1],
                                      "val_scores": scores, "grid": grid_now}
        save(self.path, self.results)
        print(f"  tuned {name}/{rule.name}: {rule.grid[best[0]]}, the {best[1]} "
              f"(validation {json.dumps(scores)})", flush=True)
        return best

    def main(self) -> int:
        """Tuning first (every workload and rule), then the study seed by seed, so that a
        partial study already holds every rule and worker count."""
        a = self.args
        self.measure(a.workloads)
        picks = {(name, r): self.tuned(name, grid.RULES[r]) for name in a.workloads
                 for r in a.rules}
        failed = 0
        for seed in a.seeds:
            for name in a.workloads:
                for workers in a.workers:
                    for rule_name in a.rules:
                        rule = grid.RULES[rule_name]
                        if rule.single and workers != a.workers[0]:
                            continue  # one worker: once per seed
                        cfg = self.config(name, rule, workers, seed, picks[(name, rule_name)][0])
                        failed += self.run(cfg) is None
        return 1 if failed else 0

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.study", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs, 4 workers, one seed, no "
                   "tuning (the middle of each grid, the model the rule delivers): under 10 minutes")
    p.add_argument("--workloads", nargs="+", choices=workloads.NAMES, default=list(workloads.NAMES))
    p.add_argument("--rules", nargs="+", choices=list(grid.RULES), default=list(grid.RULES))
    p.add_argument("--workers", nargs="+", type=int, choices=grid.WORKERS, default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--results", default=None, help=f"results file (default {RESULTS.name} in "
                   "bench/, or a temporary one with --quick)")
    p.add_argument("--doc", default=None, help=f"the document whose results block is rewritten "
                   f"(default docs/{DOC.name}; with --quick, next to the results file)")
    p.add_argument("--again", action="store_true", help="run configurations already in the file")
    p.add_argument("--report", action="store_true", help="only write the report from the file")
    a = p.parse_args(argv)
    if a.workers is None:
        a.workers = [4] if a.quick else list(grid.WORKERS)
    if a.seeds is None:
        a.seeds = [0] if a.quick else list(grid.SEEDS)
    if a.results is None:
        a.results = (Path(tempfile.gettempdir()) / "lsgd-study-quick.json") if a.quick else RESULTS
    if a.doc is None:
        a.doc = Path(a.results).with_suffix(".md") if a.quick else DOC
    code = 0
    if not a.report:
        def terminated(*_: object) -> None:  # as Ctrl-C: the running jobs are stopped first
            raise KeyboardInterrupt("terminated")

        before = signal.signal(signal.SIGTERM, terminated)
        try:
            with open(f"{a.results}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"waiting for the other study on {a.results} to finish ...", flush=True)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                study = Study(a)
                try:
                    code = study.main()
                finally:
                    study.close()
        finally:
            signal.signal(signal.SIGTERM, before)
    results = load(Path(a.results))
    budgets = grid.QUICK if a.quick else grid.BUDGETS
    written = report.write(results, budgets, Path(a.doc), command="python -m bench.study"
                           + (" --quick" if a.quick else ""))
    print("\n".join(written), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
