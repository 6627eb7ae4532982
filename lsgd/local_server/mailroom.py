"""A node's mail for a gossip rule (GoSGD): workers' mailboxes, and mail to and from other nodes.

A worker's message ``(weight * x, weight)`` goes to a worker of the job drawn at random (not
the sender): one of this node goes straight into its mailbox (``mail.<local>``, node shared
memory, and a weight the node keeps); one of another node is added to ``outmail``. The node's
sync thread (``async_node.py``) sends ``outmail`` to the global server as one mail (numbered:
a broken upload is sent again, and the server adds it once, ``global_server/mail.py``), which
hands it to a random other node, and downloads this node's own mail (numbered deliveries: the
next number acknowledges the last), which goes to a random worker of this node. Drawing the node
(by its share of the other workers) then a worker of it draws every other worker alike.

Every method but ``sync`` runs under the node's lock (held by its caller); ``sync`` takes it.
Weight is never lost or made: it is in a worker, a mailbox, ``outmail``, the mail being sent,
or on the global server (``weights``).
"""

from __future__ import annotations

import logging
import random
import threading

import grpc
import numpy as np

from ..rules.asynchronous import INCOMING, MAIL, MAILSEND, OUTMAIL, Mine
from .store import NodeStore

log = logging.getLogger(__name__)

MAX_TAKES = 8  # deliveries taken in one sync at most


class MailRoom:
    """The node's side of gossip: mailboxes, routing and the exchange with the global server."""

    def __init__(self, store: NodeStore, client, lock: threading.Lock, *, moved: int,
                 workers: int, job_workers: int, rng: random.Random | None = None) -> None:
        self.store, self.client, self.lock, self.moved = store, client, lock, moved
        self.workers, self.job_workers = workers, job_workers
        self.rng = rng or random.SystemRandom()
        self.weight = {i: 0.0 for i in range(workers)}  # of each worker's mailbox
        self.out = store.buffer(OUTMAIL)[:moved]
        self.out.fill(0.0)
        self.out_weight = 0.0
        self.sending_weight = 0.0  # the mail being sent (``owed``)
        self.sent = 0  # the newest mail number used
        self.owed = False
        self.delivery = 1  # the delivery number to ask for next
        self.received = 0  # deliveries with mail
        self.retired: set[int] = set()  # workers that left for good: no mail goes to them
        self.refused = 0  # mail the global server refused (kept on this node instead)
        for i in range(workers):
            self.box(i).fill(0.0)

    def box(self, local: int) -> np.ndarray:
        return self.store.buffer(f"{MAIL}.{local}")[:self.moved]

    # ------------------------------------------------------------------ under the node's lock
    def post(self, sender: int, x: np.ndarray, weight: float) -> None:
        """``weight * x`` for a random other worker of the job (of this node: one that
        still trains)."""
        peers = [i for i in range(self.workers) if i != sender and i not in self.retired]
        others = len(peers) + self.job_workers - self.workers
        if others < 1:
            self.weight[sender] += weight  # alone: it keeps what it would send
            return
        pick = self.rng.randrange(others)
        if pick < len(peers):  # a worker of this node
            self._give(peers[pick], np.float32(weight) * x, weight)
        else:
            self.out += np.float32(weight) * x
            self.out_weight += weight

    def _give(self, peer: int, weighted: np.ndarray, weight: float) -> None:
        self.box(peer).__iadd__(weighted)
        self.weight[peer] += weight

    def _heir(self) -> int | None:
        """A random worker of this node that still trains (None: none does)."""
        live = [i for i in range(self.workers) if i not in self.retired]
        return self.rng.choice(live) if live else None

    def bequeath(self, local: int, x: np.ndarray, weight: float) -> None:
        """Worker ``local`` left for good: its weight (with ``x``) and its mailbox go to a
        worker of this node that still trains, and no mail goes to it any more. With none
        left (the node is ending) they stay in its mailbox: counted, not lost."""
        self.retired.add(local)
        heir = self._heir()
        if heir is None:
            self.retired.discard(local)
            heir = local
        self._give(heir, np.float32(weight) * x, weight)
        if heir != local:
            self._give(heir, self.box(local), self.weight[local])
            self.box(local).fill(0.0)
            self.weight[local] = 0.0

    def mail(self, mine: Mine) -> tuple[np.ndarray, float]:
        return self.box(mine.local), self.weight[mine.local]

    def clear(self, mine: Mine) -> None:
        self.box(mine.local).fill(0.0)
        self.weight[mine.local] = 0.0

    # ------------------------------------------------------------------ sync thread
    def sync(self) -> None:
        """Send this node's mail for other nodes, then take this node's own. Raises what the
        calls raise (grpc.RpcError, ValueError); nothing is lost when one breaks."""
        if not self.owed and self.out_weight > 0:
            with self.lock:
                np.copyto(self.store.buffer(MAILSEND)[:self.moved], self.out)
                self.sending_weight, self.out_weight = self.out_weight, 0.0
                self.out.fill(0.0)
                self.sent += 1
                self.owed = True
        if self.owed:
            try:
                self.client.push_mail(self.store.buffer(MAILSEND), self.sent,
                                      self.sending_weight)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise  # out of reach, or busy: sent again
                self._keep_refused(exc.details())
            self.owed, self.sending_weight = False, 0.0
        incoming = self.store.buffer(INCOMING)
        for _ in range(MAX_TAKES):  # until the server has none: the last ask acknowledges all
            weight = self.client.pull_mail(self.delivery, incoming)
            if weight == 0:
                return
            with self.lock:
                self._give(self._heir() or 0, incoming[:self.moved], weight)
            self.delivery += 1  # asking for the next acknowledges this one
            self.received += 1

    def _keep_refused(self, why: str) -> None:
        """The server refused this mail for good (it would be refused again): a worker of this
        node takes it, so its weight stays in the job."""
        self.refused += 1
        log.error("the global server refused mail %d (%s); a worker of this node takes it "
                  "instead", self.sent, why)
        with self.lock:
            self._give(self._heir() or 0, self.store.buffer(MAILSEND)[:self.moved],
                       self.sending_weight)

    @property
    def pending(self) -> bool:
        """Mail for other nodes not sent yet."""
        return self.owed or self.out_weight > 0

    def weights(self) -> float:
        """The weight of the mail on this node (mailboxes, not sent, being sent)."""
        return sum(self.weight.values()) + self.out_weight + self.sending_weight
