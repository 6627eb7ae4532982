"""Leader election: per-worker loss windows and the argmin over a round's participants.

Pure logic, no I/O. A worker's loss estimate is the mean of its last ``avg_size`` minibatch
losses since its parameters last changed by a pull; a worker is eligible only when that window
is full and every loss in it is finite (a fresh worker never looks best because of a zero-filled
window, and a NaN/inf loss never wins).
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
    """Running window of the last ``size`` minibatch losses of one worker."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"avg_size must be >= 1, got {size}")
        self.size = size
        self._losses: deque = deque(maxlen=size)

    def add(self, loss: object) -> None:
        """Record one minibatch loss: a float, or a framework scalar read only when needed."""
        self._losses.append(loss)

    def reset(self) -> None:
        """Forget every loss (the parameters changed, so old losses no longer describe them)."""
        self._losses.clear()

    def read(self) -> tuple[float, bool]:
        """``(estimate, finite)`` from one read of each loss (reading a GPU scalar syncs).

        ``estimate`` is the window's mean, NaN unless the window is full and finite; ``finite``
        is False when any loss in it is NaN or infinite (the worker has diverged).
        """
        values = [float(x) for x in self._losses]
        finite = all(map(math.isfinite, values))
        full = len(values) == self.size
        return (math.fsum(values) / self.size if finite and full else math.nan), finite

    @property
    def eligible(self) -> bool:
        """True when the window is full and holds only finite losses."""
        return len(self._losses) == self.size and self.read()[1]

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
