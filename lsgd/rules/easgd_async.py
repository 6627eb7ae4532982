"""Asynchronous EASGD (Zhang, Choromanska, LeCun, NeurIPS 2015, Algorithm 2; Platoon's
``param_sync`` default): every ``every`` of its own steps a worker does

    d = alpha (x - center);   x <- x - d;   center <- center + d

with no barrier. The center is the job's result (evaluated at the end); ``alpha ~ 1/workers``
is the usual start (Platoon: 0.5 with 2 workers).
"""

from __future__ import annotations

import random
from typing import Mapping

import numpy as np

from .asynchronous import AsyncRule, NodeSide
from .ops import elastic_exchange_

EXCHANGE = 1  # the only action


class AsyncEASGD(AsyncRule):
    """EASGD without a barrier: an elastic exchange every ``every`` steps of each worker."""

    name = "easgd-async"

    def __init__(self, alpha: float = 0.1, every: int = 64) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha (pulling strength) must be in (0, 1], got {alpha}")
        if every < 1:
            raise ValueError(f"every (steps between exchanges) must be >= 1, got {every}")
        self.alpha, self.every = alpha, every

    @classmethod
    def from_config(cls, config, **args) -> "AsyncEASGD":
        args.setdefault("alpha", config.alpha)  # RULE_ARGS override the knobs
        args.setdefault("every", config.g_comm)
        return cls(**args)

    def due(self, steps: int, rng: random.Random) -> int:
        return EXCHANGE if steps % self.every == 0 else 0

    def exchange_(self, action: int, x: np.ndarray, mine: Mapping[str, np.ndarray],
                  node: NodeSide) -> float:
        return elastic_exchange_(x, node.center, node.outbox, self.alpha)
