"""DiLoCo (Douillard et al., arXiv 2311.08105): local steps, then an outer optimizer step.

The global server holds the outer parameters ``theta`` (the center) and the outer optimizer's
momentum. Every global round (``G_COMM`` = H inner steps of each worker):

    delta    = theta - mean_i(x_i)             # the outer pseudo-gradient
    m        = mu * m + delta                   # SGD momentum (mu = OUTER_MOMENTUM)
    theta   <- theta - lr * (delta + mu * m)    # Nesterov (lr = OUTER_LR); without: lr * m

and every participant restarts from the new ``theta`` (a pull of strength 1). ``theta`` starts
as node 0's initial parameters and ``m`` at zero; both are in the server's saved state and in
checkpoints. Defaults: lr 0.7, momentum 0.9, Nesterov (the paper's, OpenDiLoCo's, torchft's).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import CENTER, Exchange, RoundKind, RoundRoles, Rule
from .ops import CHUNK


class DiLoCo(Rule):
    """Outer Nesterov SGD on the mean of the workers' parameters, every global round."""

    name = "diloco"
    exchange = Exchange.CENTER
    pull_after_exchange = True
    server_state = ("momentum",)

    def __init__(self, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True) -> None:
        if not 0 < outer_lr <= 10:
            raise ValueError(f"outer_lr must be in (0, 10], got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov

    @classmethod
    def from_config(cls, config: Any, **args: Any) -> "DiLoCo":
        args.setdefault("outer_lr", config.outer_lr)
        args.setdefault("outer_momentum", config.outer_momentum)
        return cls(**args)

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return [(CENTER, 1.0)] if kind == RoundKind.GLOBAL else []

    def update_(self, center: np.ndarray, total: np.ndarray, weight: float, count: int,
                state: Mapping[str, np.ndarray]) -> None:
        momentum = state["momentum"]
        inv, lr, mu = np.float32(1.0 / weight), np.float32(self.outer_lr), np.float32(self.outer_momentum)
        scratch = np.empty(min(CHUNK, center.size), dtype=np.float32)
        for lo in range(0, center.size, CHUNK):
            sl = slice(lo, lo + CHUNK)
            delta = scratch[: center[sl].size]
            np.multiply(total[sl], inv, out=delta)  # the mean
            np.subtract(center[sl], delta, out=delta)  # delta = theta - mean
            m = momentum[sl]
            m *= mu
            m += delta
            if self.nesterov:  # step = delta + mu * m
                delta += mu * m
            else:
                delta[...] = m
            delta *= lr
            center[sl] -= delta
