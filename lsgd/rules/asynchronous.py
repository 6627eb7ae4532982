"""Rules without a barrier: every worker exchanges with the center on its own clock.

A synchronous rule (``Rule``) runs in rounds that every node joins. An ``AsyncRule`` has no
rounds but the final one: after each of its steps a worker asks the rule whether it is due for
an exchange (``due``, in the worker process, so that a step that is not due costs a call); when
it is, the worker publishes its parameters in its slot and its local server runs
``exchange_`` on them at once, one worker at a time, against the node's buffers. Nobody waits
for anybody else.

What a node offers the rule (``NodeSide``):

* ``center``: the node's copy of the job's center: the center the node last downloaded, plus
  every delta this node's workers added since. A rule reads it and moves it.
* ``outbox``: what this node's workers added to the center since the node last sent it. A rule
  that moves ``center`` by ``d`` adds the same ``d`` to ``outbox``; the node sends it to the
  global server (``BUFFER_KIND_CENTER_DELTA``), which adds it to the center chunk by chunk,
  exactly once, and downloads the center again (``lsgd/local_server/async_node.py``).

and per worker, the vectors the rule names in ``worker_buffers`` (DOWNPOUR's parameters at the
worker's last push), set by ``start_`` when the worker starts or starts again.

Staleness: workers of one node see each other's deltas at once; deltas of other nodes arrive
with the node's next download of the center (every ``SYNC_EVERY`` seconds at most, default
0.05, while its workers exchange).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from typing import Mapping, Protocol

import numpy as np

from .base import CENTER, GLOBAL_LEADER, SUM, Exchange, RoundKind, RoundRoles, Rule

OUTBOX = "outbox"  # this node's deltas to the center, not sent yet
SENDING = "sending"  # the deltas being sent (kept until the server took them all)
INCOMING = "incoming"  # the center being downloaded


class NodeSide(Protocol):
    """The node's buffers an ``AsyncRule`` works on (see the module doc)."""

    center: np.ndarray
    outbox: np.ndarray


class AsyncRule(Rule):
    """Base class of the asynchronous rules: a center, no barrier, no rounds."""

    synchronous = False
    exchange = Exchange.CENTER
    worker_buffers: tuple[str, ...] = ()  # per-worker vectors in node memory

    @property
    def node_buffers(self) -> tuple[str, ...]:
        return (CENTER, OUTBOX, SENDING, INCOMING, GLOBAL_LEADER, SUM)

    def due(self, steps: int, rng: random.Random) -> int:
        """In the worker, after each step (``steps``: its own step count): 0 when nothing is
        due, else the action to pass ``exchange_`` (a positive int of the rule's own)."""
        return 0

    def start_(self, x: np.ndarray, mine: Mapping[str, np.ndarray]) -> None:
        """A worker starts, or starts again (respawned, reset) from ``x``: set its
        ``worker_buffers``."""

    @abstractmethod
    def exchange_(self, action: int, x: np.ndarray, mine: Mapping[str, np.ndarray],
                  node: NodeSide) -> float:
        """On the node, for one worker, with no other exchange of the node running: change
        ``x`` (the worker's parameters, written back into its model), the node's ``center``
        and ``outbox`` in place. Returns the distance ``||x - center||`` before (NaN: none)."""

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return []  # the only round is the final one, which moves nothing
