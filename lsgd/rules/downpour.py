"""DOWNPOUR, or asynchronous SGD (Dean et al., NeurIPS 2012): a worker sends the parameter
server what its steps changed, and takes the server's parameters now and then.

* every ``n_push`` of its own steps: ``d = x - ref`` (its change since it last pushed or
  fetched), the server does ``w <- w + scale * d``, and ``ref <- x``;
* every ``n_fetch`` of its own steps (after the push when both are due): ``x <- w``,
  ``ref <- w``.

``w`` is the job's center (evaluated at the end). ``scale=1`` is Dean et al.'s ``w <- w + d``:
``w`` then takes every worker's steps, ``N`` workers' worth per step of one, so the local
learning rate must be about ``LR / N`` (the default job's 0.05 diverges with 4 workers). The
default ``scale = 1 / N`` (``N``: workers in the job) keeps ``w``'s step that of one worker
whatever ``N``: a server learning rate of ``1/N``.

Staleness: a worker's steps are computed on parameters up to ``n_fetch`` of its own steps old;
other nodes' pushes reach its node with the node's next download of the center (``SYNC_EVERY``,
0.05 s, plus one transfer), and meanwhile the other workers push about ``n_fetch * (N - 1)``
steps' worth of changes. The periods are short by default (4 steps) because large ones let
every worker take the same long stride from the same stale ``w``.
"""

from __future__ import annotations

import math
import random
from typing import Mapping

import numpy as np

from .asynchronous import AsyncRule, NodeSide
from .ops import copy_, pull_toward_, push_delta_

PUSH, FETCH = 1, 2  # action bits
REF = "ref"  # per worker: its parameters when it last pushed or fetched


class Downpour(AsyncRule):
    """DOWNPOUR / ASGD: push accumulated changes every ``n_push`` steps, fetch every ``n_fetch``."""

    name = "downpour"
    worker_buffers = (REF,)

    def __init__(self, n_push: int = 4, n_fetch: int = 4, scale: float = 1.0) -> None:
        if n_push < 1 or n_fetch < 1:
            raise ValueError(f"n_push and n_fetch (steps) must be >= 1, got {n_push}, {n_fetch}")
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"scale (the server's step on a pushed change) must be in (0, 1], "
                             f"got {scale}")
        self.n_push, self.n_fetch, self.scale = n_push, n_fetch, scale

    @classmethod
    def from_config(cls, config, **args) -> "Downpour":
        args.setdefault("scale", 1.0 / (config.num_groups * config.workers))
        return cls(**args)

    def due(self, steps: int, rng: random.Random) -> int:
        return (PUSH if steps % self.n_push == 0 else 0) | (FETCH if steps % self.n_fetch == 0 else 0)

    def start_(self, x: np.ndarray, mine: Mapping[str, np.ndarray]) -> None:
        copy_(mine[REF], x)

    def exchange_(self, action: int, x: np.ndarray, mine: Mapping[str, np.ndarray],
                  node: NodeSide) -> float:
        if action & PUSH:
            push_delta_(x, mine[REF], node.center, node.outbox, self.scale)
        if not action & FETCH:
            return math.nan
        distance = pull_toward_(x, node.center, 1.0)  # x <- w
        copy_(mine[REF], x)
        return distance
