"""A rule of your own (the tutorial of docs/rules.md): pull toward the mean of the k best workers.

Run it on 2 nodes x 2 workers, editing nothing in lsgd:

    export ALGORITHM=examples/rules/topk.py:TopK RULE_ARGS=k=2 NUM_GROUPS=2
    bash train.sh 0 & bash train.sh 1; wait

What it computes, every global round: each node gives weight 1 to its ceil(k / NUM_GROUPS)
participants of lowest loss and 1e-6 (the least weight there is) to the others; the global
server's center is sum_i w_i x_i / sum_i w_i; every participant moves toward it with strength
``pull``. Losses never leave their node, so the k best of the job are approximated by the best
ceil(k / NUM_GROUPS) of each node.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lsgd.rules import CENTER, Contribution, Exchange, RoundKind, RoundRoles, Rule
from lsgd.rules.base import MIN_WEIGHT
from lsgd.rules.ops import mean_into_


class TopK(Rule):
    name = "topk"
    exchange = Exchange.CENTER  # the servers make a weighted mean of the participants ...
    pull_after_exchange = True  # ... and the participants pull toward this round's mean

    def __init__(self, k: int = 2, pull: float = 0.5, nodes: int = 1) -> None:
        if k < 1 or nodes < 1 or not 0 <= pull <= 1:
            raise ValueError(f"need k >= 1, nodes >= 1, pull in [0, 1]; got {k}, {nodes}, {pull}")
        self.per_node, self.pull = math.ceil(k / nodes), pull

    @classmethod
    def from_config(cls, config: Any, **args: Any) -> "TopK":
        args.setdefault("nodes", config.num_groups)  # a job knob, read from the job's config
        return cls(**args)

    def weights(self, contributions: Sequence[Contribution]) -> list[float]:
        ranked = sorted(contributions, key=lambda c: (math.isnan(c.loss), c.loss, c.worker_id))
        best = {c.worker_id for c in ranked[: self.per_node]}
        return [1.0 if c.worker_id in best else MIN_WEIGHT for c in contributions]

    def update_(self, center, total, weight, count, state) -> None:
        mean_into_(center, total, weight)  # center = sum_i w_i x_i / sum_i w_i

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return [(CENTER, self.pull)] if kind == RoundKind.GLOBAL else []
