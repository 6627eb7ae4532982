"""One configuration of the study, end to end: run the job through ``train.sh`` (one process per
node, as on a cluster), then evaluate its snapshots the same way for every rule.

A configuration is a workload, a rule with its knobs, a worker count and a seed. Every worker
takes the same number of its own steps (``ITERATIONS`` = workers x steps: the job's counter),
paced so that all workers advance together (``job.py``). What comes back (``record``):

- per mark (every ``mark`` of a worker's own steps): the test and validation accuracy of each
  worker's model, of the workers' average, and of the *leader by loss* (the worker with the
  lowest mean training loss since the previous mark, the criterion LSGD elects by);
- the product's own final evaluation (``summary.json``: leader, average, center);
- what the job moved through the global server (parameter bytes, rounds, deltas, mail), its
  wall-clock seconds and how many paced steps were late.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..common import lsgd_env, run_node
from . import workloads

LAYOUT = {1: (1, 1), 4: (2, 2), 8: (4, 2), 16: (4, 4)}  # workers: (nodes, workers per node)
BATCH, LR, MOMENTUM = 32, 0.05, 0.9
SYNC_EVERY = 0.05  # lsgd's default seconds between an asynchronous node's syncs
# Changes to how a run is made (pacing, snapshots, knobs passed) bump this: older runs in the
# results file are then not mixed with new ones.
METHOD = "m3"


@dataclass(frozen=True)
class Config:
    workload: str
    rule: str  # the study's name: sgd, bsp, localsgd, easgd, ... (grid.RULES)
    algorithm: str  # lsgd's ALGORITHM
    workers: int
    seed: int
    knobs: tuple[tuple[str, str], ...] = ()  # (KNOB, value), e.g. (("C2", "0.3"),)
    steps: int = 1500  # per worker
    mark: int = 75
    method: str = METHOD  # how runs are made: a run of another method is not reused

    @property
    def key(self) -> str:
        knobs = ",".join(f"{k}={v}" for k, v in self.knobs) or "-"
        return (f"{self.method}/{self.workload}/{self.rule}/w{self.workers}/s{self.seed}/"
                f"{knobs}/{self.steps}x{self.mark}")


@dataclass
class Record:
    config: dict
    ok: bool
    error: str = ""
    exit_codes: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    pace_s: float = 0.0
    late_fraction: float = 0.0
    lag_s: float = 0.0  # the most the workers' clocks were apart at one mark
    steps: list[int] = field(default_factory=list)  # each worker's own steps
    marks: list[int] = field(default_factory=list)  # per-worker step of each mark
    # {"average", "leader", "center" (center rules), "workers" (one list each)}: accuracy at
    # every mark in ``marks``, then one more entry: the end of the run (the budget point)
    test: dict = field(default_factory=dict)
    val: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)  # the product's final evaluation (test accuracy)
    moved: dict = field(default_factory=dict)  # parameter bytes, rounds, deltas, mail
    param_count: int = 0


def _wait_port(run_dir: Path, proc: subprocess.Popen, timeout: float) -> str:
    port = run_dir / "global.port"
    end = time.monotonic() + timeout
    while not (port.exists() and port.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > end:
            log = (run_dir / "node0.log").read_text()[-1500:] if (run_dir / "node0.log").exists() else ""
            raise RuntimeError(f"node 0 did not start: {log}")
        time.sleep(0.05)
    return port.read_text().strip()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait(10)


def run_job(cfg: Config, data: Path, run_dir: Path, pace: float, t_step: float,
            timeout: float) -> tuple[list[int], float]:
    """Run the job; its exit codes and wall-clock seconds.

    An asynchronous node syncs with the global server every ``SYNC_EVERY`` seconds of wall
    clock. Here a step takes ``pace``, on the modelled cluster ``t_step``: the sync period is
    stretched by ``pace / t_step`` so that a node syncs as often per step as it would there.
    """
    nodes, per_node = LAYOUT[cfg.workers]
    sync_every = min(60.0, SYNC_EVERY * pace / t_step)
    env = lsgd_env(ENTRY="bench.study.job:main", NUM_GROUPS=nodes, WORKERS=per_node,
                   ALGORITHM=cfg.algorithm, ITERATIONS=cfg.workers * cfg.steps, MINUTES="",
                   SEED=cfg.seed, LR=LR, MOMENTUM=MOMENTUM, BATCH_SIZE=BATCH, PORT=0,
                   RUN_DIR=run_dir, JOB_ID=f"study{abs(hash(cfg.key)) % 10**8}", EVAL_EVERY=0,
                   STATUS_PORT=0, STUDY_WORKLOAD=cfg.workload, STUDY_DATA=data,
                   STUDY_MARK=cfg.mark, STUDY_PACE=pace, ROUND_TIMEOUT=120, NODE_TIMEOUT=30,
                   SYNC_EVERY=f"{sync_every:.4g}",
                   **dict(cfg.knobs))
    t0 = time.monotonic()
    procs = [run_node(0, env)]
    try:
        if nodes > 1:
            port = _wait_port(run_dir, procs[0], 120)
            procs += [run_node(i, dict(env, PORT=port)) for i in range(1, nodes)]
        end = t0 + timeout
        for p in procs:
            p.wait(max(1.0, end - time.monotonic()))
    except BaseException:  # a timeout, a node that did not start, Ctrl-C: nothing is left
        _stop(procs)
        raise
    return [p.returncode for p in procs], time.monotonic() - t0


def _leader(losses: list[float]) -> int:
    """The worker with the lowest mean training loss (a non-finite loss never leads)."""
    arr = np.asarray(losses, float)
    return int(np.argmin(np.where(np.isfinite(arr), arr, np.inf)))


def evaluate(cfg: Config, data: dict, run_dir: Path) -> dict[str, Any]:
    """Accuracy per snapshot: of each worker, of the workers' average, of the leader by loss
    and of the node's center (where the rule has one), at every mark all workers reached and
    at the end of each worker's run (the budget point)."""
    files = sorted(run_dir.glob("study-w*.npz"), key=lambda p: int(p.stem.split("-w")[1]))
    if len(files) != cfg.workers:
        raise RuntimeError(f"{len(files)} of {cfg.workers} workers wrote their snapshots")
    runs = [dict(np.load(f)) for f in files]
    # the marks every worker reached at a multiple of ``mark`` (the last copy is the end)
    count = min(int(np.sum(r["marks"][:, 0] % cfg.mark == 0)) for r in runs)
    count = min(count, min(len(r["marks"]) for r in runs))
    task = workloads.task(cfg.workload, cfg.seed, LR, MOMENTUM)
    centers = runs[0].get("centers")
    out: dict[str, Any] = {
        "marks": [int(m) for m in runs[0]["marks"][:count, 0]],
        "steps": [int(r["steps"]) for r in runs],
        "late": sum(int(r["late"]) for r in runs),
        "lag_s": float(max((np.ptp([r["marks"][m, 1] for r in runs]) for m in range(1, count)),
                           default=0.0)),
        "param_count": int(runs[0]["snaps"].shape[1])}
    for split in ("test", "val"):
        x, y = data[split]

        def acc(vec: np.ndarray) -> float:
            if not np.all(np.isfinite(vec)):
                return float("nan")
            task.load(vec)
            return round(task.accuracy(x, y), 4)

        points = [[m] * len(runs) for m in range(count)] + [[len(r["snaps"]) - 1 for r in runs]]
        workers = [[acc(r["snaps"][p[i]]) for p in points] for i, r in enumerate(runs)]
        res = {"workers": workers,
               "average": [acc(np.mean([r["snaps"][p[i]] for i, r in enumerate(runs)], axis=0))
                           for p in points],
               "leader": [workers[_leader([r["marks"][p[i], 2] for i, r in enumerate(runs)])][k]
                          for k, p in enumerate(points)]}
        if centers is not None:
            res["center"] = [acc(centers[p[0]]) for p in points]
        out[split] = res  # each list: the ``count`` marks, then the end of the run
    return out


def moved(run_dir: Path, nodes: int) -> dict[str, Any]:
    """What crossed nodes: the global server's parameter bytes and rounds, and per node its
    rounds (sync rules) or its sync thread's exchanges with the server (async rules)."""
    g = json.loads((run_dir / "global" / "summary.json").read_text())
    per_node = [json.loads((run_dir / f"node{i}" / "summary.json").read_text())
                for i in range(nodes)]
    return {"bytes_in": g.get("parameter_bytes", {}).get("in", 0),
            "bytes_out": g.get("parameter_bytes", {}).get("out", 0),
            "rounds": g.get("rounds"), "counter": g.get("counter"),
            "deltas": (g.get("center_deltas") or {}).get("applied", 0),
            "mail": (g.get("mail") or {}).get("posted", 0),
            "node_rounds": [n.get("rounds") or {} for n in per_node],
            "node_syncs": [(n.get("async") or {}).get("syncs", 0) for n in per_node]}


def run(cfg: Config, data_path: Path, data: dict, work: Path, pace: float,
        t_step: float) -> Record:
    """Run and evaluate one configuration (``work`` is scratch space, removed after)."""
    run_dir = work / cfg.key.replace("/", "_").replace(",", "_").replace("=", "")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    timeout = max(300.0, 6 * cfg.steps * pace + 120)
    rec = Record(config=asdict(cfg), ok=False, pace_s=pace)
    try:
        codes, rec.wall_s = run_job(cfg, data_path, run_dir, pace, t_step, timeout)
        rec.exit_codes = codes
        if any(codes):
            tail = (run_dir / "node0.log").read_text()[-1500:]
            raise RuntimeError(f"exit codes {codes}: {tail}")
        ev = evaluate(cfg, data, run_dir)
        rec.marks, rec.steps, rec.test, rec.val = ev["marks"], ev["steps"], ev["test"], ev["val"]
        rec.param_count = ev["param_count"]
        rec.late_fraction = round(ev["late"] / max(1, sum(ev["steps"])), 4)
        rec.lag_s = round(ev["lag_s"], 3)
        summary = json.loads((run_dir / "node0" / "summary.json").read_text())
        rec.final = {k: v.get("accuracy") for k, v in (summary.get("evaluation") or {}).items()
                     if isinstance(v, dict)}
        rec.moved = moved(run_dir, LAYOUT[cfg.workers][0])
        rec.ok = True
    except Exception as exc:  # noqa: BLE001 - recorded, the study goes on
        rec.error = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rec
