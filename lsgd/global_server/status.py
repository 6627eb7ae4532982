"""The job's status as the global server sees it: the board behind ``/status.json``.

``StatusBoard`` is pure (no I/O, no threads, the clock is an argument). The servicer calls it
with the coordinator's lock held:

- ``observe(coord, now)`` after every change of the coordinator's state: a round that opened
  or closed goes into the rounds ring (local rounds when they open: they have no barrier;
  global and final ones when they close, with how long they took), and the counter is sampled
  for the rate;
- ``parse``/``store`` (or ``ingest``, both at once) for each heartbeat's ``NodeReport``: the
  newest report of each node, one worker point per worker and new round, the new evaluations;
- ``snapshot(coord, now)``: the ``/status.json`` document, O(nodes + workers);
- ``history_rows(since)`` (cheap, under the lock) and ``format_history`` (without it): the
  ``/history.json`` document.

Memory does not grow with the job: the rings are ``deque(maxlen=...)`` of tuples, numbered by
one running sequence number (``/history.json?since=`` pages through them).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from operator import itemgetter
from typing import Any

from ..rules.base import RoundKind
from .reports import NodeReport, parse_report

ROUNDS = 10_000  # rounds kept
POINTS = 50_000  # worker points kept (one per worker and round it was seen at)
EVALUATIONS = 10_000  # evaluations kept
PAGE = 5_000  # entries per list in one /history.json answer
LAST_EVALUATIONS = 100  # evaluations in /status.json
RATE_WINDOW = 10.0  # seconds the rate is measured over
SAMPLE_EVERY = 0.5  # seconds between two counter samples
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
KINDS = {RoundKind.LOCAL: "local", RoundKind.GLOBAL: "global", RoundKind.FINAL: "final"}

ROUND_FIELDS = ("seq", "id", "kind", "iteration", "t", "leader", "leader_node", "loss",
                "latency_s")
POINT_FIELDS = ("seq", "t", "iteration", "worker", "node", "round", "loss", "distance",
                "distance_to")
EVALUATION_FIELDS = ("seq", "t", "round", "iteration", "target", "metric", "value", "worker")
_SEQ = itemgetter(0)


def _num(x: float | None) -> float | None:
    """``x`` if it is a finite number, else None (JSON has no NaN)."""
    return x if x is not None and math.isfinite(x) else None


class StatusBoard:
    """What ``/status.json``, ``/history.json`` and ``/metrics`` show. Not thread-safe."""

    def __init__(self, num_groups: int, workers: int, origin: float = 0.0, *,
                 rounds: int = ROUNDS, points: int = POINTS, evaluations: int = EVALUATIONS,
                 restarts: int = 0, exchange: str = "leader") -> None:
        self.num_groups, self.workers = num_groups, workers
        self.exchange = exchange  # the rule's exchange: "leader" | "center" (Rule.exchange)
        self.origin = origin  # the coordinator's start, on its clock: t = now - origin
        self.restarts = restarts  # times this job's global server was started again
        self.reports: dict[int, NodeReport] = {}  # node -> its newest report
        self._held: dict[int, tuple[int, int]] = {}  # node -> (session, evaluations held)
        self._worker_round: dict[int, int] = {}  # worker -> newest round of a point
        self.rounds: deque[tuple] = deque(maxlen=rounds)
        self.points: deque[tuple] = deque(maxlen=points)
        self.evaluations: deque[tuple] = deque(maxlen=evaluations)
        self._iteration: dict[int, int] = {}  # round id -> its counter, for the rounds held
        self._seq = 0
        self.kinds = dict.fromkeys(KINDS.values(), 0)  # rounds opened, by kind
        self._round_id, self._round_closed = 0, True  # the newest round seen
        self._seeded = False
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # global/final rounds, per bucket
        self.latency_sum = 0.0
        self._samples: deque[tuple[float, int]] = deque(maxlen=2 * int(RATE_WINDOW / SAMPLE_EVERY) + 4)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ rounds, counter
    def observe(self, coord: Any, now: float) -> None:
        """Record what changed in ``coord`` (a ``Coordinator``) since the last call."""
        self.origin = coord.started_at  # a restored coordinator moves it
        rnd = coord.round
        if not self._seeded:
            self._seed(coord)
        if rnd is not None:
            if rnd.id != self._round_id:
                self._round_id, self._round_closed = rnd.id, False
                self.kinds[KINDS[rnd.kind]] += 1
            if rnd.closed and not self._round_closed:
                self._round_closed = True
                self._record(rnd, now)
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_EVERY:
            self._samples.append((now, coord.done))

    def _seed(self, coord: Any) -> None:
        """A restored coordinator opened rounds before this board existed: count them by kind
        from the schedule (the rounds before a stop fall on its boundaries)."""
        self._seeded = True
        rnd = coord.round
        before = coord.rounds_opened - (1 if rnd is not None else 0)
        if before <= 0:
            return
        last = coord.period_start if rnd is None else max(0, rnd.iteration - 1)
        globals_ = min(before, last // coord.schedule.global_period)
        self.kinds["global"] += globals_
        self.kinds["local"] += before - globals_
        self._round_id = before

    def _record(self, rnd: Any, now: float) -> None:
        kind = KINDS[rnd.kind]
        latency = None if rnd.kind == RoundKind.LOCAL else round(max(0.0, now - rnd.opened_at), 6)
        lead = rnd.leader
        if len(self.rounds) == self.rounds.maxlen:
            self._iteration.pop(self.rounds[0][1], None)
        self.rounds.append((self._next(), rnd.id, kind, rnd.iteration,
                            round(rnd.opened_at - self.origin, 3),
                            lead.worker_id if lead else None,
                            rnd.leader_node if lead else None,
                            _num(lead.loss) if lead else None, latency))
        self._iteration[rnd.id] = rnd.iteration
        if latency is not None:
            self.latency[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
            self.latency_sum += latency

    def rate(self, done: int, now: float) -> float | None:
        """Iterations per second over the last ``RATE_WINDOW`` s (None: too little seen)."""
        for t, d in self._samples:
            if now - t <= RATE_WINDOW + SAMPLE_EVERY:
                return max(0, done - d) / (now - t) if now - t >= 1.0 else None
        return None

    # ------------------------------------------------------------------ node reports
    def parse(self, index: int, report: Any, rounds: int) -> NodeReport:
        """Check a heartbeat's ``NodeReport`` (``reports.parse_report``); changes nothing."""
        return parse_report(report, index=index, num_groups=self.num_groups,
                            workers=self.workers, rounds=rounds)

    def store(self, index: int, session: int, report: NodeReport, now: float) -> int:
        """Keep node ``index``'s checked report; returns the evaluations held of its session.

        A worker point is added for each worker at a round newer than its last point; of the
        evaluations (numbered from ``evaluations_from`` in the node's session) only the ones
        not held yet are added.
        """
        self.reports[index] = report
        t = round(now - self.origin, 3)
        for w in report.workers:
            if w.round > self._worker_round.get(w.id, 0):
                self._worker_round[w.id] = w.round
                self.points.append((self._next(), t, self._iteration.get(w.round), w.id, index,
                                    w.round, w.loss, w.distance, w.distance_to))
        held_session, held = self._held.get(index, (session, 0))
        if held_session != session:  # the node started again: it numbers from 0
            held = 0
        if report.evaluations_from <= held:  # beyond: a gap; the answer asks from ``held``
            start = held - report.evaluations_from
            for e in report.evaluations[start:]:
                self.evaluations.append((self._next(), t, e.round, e.iteration, e.target,
                                         e.metric, e.value, e.worker))
            held = max(held, report.evaluations_from + len(report.evaluations))
        self._held[index] = (session, held)
        return held

    def ingest(self, index: int, report: Any, now: float, *, session: int = 0,
               rounds: int = 0) -> int:
        """``parse`` then ``store``: a bad report raises and changes nothing."""
        return self.store(index, session, self.parse(index, report, rounds), now)

    def evaluations_held(self, index: int, session: int) -> int:
        held_session, held = self._held.get(index, (session, 0))
        return held if held_session == session else 0

    # ------------------------------------------------------------------ reading
    @staticmethod
    def state(coord: Any) -> str:
        if coord.stopped is not None:
            return "stopped"
        if coord.finished:
            return "finished"
        if coord.finishing or coord.stop_reason is not None:
            return "finishing"
        return "running" if coord.started else "waiting"

    def eta(self, coord: Any, state: str, rate: float | None, now: float) -> float | None:
        """Seconds left: by the iteration budget at ``rate``, or to ``MINUTES``, the sooner."""
        if state == "finished":
            return 0.0
        if state == "stopped":
            return None
        guesses = []
        budget = coord.schedule.max_iterations
        if budget is not None:
            left = max(0, budget - coord.done)
            if left == 0:
                guesses.append(0.0)
            elif rate:
                guesses.append(left / rate)
        if coord.deadline is not None:
            guesses.append(max(0.0, coord.deadline - now))
        return round(min(guesses), 3) if guesses else None

    def snapshot(self, coord: Any, now: float, wall: float | None = None) -> dict:
        """The ``/status.json`` document (docs/observability.md)."""
        state = self.state(coord)
        rate = self.rate(coord.done, now)
        best = coord.last_leader
        leader = None
        if best is not None and best.leader is not None:
            leader = {"worker": best.leader.worker_id, "node": best.leader_node,
                      "loss": _num(best.leader.loss), "round": best.id,
                      "iteration": best.iteration}
        nodes, workers = [], []
        for i in range(coord.num_groups):
            n, r = coord.nodes.get(i), self.reports.get(i)
            nodes.append({
                "index": i, "joined": n is not None,
                "alive": bool(n is not None and n.alive and not n.left),
                "left": bool(n is not None and n.left),
                "last_heard_s": round(max(0.0, now - n.last_seen), 3) if n is not None else None,
                "steps": r.steps if r else (n.consumed if n is not None else 0),
                "counted": n.consumed if n is not None else 0,
                "rate": r.rate if r else None, "workers": coord.workers,
                "workers_training": r.workers_training if r else 0,
                "reattaches": r.reattaches if r else 0,
                "local_leader": ({"worker": r.local_leader[0], "loss": r.local_leader[1]}
                                 if r and r.local_leader else None)})
            for w in r.workers if r else ():
                workers.append({"id": w.id, "node": i, "iterations": w.iterations,
                                "loss": w.loss, "distance": w.distance,
                                "distance_to": w.distance_to, "round": w.round,
                                "resets": w.resets, "respawns": w.respawns,
                                "training": w.training})
        evaluations = [dict(zip(EVALUATION_FIELDS[2:], e[2:]))
                       for e in itertools.islice(reversed(self.evaluations), LAST_EVALUATIONS)]
        evaluations.reverse()
        minutes = (None if coord.deadline is None
                   else round((coord.deadline - coord.started_at) / 60, 6))
        return {
            "time": wall,
            "job": {
                "id": coord.job_id, "algorithm": coord.algorithm, "exchange": self.exchange,
                "num_groups": coord.num_groups,
                "workers_per_node": coord.workers, "state": state, "counter": coord.done,
                "budget": {"iterations": coord.schedule.max_iterations, "minutes": minutes},
                "elapsed_s": round(now - coord.started_at, 3),
                "rate": None if rate is None else round(rate, 3),
                "eta_s": self.eta(coord, state, rate, now),
                "rounds": {**self.kinds, "total": coord.rounds_opened},
                "stop_reason": coord.stopped or coord.stop_reason,
                "restarts": self.restarts,
            },
            "leader": leader,
            "nodes": nodes,
            "workers": workers,
            "evaluations": evaluations,
            "history": {"next": self._seq + 1},
        }

    def metrics(self, coord: Any, now: float) -> dict:
        """The numbers ``/metrics`` exposes (``prom.py``), copied out under the lock."""
        state = self.state(coord)
        return {"iterations": coord.done, "budget": coord.schedule.max_iterations,
                "rounds": dict(self.kinds), "rate": self.rate(coord.done, now) or 0.0,
                "alive": coord.live_count, "expected": coord.num_groups,
                "latency": list(self.latency), "latency_sum": self.latency_sum,
                "over": state in ("finished", "stopped"), "restarts": self.restarts}

    # ------------------------------------------------------------------ history
    def history_rows(self, since: int, page: int = PAGE) -> tuple[list, list, list, int]:
        """The ring entries numbered ``since`` on (at most ``page`` per list) and the number
        to ask from next. Every list is cut at the same number, so paging loses nothing and
        repeats nothing. Cheap: copies references to immutable tuples."""
        rings = (self.rounds, self.points, self.evaluations)
        parts = []
        for ring in rings:
            start = bisect.bisect_left(ring, since, key=_SEQ)
            parts.append(list(itertools.islice(ring, start, start + page + 1)))
        cut = min((p[page][0] for p in parts if len(p) > page), default=None)
        if cut is None:
            return parts[0], parts[1], parts[2], self._seq + 1
        parts = [[row for row in p if row[0] < cut] for p in parts]
        return parts[0], parts[1], parts[2], cut

    @staticmethod
    def format_history(rows: tuple[list, list, list, int]) -> dict:
        """``history_rows``' answer as the ``/history.json`` document (no lock needed)."""
        rounds, points, evaluations, nxt = rows
        return {"rounds": [dict(zip(ROUND_FIELDS, r)) for r in rounds],
                "points": [dict(zip(POINT_FIELDS, p)) for p in points],
                "evaluations": [dict(zip(EVALUATION_FIELDS, e)) for e in evaluations],
                "next": nxt}

    def history(self, since: int, page: int = PAGE) -> dict:
        """The ``/history.json`` document from sequence number ``since`` on."""
        return self.format_history(self.history_rows(since, page))
