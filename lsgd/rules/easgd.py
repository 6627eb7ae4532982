"""Elastic Averaging SGD (Zhang, Choromanska, LeCun, NeurIPS 2015), synchronous round form.

In each global round every participant pulls toward the center with strength ``alpha``
(``x <- x - alpha (x - center)``) and the center moves toward the mean of the participants'
values from before their pull: ``center <- center + beta (mean - center)``, with
``beta = alpha * participants`` unless ``beta`` is set.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .base import CENTER, Exchange, RoundKind, RoundRoles, Rule
from .ops import elastic_center_


class EASGD(Rule):
    """EASGD: elastic pull toward a center variable held by the global server."""

    name = "easgd"
    exchange = Exchange.CENTER

    def __init__(self, alpha: float = 0.1, beta: float | None = None) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha (pulling strength) must be in [0, 1], got {alpha}")
        if beta is not None and not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.alpha, self.beta = alpha, beta

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return [(CENTER, self.alpha)] if kind == RoundKind.GLOBAL else []

    def beta_for(self, count: int) -> float:
        """The center's moving rate for a round with ``count`` participants."""
        return self.beta if self.beta is not None else self.alpha * count

    @classmethod
    def from_config(cls, config, **args) -> "EASGD":
        args.setdefault("alpha", config.alpha)  # RULE_ARGS override the knobs
        args.setdefault("beta", config.beta)
        rule = cls(**args)
        most = rule.alpha * config.num_groups * config.workers
        if rule.beta is None and most > 1.0:
            raise ValueError(f"alpha * workers in the job = {most:g} > 1 makes the EASGD center "
                             "diverge; lower alpha or set beta in [0, 1]")
        return rule

    def update_(self, center: np.ndarray, total: np.ndarray, weight: float, count: int,
                state: Mapping[str, np.ndarray]) -> None:
        elastic_center_(center, total, weight, self.beta_for(count))
