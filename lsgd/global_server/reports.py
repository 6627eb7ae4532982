"""A node's ``NodeReport`` (carried by its heartbeats) checked and turned into plain data.

Every field a node sends is bounded here before the status board keeps anything of it: a node
holding the job secret may still be hostile. ``parse_report`` reads the whole report first and
raises ``CoordinatorError("INVALID_ARGUMENT", ...)`` naming the first bad field, so a refused
report changes nothing. Numbers that are not finite (a loss of NaN: none yet, or diverged) are
kept as unknown (``None``); a count out of range is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .records import CoordinatorError

MAX_COUNT = 1 << 53  # steps, iterations, round ids, indices: exact as JSON numbers
MAX_TEXT = 64  # characters of a metric name or an evaluation target
MAX_EVALUATIONS = 64  # per report
MAX_RATE = 1e12  # steps per second; more is not a rate, it is unknown
TARGETS = ("local_leader", "global_leader", "center")  # what a worker's distance is to
EVAL_TARGETS = ("leader", "average", "center")
_CANONICAL = {t: t for t in TARGETS + EVAL_TARGETS}  # one string object per name, shared


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker as its node last saw it."""

    id: int
    iterations: int
    loss: float | None
    distance: float | None
    distance_to: str  # "" (none yet) or one of TARGETS
    resets: int
    respawns: int
    training: bool
    round: int  # the round of loss and distance (0: none yet)


@dataclass(frozen=True, slots=True)
class EvaluationReport:
    round: int
    iteration: int
    target: str
    metric: str
    value: float | None
    worker: int


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What one heartbeat said of its node."""

    steps: int
    rate: float | None
    workers_training: int
    reattaches: int
    workers: tuple[WorkerReport, ...]
    local_leader: tuple[int, float | None] | None  # (worker id, loss)
    evaluations_from: int
    evaluations: tuple[EvaluationReport, ...]


def _bad(field: str, why: str) -> CoordinatorError:
    return CoordinatorError("INVALID_ARGUMENT", f"heartbeat report: {field} {why}")


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _count(value: int, field: str, most: int = MAX_COUNT) -> int:
    if not 0 <= value <= most:
        raise _bad(field, f"must be in 0..{most}, got {value}")
    return int(value)


def _text(value: str, field: str) -> str:
    if len(value) > MAX_TEXT or not value.isprintable():
        raise _bad(field, f"must be at most {MAX_TEXT} printable characters")
    return value


def parse_report(report: object, *, index: int, num_groups: int, workers: int,
                 rounds: int) -> NodeReport:
    """Check ``report`` (a ``lsgd.v1.NodeReport``) from node ``index`` and return it as data.

    Args:
        report: the protobuf message (read field by field; nothing of it is kept).
        index: the reporting node; every worker it names must be its own.
        num_groups: nodes in the job.
        workers: workers per node: at most this many entries, ids
            ``index*workers .. index*workers + workers - 1``.
        rounds: rounds opened so far: no round named may be newer.

    Raises:
        CoordinatorError: INVALID_ARGUMENT naming the first field out of bounds.
    """
    if not 0 <= index < num_groups:
        raise _bad("node index", f"must be in 0..{num_groups - 1}, got {index}")
    first, last = index * workers, index * workers + workers - 1
    if len(report.workers) > workers:
        raise _bad("workers", f"lists {len(report.workers)} entries; node {index} has {workers}")
    seen: set[int] = set()
    stats = []
    for k, w in enumerate(report.workers):
        where = f"workers[{k}]"
        if not first <= w.worker_id <= last:
            raise _bad(f"{where}.worker_id", f"{w.worker_id} is not a worker of node {index} "
                       f"({first}..{last})")
        if w.worker_id in seen:
            raise _bad(f"{where}.worker_id", f"{w.worker_id} is listed twice")
        seen.add(w.worker_id)
        if w.distance_to and w.distance_to not in TARGETS:
            raise _bad(f"{where}.distance_to", f"must be empty or one of {', '.join(TARGETS)}")
        distance = _finite(w.distance)
        if distance is not None and distance < 0:
            raise _bad(f"{where}.distance", f"must be >= 0, got {distance}")
        stats.append(WorkerReport(
            id=w.worker_id, iterations=_count(w.iterations, f"{where}.iterations"),
            loss=_finite(w.loss), distance=distance,
            distance_to=_CANONICAL.get(w.distance_to, ""), resets=int(w.resets),
            respawns=int(w.respawns), training=bool(w.training),
            round=_count(w.round_id, f"{where}.round_id", rounds)))
    leader = None
    if report.has_local_leader:
        wid = report.local_leader.worker_id
        if not first <= wid <= last:
            raise _bad("local_leader.worker_id", f"{wid} is not a worker of node {index}")
        leader = (int(wid), _finite(report.local_leader.loss))
    evals = report.evaluations
    if len(evals) > MAX_EVALUATIONS:
        raise _bad("evaluations", f"holds {len(evals)}; at most {MAX_EVALUATIONS} per report")
    if evals and index != 0:
        raise _bad("evaluations", f"come from node 0 only, not node {index}")
    total = num_groups * workers
    parsed = []
    for k, e in enumerate(evals):
        where = f"evaluations[{k}]"
        if e.target not in EVAL_TARGETS:
            raise _bad(f"{where}.target", f"must be one of {', '.join(EVAL_TARGETS)}")
        if not e.metric:
            raise _bad(f"{where}.metric", "is empty")
        parsed.append(EvaluationReport(
            round=_count(e.round_id, f"{where}.round_id", rounds),
            iteration=_count(e.iteration, f"{where}.iteration"), target=_CANONICAL[e.target],
            metric=_text(e.metric, f"{where}.metric"), value=_finite(e.value),
            worker=_count(e.worker_id, f"{where}.worker_id", total - 1)))
    rate = report.rate if math.isfinite(report.rate) and 0 <= report.rate <= MAX_RATE else None
    return NodeReport(
        steps=_count(report.steps, "steps"), rate=rate,
        workers_training=_count(report.workers_training, "workers_training", workers),
        reattaches=int(report.reattaches), workers=tuple(stats), local_leader=leader,
        evaluations_from=_count(report.evaluations_from, "evaluations_from",
                                MAX_COUNT - len(parsed)),
        evaluations=tuple(parsed))
