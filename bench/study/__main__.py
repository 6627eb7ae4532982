"""The algorithm study: which rule reaches a target accuracy first, measured the same way for all.

    python -m bench.study                 # the full study (hours): tune, run, report
    python -m bench.study --quick         # a small version of everything (under 10 minutes)
    python -m bench.study --rules lsgd easgd --workers 8 --workloads cnn   # a part of it
    python -m bench.study --report        # only the table, plots and docs/study.md block

Resumable: each finished run is saved in the results file at once, under a key naming its
configuration, and is not run again (delete the entry, or pass --again, to redo it). Splittable:
``--rules``, ``--workers``, ``--seeds`` and ``--workloads`` pick a part; runs of several
invocations share the file. Tuning comes first for each rule (``grid.py``), the study runs use the
setting it picked. Each invocation measures the step time and the link (``link.py``) again and
stores them with the runs it makes.
"""

from __future__ import annotations

import argparse
import json
import os
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
# A worker's step costs ~2x more CPU inside a job of many processes than alone (caches, the
# local and global servers, the rounds); 3x leaves the room to keep every worker on time.
PACE_FACTOR = float(os.environ.get("STUDY_PACE_FACTOR", "3.0"))
DOC = REPO / "docs" / "study.md"


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
    cores with room for lsgd's own processes (the late steps are counted)."""
    cores = os.cpu_count() or 1
    return max(0.002, PACE_FACTOR * workers * t_step / cores + 0.001)


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
        runs = self.results["runs"]
        if cfg.key in runs and runs[cfg.key]["ok"] and not self.args.again:
            return runs[cfg.key]
        path, data = self.context["data"][cfg.workload]
        t_step = self.context["t_step"][cfg.workload]
        t0 = time.monotonic()
        rec = run.run(cfg, path, data, self.work, pace_for(cfg.workers, t_step))
        out = asdict(rec) | {"t_step": t_step, "link": self.context["link"]}
        runs[cfg.key] = out
        save(self.path, self.results)
        curve = rec.test.get(grid.RULES[cfg.rule].curve, [])
        print(f"  {cfg.key}: {'ok' if rec.ok else 'FAILED'} in {time.monotonic() - t0:.0f} s"
              + (f", final {curve[-1]:.3f}, late {rec.late_fraction:.0%}" if curve else "")
              + (f"\n    {rec.error[-400:]}" if rec.error else ""), flush=True)
        return out if rec.ok else None

    def tuned(self, name: str, rule: grid.Rule) -> int:
        """The grid setting of ``rule`` with the best validation accuracy (tuning it first)."""
        if len(rule.grid) == 1:
            return 0
        key = f"{name}/{rule.name}/{self.budgets[name].steps}"
        if key in self.results["tuned"] and not self.args.again:
            return self.results["tuned"][key]["setting"]
        if self.args.quick:
            return len(rule.grid) // 2  # no tuning in the quick form: the middle setting
        scores = []
        for setting in range(len(rule.grid)):
            rec = self.run(self.config(name, rule, grid.TUNE_WORKERS, grid.TUNE_SEED, setting))
            scores.append(-1.0 if rec is None else float(np.mean(rec["val"][rule.curve][-3:])))
        best = int(np.argmax(scores))
        self.results["tuned"][key] = {"setting": best, "val_scores": scores,
                                      "grid": [list(map(list, g)) for g in rule.grid]}
        save(self.path, self.results)
        print(f"  tuned {name}/{rule.name}: setting {best} {rule.grid[best]} "
              f"(validation {['%.3f' % s for s in scores]})", flush=True)
        return best

    def main(self) -> int:
        """Tuning first (every workload and rule), then the study seed by seed, so that a
        partial study already holds every rule and worker count."""
        a = self.args
        self.measure(a.workloads)
        settings = {(name, r): self.tuned(name, grid.RULES[r]) for name in a.workloads
                    for r in a.rules}
        failed = 0
        for seed in a.seeds:
            for name in a.workloads:
                for workers in a.workers:
                    for rule_name in a.rules:
                        rule = grid.RULES[rule_name]
                        if rule.single and workers != a.workers[0]:
                            continue  # one worker: once per seed
                        cfg = self.config(name, rule, workers, seed, settings[(name, rule_name)])
                        failed += self.run(cfg) is None
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.study", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs, 4 workers, one seed, no "
                   "tuning (the middle of each grid): under 10 minutes")
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
        code = Study(a).main()
    results = load(Path(a.results))
    budgets = grid.QUICK if a.quick else grid.BUDGETS
    written = report.write(results, budgets, Path(a.doc), command="python -m bench.study"
                           + (" --quick" if a.quick else ""))
    print("\n".join(written), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
