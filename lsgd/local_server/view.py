"""A node's picture of its job: what its progress line shows and what its heartbeats report.

``NodeView`` is written by the node loop (the metrics rows of every round, through
``MetricsWriter.add_sink``; credit and round answers; the workers' step counts, at most a few
times a second; what the node waits for) and by the heartbeat thread (the global server's
answer: counter, nodes alive, who leads). The heartbeat thread and the progress display read it
as immutable ``Snapshot``s. One small lock guards it; every update is O(1) or O(rows of one
round), and nothing here runs per ``worker.step()``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from ..config import JobConfig
from ..leader import Candidate

RATE_WINDOW = 10.0  # seconds over which rates are measured
SAMPLE_EVERY = 0.25  # seconds between rate samples (taken when the view is read)
MIN_SPAN = 0.5  # seconds of samples before a rate is told
MAX_EVALUATIONS = 10_000  # evaluations kept (node 0); older ones are dropped
# Where a worker's distance was measured, most telling first: the global leader, the center,
# then the local leader (metrics columns -> NodeReport ``distance_to``).
DISTANCES = (("pull_global", "global_leader"), ("pull_center", "center"),
             ("pull_local", "local_leader"))
NAN = float("nan")


@dataclass(frozen=True)
class WorkerView:
    """One worker as this node last saw it."""

    worker_id: int
    iterations: int = 0
    loss: float = NAN  # its averaged loss at its newest round (NaN: none yet)
    distance: float = NAN  # ||x - target|| before its newest pull (NaN: no pull yet)
    distance_to: str = ""  # global_leader | center | local_leader | "" (none yet)
    round_id: int = 0  # the round of loss and distance
    resets: int = 0
    respawns: int = 0
    training: bool = True


@dataclass(frozen=True)
class LeaderView:
    worker_id: int
    loss: float
    node: int | None = None
    round_id: int = 0


@dataclass(frozen=True)
class Wait:
    """Something the node waits for, since ``since`` (time.monotonic())."""

    what: str  # "starting 4 workers: 2 ready"
    since: float
    limit_name: str = ""  # the knob that bounds the wait (JOIN_TIMEOUT), if any
    limit: float = 0.0
    key: str = ""  # waits of one key are one wait: a new text keeps ``since``

    def text(self, now: float) -> str:
        waited = max(0.0, now - self.since)
        if self.limit_name:
            return f"{self.what}: {waited:.0f} s of {self.limit_name} {self.limit:g} s"
        return f"{self.what} ({waited:.0f} s)"


@dataclass(frozen=True)
class Evaluation:
    round_id: int
    iteration: int
    target: str  # leader | average | center
    metric: str
    value: float
    worker_id: int | None = None  # the leader evaluated


@dataclass(frozen=True)
class Snapshot:
    """The view at one moment (``time``, on time.monotonic())."""

    time: float
    node: int
    num_groups: int
    budget_iterations: int | None
    budget_seconds: float | None
    elapsed: float  # seconds since this node started
    counter: int  # the job's global iterations, as last heard
    rate: float | None  # the job's iterations per second, recent (None: not known yet)
    eta: float | None  # seconds left (None: unknown)
    steps: int  # this node's workers' steps
    node_rate: float | None  # this node's steps per second, recent
    round_id: int  # the newest round this node knows of
    rounds: dict[str, int]  # rounds this node ran, by kind (local, global, final; exchange:
    # the exchanges of an asynchronous rule)
    leader: LeaderView | None  # the global leader
    leader_changes: int
    local_leader: LeaderView | None  # this node's, at its newest round
    nodes_alive: int | None  # None until the first heartbeat answer
    nodes_missing: tuple[int, ...]
    job_started: bool | None
    workers: tuple[WorkerView, ...]
    reattaches: int
    wait: Wait | None  # what the node waits for (None: training)
    evaluations: int  # evaluations made on this node so far

    @property
    def workers_training(self) -> int:
        return sum(w.training for w in self.workers)

    def wait_text(self) -> str | None:
        return self.wait.text(self.time) if self.wait is not None else None


@dataclass
class _Rate:
    """Samples of a growing count; ``per_second`` over the last ``RATE_WINDOW`` s."""

    samples: deque = field(default_factory=lambda: deque(maxlen=int(RATE_WINDOW / SAMPLE_EVERY) + 8))

    def add(self, now: float, value: int) -> None:
        if self.samples and value < self.samples[-1][1]:
            self.samples.clear()  # the count went back (a restored server): measure afresh
        if not self.samples or now - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((now, value))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()

    def per_second(self, now: float, value: int) -> float | None:
        """None until the samples span ``MIN_SPAN`` s."""
        if not self.samples:
            return None
        t0, v0 = self.samples[0]
        return (value - v0) / (now - t0) if now - t0 >= MIN_SPAN else None


class NodeView:
    """What this node knows of the job (see the module doc). Thread-safe."""

    def __init__(self, cfg: JobConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.t0 = clock()
        self._lock = threading.Lock()
        self._workers = {cfg.worker_id(i): WorkerView(cfg.worker_id(i)) for i in range(cfg.workers)}
        self._counter = 0
        self._counter_heard = False  # the first counter heard is a start, not speed (RESUME=1,
        self._counter_rate, self._step_rate = _Rate(), _Rate()  # a node joining a running job)
        self._round_id = 0
        self._rounds = {"local": 0, "global": 0, "final": 0}
        self._leader: LeaderView | None = None
        self._leader_changes = 0
        self._local_leader: LeaderView | None = None
        self._beat: dict = {"nodes_alive": None, "nodes_missing": (), "job_started": None}
        self._reattaches = 0
        self._wait: Wait | None = None
        self._joined_at: float | None = None
        self._evals: deque[Evaluation] = deque(maxlen=MAX_EVALUATIONS)
        self._evals_total = 0
        self._evals_dropped = 0  # index of the oldest evaluation kept

    # ------------------------------------------------------------------ the node loop
    def on_rows(self, rows: list[dict]) -> None:
        """A metrics sink: the rows of one round, or of one evaluation."""
        with self._lock:
            for row in rows:
                if row.get("kind") == "eval":
                    self._on_eval(row)
                else:
                    self._on_round_row(row)

    def _on_round_row(self, row: dict) -> None:
        wid = _int(row.get("worker_id"))
        old = self._workers.get(wid)
        if old is None:  # not a worker of this node: never expected
            return
        rid = _int(row.get("round"))
        distance, target = old.distance, old.distance_to
        for column, name in DISTANCES:
            if row.get(column) is not None:
                distance, target = float(row[column]), name
                break
        else:  # no pull: a leader is at distance 0 of itself
            if row.get("global_leader") == wid:
                distance, target = 0.0, "global_leader"
            elif row.get("local_leader") == wid and row.get("kind") == "local":
                distance, target = 0.0, "local_leader"
        loss = _float(row.get("loss"))
        self._workers[wid] = replace(
            old, loss=loss, distance=distance, distance_to=target, round_id=rid,
            iterations=max(old.iterations, _int(row.get("worker_iterations"))),
            resets=old.resets + (1 if row.get("reset") else 0))
        if row.get("kind") == "exchange":  # an asynchronous rule: no rounds, no leaders
            self._rounds["exchange"] = self._rounds.get("exchange", 0) + 1
            return
        lead = row.get("local_leader")
        if lead == wid:
            self._local_leader = LeaderView(wid, loss, self.cfg.node_index, rid)
        elif lead is None and self._local_leader is not None and self._local_leader.round_id < rid:
            self._local_leader = None  # nobody was eligible at this round
        self._round_id = max(self._round_id, rid)

    def _on_eval(self, row: dict) -> None:
        worker = row.get("worker_id")
        self._evals.append(Evaluation(_int(row.get("round")), _int(row.get("iteration")),
                                      str(row.get("target") or ""), str(row.get("metric") or ""),
                                      _float(row.get("value")),
                                      None if worker is None else _int(worker)))
        self._evals_total += 1
        self._evals_dropped = self._evals_total - len(self._evals)

    @property
    def counter(self) -> int:
        """The job's counter, as last heard."""
        return self._counter

    def on_counter(self, counter: int) -> None:
        """The job's counter, from any answer of the global server."""
        with self._lock:
            self._heard_counter(counter)

    def _heard_counter(self, counter: int) -> None:
        if not self._counter_heard:
            self._counter_heard = True
            self._counter_rate.samples.clear()
        self._counter = max(self._counter, counter)

    def on_round(self, round_id: int, kind: str, leader: Candidate | None,
                 leader_node: int | None) -> None:
        """This node ran round ``round_id`` of ``kind`` (local | global | final); the global
        server answered with ``leader`` (for a local round: this node's own best)."""
        with self._lock:
            self._rounds[kind] = self._rounds.get(kind, 0) + 1
            self._round_id = max(self._round_id, round_id)
            if kind != "local" and leader is not None:
                self._set_leader(LeaderView(leader.worker_id, leader.loss, leader_node, round_id))

    def _set_leader(self, new: LeaderView) -> None:
        old = self._leader
        if old is not None and new.round_id < old.round_id:
            return
        if old is not None and (old.worker_id, old.node) != (new.worker_id, new.node):
            self._leader_changes += 1
        self._leader = new

    def set_workers(self, workers: Iterable[tuple[int, int, bool, int]]) -> None:
        """(worker id, iterations, training, respawns) of each worker of this node."""
        with self._lock:
            for wid, iterations, training, respawns in workers:
                old = self._workers.get(wid)
                if old is not None and (old.iterations, old.training, old.respawns) != (
                        iterations, training, respawns):
                    self._workers[wid] = replace(old, iterations=max(old.iterations, iterations),
                                                 training=training, respawns=respawns)

    def wait(self, what: str, limit_name: str = "", limit: float = 0.0, key: str = "") -> None:
        """The node waits for ``what`` now (bounded by knob ``limit_name``, if given); a wait
        of the same ``key`` as the current one goes on from when that one began."""
        now = self.clock()
        with self._lock:
            since = self._wait.since if self._wait is not None and key and self._wait.key == key else now
            self._wait = Wait(what, since, limit_name, limit, key)

    def wait_over(self) -> None:
        with self._lock:
            self._wait = None

    def joined(self) -> None:
        """The node joined the job and trains."""
        with self._lock:
            self._joined_at = self.clock()
            self._wait = None
            self._step_rate.samples.clear()  # steps restored by RESUME=1 are not speed

    def reattached(self) -> None:
        with self._lock:
            self._reattaches += 1
            self._wait = None

    # ------------------------------------------------------------------ the heartbeat thread
    def on_heartbeat(self, *, counter: int, nodes_alive: int, nodes_missing: Iterable[int],
                     job_started: bool, leader: Candidate | None, leader_node: int,
                     rounds: int) -> None:
        """The global server's answer to a heartbeat. Its leader is that of the newest closed
        global round; it is taken only when rounds opened since this node's newest round (a
        round this node is in may still be closing, with another leader)."""
        with self._lock:
            self._heard_counter(counter)
            self._beat = {"nodes_alive": nodes_alive, "nodes_missing": tuple(nodes_missing),
                          "job_started": job_started}
            newest = self._leader.round_id if self._leader is not None else 0
            if leader is not None and rounds > max(newest, self._round_id):
                self._set_leader(LeaderView(leader.worker_id, leader.loss, leader_node, rounds))
            self._round_id = max(self._round_id, rounds)

    # ------------------------------------------------------------------ readers
    def waiting_for_nodes(self) -> bool:
        """No heartbeat answer has said yet that the job started."""
        with self._lock:
            return self._beat["job_started"] is not True

    def snapshot(self) -> Snapshot:
        now = self.clock()
        with self._lock:
            steps = sum(w.iterations for w in self._workers.values())
            if self._counter_heard:
                self._counter_rate.add(now, self._counter)
            self._step_rate.add(now, steps)
            rate = self._counter_rate.per_second(now, self._counter)
            snap = Snapshot(
                time=now, node=self.cfg.node_index, num_groups=self.cfg.num_groups,
                budget_iterations=self.cfg.iterations,
                budget_seconds=self.cfg.minutes * 60 if self.cfg.minutes else None,
                elapsed=now - self.t0, counter=self._counter, rate=rate, eta=None, steps=steps,
                node_rate=self._step_rate.per_second(now, steps), round_id=self._round_id,
                rounds=dict(self._rounds), leader=self._leader,
                leader_changes=self._leader_changes, local_leader=self._local_leader,
                workers=tuple(self._workers[k] for k in sorted(self._workers)),
                reattaches=self._reattaches, wait=self._wait or self._join_wait(),
                evaluations=self._evals_total, **self._beat)
        return replace(snap, eta=_eta(snap))

    def _join_wait(self) -> Wait | None:
        """While the job waits for nodes to join (the heartbeat says so): for which, how long.
        Node 0 counts from its start (the global server started with it), another node from
        when it joined."""
        missing = self._beat["nodes_missing"]
        if self._beat["job_started"] is not False or not missing or self._joined_at is None:
            return None
        which = (f"node {missing[0]}" if len(missing) == 1
                 else "nodes " + ", ".join(str(i) for i in missing[:8])
                 + (", ..." if len(missing) > 8 else ""))
        since = self.t0 if self.cfg.node_index == 0 else self._joined_at
        return Wait(f"waiting for {which} of {self.cfg.num_groups} to join", since,
                    "JOIN_TIMEOUT", self.cfg.join_timeout, "join")

    def evaluations_since(self, index: int, limit: int = 64) -> tuple[int, list[Evaluation]]:
        """The evaluations from ``index`` on (at most ``limit``), and the index of the first
        one returned (later than ``index`` when older ones were dropped)."""
        with self._lock:
            start = max(index, self._evals_dropped)
            first = start - self._evals_dropped
            out = [self._evals[i] for i in range(first, min(len(self._evals), first + limit))]
        return start, out

    def final(self) -> dict:
        """What the node's summary keeps of the view."""
        snap = self.snapshot()
        lead = snap.leader
        return {"rounds": {k: v for k, v in snap.rounds.items() if v},
                "leader_changes": snap.leader_changes, "reattaches": snap.reattaches,
                "last_leader": None if lead is None else {
                    "worker_id": lead.worker_id, "node": lead.node, "loss": _finite(lead.loss)}}


def _eta(s: Snapshot) -> float | None:
    left = []
    if s.budget_iterations and s.rate:
        left.append(max(0, s.budget_iterations - s.counter) / s.rate)
    if s.budget_seconds:
        left.append(max(0.0, s.budget_seconds - s.elapsed))
    return min(left) if left else None


def _int(v: object) -> int:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def _float(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return NAN


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None
