"""Periodic model averaging (LocalSGD; Lin, Stich, Patel, Jaggi, ICLR 2020).

In each global round every participant is replaced by the mean of all participants: each node
sums its participants' parameters, the global server adds the nodes' sums and divides by the
count, and every participant copies the result (a pull of strength 1 toward this round's new
center). With ``G_COMM=1`` and plain SGD this is synchronous data-parallel SGD (BSP, Platoon's
synchronous average): the mean of ``x - lr g_i`` is ``x - lr mean(g_i)``, one step of SGD on
the union of the participants' minibatches.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .base import CENTER, Exchange, RoundKind, RoundRoles, Rule
from .ops import mean_into_


class Average(Rule):
    """Every participant becomes the mean of all participants, every global round."""

    name = "average"
    exchange = Exchange.CENTER
    pull_after_exchange = True

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return [(CENTER, 1.0)] if kind == RoundKind.GLOBAL else []

    def update_(self, center: np.ndarray, total: np.ndarray, weight: float, count: int,
                state: Mapping[str, np.ndarray]) -> None:
        mean_into_(center, total, weight)
