"""The interface every training rule implements.

A rule says three things, and nothing about transport:

* when rounds happen (``has_local_rounds``; the periods come from the job config),
* what a participant does in a round (``pulls``: which node buffer to pull toward, how hard),
* how the servers combine (``exchange``: elect a leader and share its parameters, or aggregate
  the participants into a center with ``update_center_``).

A new algorithm (DOWNPOUR, model averaging, DiLoCo, ...) is one new module with one subclass,
registered in ``lsgd.rules.RULES``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class RoundKind(enum.IntEnum):
    """Kinds of rounds; values equal the protobuf enum ``lsgd.v1.RoundKind``."""

    LOCAL = 1
    GLOBAL = 2
    FINAL = 3


class Exchange(enum.Enum):
    """How the global server combines the participants of a global round."""

    LEADER = "leader"  # elect the best participant, share its parameters
    CENTER = "center"  # sum the participants, move a center variable


# Names of the parameter buffers in node shared memory besides the per-worker slots.
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


class Rule(ABC):
    """Base class of the training rules."""

    name: str = ""
    exchange: Exchange = Exchange.LEADER

    @property
    def node_buffers(self) -> tuple[str, ...]:
        """Node shared-memory buffers this rule needs (the final round adds leader and sum)."""
        return (GLOBAL_LEADER, SUM)

    def has_local_rounds(self, num_groups: int) -> bool:
        """Whether local (within-node) rounds happen between global ones."""
        return False

    @abstractmethod
    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        """Return ``[(buffer, strength), ...]`` applied in order to a participant, in place."""

    def update_center_(self, center: np.ndarray, total: np.ndarray, count: int) -> None:
        """Move the center given the sum of ``count`` participants (CENTER exchange only)."""
        raise NotImplementedError(f"rule {self.name} has no center")
