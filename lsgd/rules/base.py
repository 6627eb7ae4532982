"""The public Rule API: what a training rule says, with no transport in it.

A rule answers five questions (``docs/rules.md`` walks through each built-in):

1. **When rounds happen.** Global rounds every ``G_COMM`` steps of each worker (counted over the
   whole job, Algorithm 1 of the LSGD paper), and local rounds every ``L_COMM`` between them if
   ``has_local_rounds``. The final round ends the job.
2. **What each participant contributes.** Its parameters and its loss estimate (the mean of its
   minibatch losses since its last round), and the per-step scalars the rule names in
   ``scalars`` (e.g. ``("grad_norm",)``: the training loop passes ``worker.step(loss,
   grad_norm=g)``; the rule sees each as a moving average, ``Contribution.scalars``).
3. **How the servers combine the contributions into a target.** ``exchange``:

   * ``Exchange.LEADER``: elect the participant with the lowest loss (per node in local rounds,
     over the job in global ones) and share its parameters;
   * ``Exchange.CENTER``: the weighted mean of the participants (``weights`` of a node's
     participants together, or ``weight`` of each, 1 by default: each node sums its
     participants' ``w_i x_i``, the global server adds the nodes' sums) goes to
     ``update_``, which turns it into the new *center* on the global server (EASGD's elastic
     move, model averaging's copy, DiLoCo's outer optimizer step, ...).
4. **What each participant does with the target.** ``pulls(kind, roles)``: the node buffers to
   pull toward and how hard (``x <- x - s (x - target)``; 1 replaces, 0 or none leaves ``x``).
   With ``pull_after_exchange`` the pulls use the new center of this round; without, the
   node's copy of the previous one (EASGD's synchronous form, values before the update).
5. **What state the rule keeps on the global server.** The center, and the vectors named in
   ``server_state`` (zeros at the start; DiLoCo's momentum), saved with the server's state and
   in checkpoints.

A rule of your own is a subclass in a file of yours, run with ``ALGORITHM=path/to/rule.py:Class``
(or ``package.module:Class``); its constructor's keyword arguments come from ``RULE_ARGS``
(``"name=value,name=value"``), converted to the types of its annotations. ``from_config`` may
read the job's knobs instead (the built-ins read C1, C2, ALPHA, ...).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np


class RoundKind(enum.IntEnum):
    """Kinds of rounds; values equal the protobuf enum ``lsgd.v1.RoundKind``."""

    LOCAL = 1
    GLOBAL = 2
    FINAL = 3


class Exchange(enum.Enum):
    """How the global server combines the participants of a global round."""

    LEADER = "leader"  # elect the best participant, share its parameters
    CENTER = "center"  # weighted mean of the participants -> ``Rule.update_`` -> the center


MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6  # a participant's weight in a weighted mean (Rule.weight)

# Names of the parameter buffers in node shared memory besides the per-worker slots: what
# ``pulls`` may name.
LOCAL_LEADER = "local_leader"
GLOBAL_LEADER = "global_leader"
CENTER = "center"
SUM = "sum"


@dataclass(frozen=True)
class RoundRoles:
    """Who led a round, as seen by one participant."""

    worker_id: int
    local_leader: int | None  # None: no eligible participant on the node
    global_leader: int | None  # None: no eligible participant anywhere, or the exchange failed
    multi_node: bool


@dataclass(frozen=True)
class Contribution:
    """What one participant brings to a round besides its parameters."""

    worker_id: int
    loss: float  # mean of its minibatch losses since its last round (NaN: none)
    scalars: Mapping[str, float] = field(default_factory=dict)  # the rule's ``scalars``, averaged


class RuleError(ValueError):
    """A rule, or its arguments, cannot be used; the message says why and how to fix it."""


class Rule(ABC):
    """Base class of the training rules (the built-ins and yours)."""

    name: str = ""
    exchange: Exchange = Exchange.LEADER
    pull_after_exchange: bool = False  # CENTER: pull toward this round's new center
    scalars: tuple[str, ...] = ()  # per-step scalars the training loop passes to step()
    scalar_momentum: float = 0.9 ** 8  # their moving average across rounds (0: the latest value)
    server_state: tuple[str, ...] = ()  # CENTER: more vectors the global server keeps
    synchronous: bool = True  # False: no barrier; workers exchange on their own clocks
    # (``lsgd.rules.asynchronous.AsyncRule``), and the only round is the final one

    @classmethod
    def from_config(cls, config: Any, **args: Any) -> "Rule":
        """The rule for a job: ``config`` is its ``JobConfig``, ``args`` come from RULE_ARGS."""
        return cls(**args)

    @property
    def node_buffers(self) -> tuple[str, ...]:
        """Node shared-memory buffers this rule needs (the final round adds leader and sum)."""
        if self.exchange == Exchange.CENTER:
            return (CENTER, GLOBAL_LEADER, SUM)
        return (GLOBAL_LEADER, SUM)

    def has_local_rounds(self, num_groups: int) -> bool:
        """Whether local (within-node) rounds happen between global ones."""
        return False

    def weight(self, c: Contribution) -> float:
        """CENTER: a participant's weight in the mean (finite, in [1e-6, 1e6])."""
        return 1.0

    def weights(self, contributions: Sequence[Contribution]) -> list[float]:
        """CENTER: the weights of one node's participants in a global round, one per
        contribution in order (finite, in [1e-6, 1e6]). Override it to weigh participants
        against each other (e.g. the k best by loss); it sees one node's participants only
        (nodes send the global server their weighted sums, not their losses). The default asks
        ``weight`` for each."""
        return [self.weight(c) for c in contributions]

    @abstractmethod
    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        """Return ``[(buffer, strength), ...]`` applied in order to a participant, in place."""

    def per_step_pulls(self, multi_node: bool) -> list[tuple[str, float]]:
        """Pulls a worker applies after every step, toward the node buffers as they were at its
        last round (LSGD's optional proximal term); none by default."""
        return []

    def update_(self, center: np.ndarray, total: np.ndarray, weight: float, count: int,
                state: Mapping[str, np.ndarray]) -> None:
        """CENTER, on the global server: make the new ``center`` (in place) from this round's
        weighted sum ``total`` (``sum_i w_i x_i``; read only) and ``weight``
        (``sum_i w_i``) of ``count`` participants. ``state``: the vectors of ``server_state``."""
        raise NotImplementedError(f"rule {self.name} has no center")


def node_weights(rule: Rule, contributions: Sequence[Contribution]
                 ) -> tuple[list[float], list[tuple[int, float]]]:
    """``rule.weights(contributions)`` as a node uses them: each clipped into [1e-6, 1e6] (NaN
    to 1e-6). Returns the weights and ``(position, value)`` of each clipped one.

    Raises:
        RuleError: the rule did not give one number per contribution.
    """
    given = list(rule.weights(contributions))
    if len(given) != len(contributions):
        raise RuleError(f"rule {rule.name}: weights() gave {len(given)} weights for "
                        f"{len(contributions)} participants; give one per participant")
    weights, clipped = [], []
    for pos, value in enumerate(given):
        w = float(value)
        if not MIN_WEIGHT <= w <= MAX_WEIGHT:  # NaN too
            clipped.append((pos, w))
            w = MAX_WEIGHT if w > MAX_WEIGHT else MIN_WEIGHT
        weights.append(w)
    return weights, clipped
