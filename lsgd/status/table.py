"""``/status.json`` as terminal text (``lsgd status``): pure, no I/O.

The document comes from node 0 (schema: ``docs/observability.md``). Every field is read
defensively: a missing or odd value prints as ``-`` instead of failing, and text is stripped of
control characters so a status page cannot drive the terminal.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

OVER = ("finished", "stopped")  # job states after which nothing changes any more
SHOWN_EVALUATIONS = 6


def render(status: dict) -> str:
    """The status as lines of text: job, leader, nodes, workers, last evaluations."""
    job = _dict(status.get("job"))
    lines = [_job_line(job)]
    leader = status.get("leader")
    if isinstance(leader, dict):
        lines.append(f"leader: worker {_s(leader.get('worker'))} on node {_s(leader.get('node'))}, "
                     f"loss {_num(leader.get('loss'))} (round {_s(leader.get('round'))}, "
                     f"iteration {_int(leader.get('iteration'))})")
    else:
        lines.append("leader: none yet" if job.get("exchange") != "center"
                     else "leader: none yet (the rule pulls toward a center)")
    if job.get("stop_reason"):
        lines.append(f"stopped: {_s(job.get('stop_reason'))}")
    nodes = [n for n in _list(status.get("nodes")) if isinstance(n, dict)]
    lines += ["", "nodes"] + _table(
        ["node", "alive", "last heard", "steps", "it/s", "workers", "training", "reattaches",
         "local leader"],
        [[_s(n.get("index")), _alive(n), _secs(n.get("last_heard_s")), _int(n.get("steps")),
          _num(n.get("rate"), 1), _int(n.get("workers")), _int(n.get("workers_training")),
          _int(n.get("reattaches")), _local_leader(n.get("local_leader"))] for n in nodes])
    workers = [w for w in _list(status.get("workers")) if isinstance(w, dict)]
    lines += ["", "workers"] + _table(
        ["worker", "node", "iterations", "loss", "distance", "to", "round", "resets", "respawns",
         "training"],
        [[_s(w.get("id")), _s(w.get("node")), _int(w.get("iterations")), _num(w.get("loss")),
          _num(w.get("distance")), _s(w.get("distance_to")).replace("_", " "),
          _s(w.get("round")), _int(w.get("resets")), _int(w.get("respawns")),
          _yes(w.get("training"))] for w in workers])
    evals = [e for e in _list(status.get("evaluations")) if isinstance(e, dict)]
    if evals:
        shown = evals[-SHOWN_EVALUATIONS:]
        lines += ["", f"evaluations (last {len(shown)} of {len(evals)})"] + _table(
            ["round", "iteration", "target", "metric", "value", "worker"],
            [[_s(e.get("round")), _int(e.get("iteration")), _s(e.get("target")),
              _s(e.get("metric")), _num(e.get("value"), 4), _s(e.get("worker"))] for e in shown])
    return "\n".join(lines)


def state(status: dict) -> str:
    """The job's state (``running``, ``finished``, ...), or ``""``."""
    return _s(_dict(status.get("job")).get("state"), "")


def _job_line(job: dict) -> str:
    budget = _dict(job.get("budget"))
    counter = job.get("counter")
    progress = f"{_int(counter)} iterations"
    total = budget.get("iterations")
    if _is_num(total) and total > 0:
        done = f" ({100 * counter / total:.0f}%)" if _is_num(counter) else ""
        progress = f"{_int(counter)} / {_int(total)} iterations{done}"
    elapsed = _secs(job.get("elapsed_s"))
    if _is_num(budget.get("minutes")):
        elapsed += f" of {_num(budget['minutes'])} min"
    rounds = _dict(job.get("rounds"))
    parts = [f"job {_s(job.get('id'))} ({_s(job.get('algorithm'))}): {_s(job.get('state'), '?')}",
             progress, f"{_num(job.get('rate'), 1)} it/s",
             f"ETA {_secs(job.get('eta_s'))}",
             f"rounds {_int(rounds.get('local'))} local + {_int(rounds.get('global'))} global",
             f"elapsed {elapsed}"]
    if _is_num(job.get("restarts")) and job["restarts"] > 0:
        parts.append(f"server restarts {_int(job['restarts'])}")
    return "  ".join(parts)


def _table(headers: Sequence[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
            for line in [list(headers), *rows]]


def _alive(node: dict) -> str:
    if node.get("left"):
        return "left"
    return _yes(node.get("alive"))


def _local_leader(v: Any) -> str:
    if not isinstance(v, dict):
        return "-"
    return f"worker {_s(v.get('worker'))} ({_num(v.get('loss'))})"


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any, digits: int = 4) -> str:
    if not _is_num(v):
        return "-"
    return f"{v:.{digits}f}" if digits <= 1 else f"{v:.{digits}g}"


def _int(v: Any) -> str:
    return f"{int(v)}" if _is_num(v) else "-"


def _secs(v: Any) -> str:
    if not _is_num(v):
        return "-"
    if v < 60:
        return f"{v:.1f} s"
    if v < 3600:
        return f"{int(v // 60)} min {int(v % 60):02d} s"
    return f"{int(v // 3600)} h {int(v % 3600 // 60):02d} min"


def _yes(v: Any) -> str:
    return "yes" if v is True else "no" if v is False else "-"


def _s(v: Any, none: str = "-") -> str:
    """Printable text of at most 200 characters."""
    if v is None:
        return none
    text = str(v)[:200]
    return "".join(c if c.isprintable() else "?" for c in text)


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


__all__ = ["render", "state", "OVER"]
