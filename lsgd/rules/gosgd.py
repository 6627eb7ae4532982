"""GoSGD (Blot, Picard, Cord, Thome 2016, arXiv 1611.09726; Theano-MPI's GOSGD exchanger):
gossip between workers, no center.

Every worker carries a weight ``a`` (``1 / N`` at the start, ``N`` workers in the job). After
each of its steps, with probability ``p``, a worker

1. merges the messages it received since its last exchange, ``x <- (a x + sum a_k x_k) /
   (a + sum a_k)``, ``a <- a + sum a_k``;
2. halves its weight, ``a <- a / 2``, and sends ``(x, a)`` to a worker of the job drawn at
   random (not itself), whose next exchange merges it.

The weights of all workers and of the messages on their way always sum to 1 (push-sum). A
message waits for its receiver's next exchange (about ``1 / p`` of its steps); one for another
node goes with its node's next sync (``SYNC_EVERY``) through the global server, which hands it
to a random other node, where a random worker receives it (``lsgd/local_server/mailroom.py``).
The job's result is the workers' average (evaluated at the end, with the final leader).
"""

from __future__ import annotations

import math
import random

import numpy as np

from .asynchronous import INCOMING, MAIL, MAILSEND, OUTMAIL, AsyncRule, Mine, NodeSide
from .base import GLOBAL_LEADER, SUM, Exchange
from .ops import merge_

SEND = 1  # the only action
WEIGHT = "weight"  # per worker, in mine.scalars


class GoSGD(AsyncRule):
    """GoSGD: after each step, with probability ``p``, merge the mail and gossip to a random peer."""

    name = "gosgd"
    exchange = Exchange.LEADER  # no center: the final round elects a leader and averages
    gossip = True
    worker_buffers = (MAIL,)

    def __init__(self, p: float = 1 / 64, workers: int = 1) -> None:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p (probability of a gossip after a step) must be in (0, 1], got {p}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.p, self.workers = p, workers

    @classmethod
    def from_config(cls, config, **args) -> "GoSGD":
        if "workers" in args:  # the weights start at 1 / workers: it must be the job's count
            raise ValueError("gosgd takes no 'workers' argument: it is the job's workers, "
                             "NUM_GROUPS x WORKERS")
        args.setdefault("p", 1.0 / config.g_comm)  # one exchange per G_COMM steps on average
        return cls(workers=config.num_groups * config.workers, **args)

    @property
    def node_buffers(self) -> tuple[str, ...]:
        return (OUTMAIL, MAILSEND, INCOMING, GLOBAL_LEADER, SUM)

    def due(self, steps: int, rng: random.Random) -> int:
        return SEND if rng.random() < self.p else 0

    def start_(self, x: np.ndarray, mine: Mine) -> None:
        mine.scalars.setdefault(WEIGHT, 1.0 / self.workers)  # a respawned worker keeps its own

    def retire_(self, x: np.ndarray, mine: Mine, node: NodeSide) -> None:
        """Its weight (with ``x``) and its unread mail go to a worker of the node that still
        trains, so the job's weights keep their sum."""
        node.bequeath(mine, x, mine.scalars.pop(WEIGHT, 0.0))

    def exchange_(self, action: int, x: np.ndarray, mine: Mine, node: NodeSide) -> float:
        weight = mine.scalars[WEIGHT]
        mail, mail_weight = node.mail(mine)
        distance = math.nan
        if mail_weight > 0:
            distance = merge_(x, weight, mail, mail_weight)
            weight += mail_weight
            node.clear_mail(mine)
        if self.workers > 1:
            weight /= 2
            node.post(x, weight)
        mine.scalars[WEIGHT] = weight
        return distance
