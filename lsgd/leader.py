"""Leader election: per-worker loss windows and the argmin over a round's participants.

Pure logic, no I/O. A worker's loss estimate is the mean of its minibatch losses since the
last round it took part in, at most the last ``avg_size`` of them; it is eligible with at least
one loss there and every loss finite. The window restarts at every round, so all candidates are
judged over the same stretch of training whatever ``avg_size`` is: a window larger than the steps
between rounds is never full, yet its worker can lead (the reference code, whose ``avg_size``
equals the round period, averages about one period too). A fresh worker never looks best because
of a zero-filled window (the mean is over the losses it has), and a NaN/inf loss never wins.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Candidate:
    """One participant's claim to leadership."""

    worker_id: int
    loss: float


class LossWindow:
    """The last ``size`` minibatch losses of one worker since its window last restarted."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"avg_size must be >= 1, got {size}")
        self.size = size
        self._losses: deque = deque(maxlen=size)

    def add(self, loss: object) -> None:
        """Record one minibatch loss: a float, or a framework scalar read only when needed."""
        self._losses.append(loss)

    def reset(self) -> None:
        """Start a new window: at every round the worker takes part in (a pull may have changed
        its parameters, and every candidate of the next round is judged from the same point)."""
        self._losses.clear()

    def read(self) -> tuple[float, bool]:
        """``(estimate, finite)`` from one read of each loss (reading a GPU scalar syncs).

        ``estimate`` is the mean of the losses held (at most ``size``), NaN when there is none or
        one is not finite; ``finite`` is False when any loss in it is NaN or infinite (the worker
        has diverged).
        """
        values = [float(x) for x in self._losses]
        finite = all(map(math.isfinite, values))
        return (math.fsum(values) / len(values) if finite and values else math.nan), finite

    @property
    def eligible(self) -> bool:
        """True when the window holds at least one loss and only finite ones."""
        return bool(self._losses) and self.read()[1]

    @property
    def estimate(self) -> float:
        """Mean of the window; NaN when not eligible."""
        return self.read()[0]


def elect(candidates: Iterable[Candidate]) -> Candidate | None:
    """Return the candidate with the lowest finite loss, ties to the lowest worker id.

    Non-finite losses are ignored. Returns None when nobody is eligible.
    """
    best: Candidate | None = None
    for c in candidates:
        if not math.isfinite(c.loss):
            continue
        if best is None or (c.loss, c.worker_id) < (best.loss, best.worker_id):
            best = c
    return best
