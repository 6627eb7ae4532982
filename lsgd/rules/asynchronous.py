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

and per worker, ``mine``: the vectors the rule names in ``worker_buffers`` (DOWNPOUR's
parameters at the worker's last push) and ``mine.scalars``, numbers of the rule's own kept by
the node (GoSGD's weight), both set by ``start_`` when the worker starts or starts again (a
respawned worker keeps its scalars).

A *gossip* rule (``gossip = True``: GoSGD) has no center: workers send each other messages
through the node, which offers ``post(x, weight)`` (send ``weight * x`` and ``weight`` to a
random other worker of the job: on this node at once, on another through the global server,
``lsgd/local_server/mailroom.py``) and ``mail(mine)`` / ``clear_mail(mine)`` (what a worker
received: the sum of ``weight * x`` over its messages, and their total weight).

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
INCOMING = "incoming"  # the center (or a gossip rule's mail) being downloaded
OUTMAIL = "outmail"  # gossip: mail for workers of other nodes, not sent yet
MAILSEND = "mailsend"  # gossip: the mail being sent
MAIL = "mail"  # gossip, per worker: what it received (sum of weight * x)


class Mine(dict):
    """One worker's part of the node: its ``worker_buffers`` by name, and ``scalars``."""

    def __init__(self, local: int, buffers: Mapping[str, np.ndarray], scalars: dict) -> None:
        super().__init__(buffers)
        self.local, self.scalars = local, scalars


class NodeSide(Protocol):
    """The node's buffers and services an ``AsyncRule`` works with (see the module doc)."""

    center: np.ndarray  # center rules
    outbox: np.ndarray

    def post(self, x: np.ndarray, weight: float) -> None: ...  # gossip rules

    def mail(self, mine: Mine) -> tuple[np.ndarray, float]: ...

    def clear_mail(self, mine: Mine) -> None: ...

    def bequeath(self, mine: Mine, x: np.ndarray, weight: float) -> None: ...


class AsyncRule(Rule):
    """Base class of the asynchronous rules: a center, no barrier, no rounds."""

    synchronous = False
    exchange = Exchange.CENTER
    gossip = False  # True: no center; workers send each other mail (post / mail)
    worker_buffers: tuple[str, ...] = ()  # per-worker vectors in node memory

    @property
    def node_buffers(self) -> tuple[str, ...]:
        return (CENTER, OUTBOX, SENDING, INCOMING, GLOBAL_LEADER, SUM)

    def due(self, steps: int, rng: random.Random) -> int:
        """In the worker, after each step (``steps``: its own step count): 0 when nothing is
        due, else the action to pass ``exchange_`` (a positive int of the rule's own)."""
        return 0

    def start_(self, x: np.ndarray, mine: Mine) -> None:
        """A worker starts, or starts again (respawned, reset) from ``x``: set its
        ``worker_buffers``."""

    def retire_(self, x: np.ndarray, mine: Mine, node: NodeSide) -> None:
        """Worker ``mine`` left the job for good (not restarted): hand on what the job must
        not lose with it. ``x``: its parameters (its slot; the node's newest exchanged
        parameters if those are not finite). A center rule loses nothing: the worker's
        deltas are in the outbox already."""

    @abstractmethod
    def exchange_(self, action: int, x: np.ndarray, mine: Mine, node: NodeSide) -> float:
        """On the node, for one worker, with no other exchange of the node running: change
        ``x`` (the worker's parameters, written back into its model), the node's ``center``
        and ``outbox`` in place. Returns the distance ``||x - center||`` before (NaN: none)."""

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        return []  # the only round is the final one, which moves nothing
