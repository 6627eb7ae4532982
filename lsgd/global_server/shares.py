"""How many credits a request gets (pure arithmetic; the coordinator applies it).

- **Half a fair share** of the period per request, by node count: a fast node comes back for
  more of what is left, so nodes of different speeds share a period without revoking credits.
  That takes about two credit calls per node and period.
- **A share in proportion to the node's speed**, for the node's first credits of a period
  (carried by the answer that names a local round; asked for after a global round's exchange),
  once every live node's speed is known: each node then finishes its share at about the same
  time, and makes one credit call per local period, the one that reports its steps and waits
  for the next round (issue 15). Whatever the rounding leaves goes out in half fair shares.
  An asynchronous rule has no rounds before the final one: every grant is sized by speed, so
  that what each node holds is worth about the same time and the final round waits for no
  large grant of a slow node.

Two bounds hold whatever the speeds say: a node never holds more than a period (what a
reattaching node may claim), and a share sized by speed is at least an eighth of a fair share,
so that a node claiming a huge speed cannot shrink the others' grants to a credit each.

A node's speed is the ratio of two decaying sums: of the steps it reports, and of how long
they took (``used_ms``), measured by the node from the moment it put its previous answer to
use (after that answer's round, if it named one). A ratio of sums, not an average of ratios:
the steps a node reports in one call are those of the workers that came back first, the rest
come with its next call, so single samples swing both ways. The estimate only sizes shares:
credits never pass the next round's boundary whatever it says, so a wrong one costs idle time,
never an exact round.
"""

from __future__ import annotations

import math

MAX_USED_MS = 24 * 3600 * 1000  # a sample longer than a day is ignored
KEEP = 0.75  # of the sums at each new sample


def sampled(steps: float, ms: float, consumed: int, used_ms: int) -> tuple[float, float]:
    """The node's sums (steps, milliseconds) after a report of ``consumed`` steps taken in
    ``used_ms``; unchanged when the report is not a sample."""
    if consumed <= 0 or not 0 < used_ms <= MAX_USED_MS:
        return steps, ms
    return KEEP * steps + consumed, KEEP * ms + used_ms


def rate(steps: float, ms: float) -> float:
    """Steps per second from the sums; 0 when not measured yet."""
    return steps * 1000.0 / ms if ms > 0 and steps > 0 else 0.0


def half_fair(period: int, live: int) -> int:
    """Half a fair share of ``period`` among ``live`` nodes (at least one credit)."""
    return max(1, math.ceil(period / (2 * max(1, live))))


def proportional(period: int, speed: float, speed_sum: float) -> int:
    """The share of ``period`` of a node of ``speed`` among nodes whose speeds add up to
    ``speed_sum``; 0 when the speeds are not all known (``speed_sum`` 0)."""
    if speed <= 0 or speed_sum <= 0:
        return 0
    return max(1, round(period * min(1.0, speed / speed_sum)))  # nearest: no first-come bias
