"""MGRAWA (Dimlioglu & Choromanska, AISTATS 2024, arXiv 2403.04206): the center is the mean of
the workers weighted by their inverse gradient norms, and the workers pull toward it.

Every global round (``G_COMM`` steps of each worker)::

    w_i  = 1 / g_i                               # g_i: worker i's smoothed gradient norm
    x_C  = sum_i w_i x_i / sum_i w_i              # each node sums w_i x_i, the server adds
    x_i <- (1 - c2) x_i + c2 x_C                  # toward this round's new center

``g_i`` is the moving average of the gradient norms the training loop gives
(``worker.step(loss, grad_norm=g)``, or a PyTorch model's ``.grad`` read at rounds), with
GRAWA's momentum ``0.9 ** 8 ~ 0.43`` and bias correction (``lsgd/worker/scalars_window.py``).
Flat regions have small gradients, so they get more weight. A weight is clipped into
[1e-6, 1e6]; a worker that gives no finite norm weighs 1 (when no worker gives one, the center
is the plain average; the local server warns once). ``c2`` is the job's ``C2`` unless
``RULE_ARGS=c2=...`` (GRAWA's scripts use 0.5). The center is evaluated at the end, with the
final leader and the average. The layer-wise variant (LGRAWA) is not implemented: it needs a
weight per layer, and the Rule API has one per participant.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .base import CENTER, MAX_WEIGHT, MIN_WEIGHT, Contribution, Exchange, RoundKind, RoundRoles, Rule
from .ops import mean_into_

GRAD_NORM = "grad_norm"


class GRAWA(Rule):
    """Pull toward the inverse-gradient-norm weighted mean of the workers, every global round."""

    name = "grawa"
    exchange = Exchange.CENTER
    pull_after_exchange = True
    scalars = (GRAD_NORM,)

    def __init__(self, c2: float = 0.1) -> None:
        if not 0.0 <= c2 <= 1.0:
            raise ValueError(f"c2 (pulling strength toward the center) must be in [0, 1], got {c2}")
        self.c2 = c2

    @classmethod
    def from_config(cls, config: Any, **args: Any) -> "GRAWA":
        args.setdefault("c2", config.c2)
        return cls(**args)

    def weight(self, c: Contribution) -> float:
        g = c.scalars.get(GRAD_NORM)
        if g is None or not math.isfinite(g) or g < 0:
            return 1.0  # no usable norm: plain averaging
        if g <= 1.0 / MAX_WEIGHT:
            return MAX_WEIGHT
        return min(MAX_WEIGHT, max(MIN_WEIGHT, 1.0 / g))

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return [(CENTER, self.c2)] if kind == RoundKind.GLOBAL else []

    def update_(self, center: np.ndarray, total: np.ndarray, weight: float, count: int,
                state: Mapping[str, np.ndarray]) -> None:
        mean_into_(center, total, weight)
