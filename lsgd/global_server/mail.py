"""Mail of gossip rules between nodes: held by the global server, delivered exactly once.

A gossip rule (GoSGD, ``lsgd.rules.gosgd``) moves messages ``(sum of weight * x, weight)``
between workers. Messages for a worker of another node leave their node as one merged mail
(``BUFFER_KIND_MAIL`` upload, numbered 1, 2, ... per node session); the server adds it to the
mailbox of a random other live node (the sender's own when it is alone), vector and weight
together, once the whole upload has arrived (a broken upload adds nothing; the node sends it
again under the same number, and a number already delivered is a no-op). A node downloads its
mailbox under numbers of its own: asking for delivery ``n + 1`` acknowledges ``n`` (dropped
then), asking for ``n`` again resends it, so a delivery lost on the way is never lost, and
never taken twice. The weight of all messages and workers stays what it was (``weights_held``
counts the server's part).

Memory: a node's mailbox holds at most two vectors (mail waiting, a delivery not acknowledged),
allocated while it has mail.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ..wire import aligned_empty
from .buffers import ParamError, _size

MAX_WEIGHT = 1.0 + 1e-6  # the weights of a job sum to 1: no mail may claim more


@dataclass
class _Box:
    pending: np.ndarray | None = None  # mail not delivered yet (sum of weight * x)
    pending_weight: float = 0.0
    delivering: np.ndarray | None = None  # a delivery not acknowledged yet
    delivering_weight: float = 0.0
    delivery: int = 0  # its number (0: none)
    session: int = 0


@dataclass
class _Sender:
    session: int
    posted: int = 0  # the newest mail number added to a mailbox
    busy: bool = False


@dataclass
class Mailboxes:
    """The nodes' mailboxes. Thread-safe."""

    param_count: int
    memory: object = None  # () -> bytes free, or None (the store's)
    rng: random.Random = field(default_factory=random.SystemRandom)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[int, _Box] = {}
        self._senders: dict[int, _Sender] = {}
        self.posted = 0
        self.delivered = 0

    # ------------------------------------------------------------------ uploads
    def post(self, node: int, session: int, seq: int, weight: float, live: Iterable[int],
             chunks: Iterable[tuple[int, bytes]], dtype: np.dtype) -> int | None:
        """Receive mail number ``seq`` of ``node`` and put it in a random other live node's
        mailbox. Returns that node (None: the number was posted before, nothing done)."""
        if seq < 1:
            raise ParamError("INVALID_ARGUMENT", "mail is numbered from 1 (round_id)")
        if not (0.0 < weight <= MAX_WEIGHT):
            raise ParamError("INVALID_ARGUMENT", f"mail weight must be in (0, 1], got {weight}")
        with self._lock:
            sender = self._senders.get(node)
            if sender is None or sender.session != session:
                sender = self._senders[node] = _Sender(session, seq - 1)
            if sender.busy:
                raise ParamError("ABORTED", f"node {node} is already sending mail")
            if seq <= sender.posted:
                done = True
            elif seq == sender.posted + 1:
                done, sender.busy = False, True
            else:
                raise ParamError("INVALID_ARGUMENT", f"node {node} sent mail {seq}; the next is "
                                 f"{sender.posted + 1}")
        if done:
            for _ in chunks:
                pass
            return None
        try:
            stage = self._receive(chunks, dtype)
            with self._lock:
                others = sorted(set(live) - {node})
                dest = self.rng.choice(others) if others else node
                box = self._boxes.setdefault(dest, _Box())
                if box.pending is not None:  # into the new vector: the old stays whole
                    with np.errstate(over="ignore"):  # checked just below
                        np.add(box.pending, stage, out=stage)
                    if not np.isfinite(stage).all():
                        raise ParamError("INVALID_ARGUMENT", "mail would make a mailbox "
                                         "non-finite (finite values, yet too big)")
                    weight += box.pending_weight
                box.pending, box.pending_weight = stage, weight
                sender.posted = seq
                self.posted += 1
                return dest
        finally:
            with self._lock:
                sender.busy = False

    def _receive(self, chunks: Iterable[tuple[int, bytes]], dtype: np.dtype) -> np.ndarray:
        free = self.memory() if callable(self.memory) else None
        if free is not None and 4 * self.param_count > free:
            raise ParamError("RESOURCE_EXHAUSTED", f"no memory for mail of "
                             f"{_size(4 * self.param_count)} on the global server")
        stage = aligned_empty(self.param_count, np.float32)
        size, pos = dtype.itemsize, 0
        for offset, data in chunks:
            if offset != pos or len(data) % size or pos + len(data) // size > stage.size:
                raise ParamError("INVALID_ARGUMENT", f"chunk at {offset} of {len(data)} bytes "
                                 f"does not continue at {pos} of {stage.size} elements")
            n = len(data) // size
            src = np.frombuffer(data, dtype=dtype)
            if not np.isfinite(src).all():
                raise ParamError("INVALID_ARGUMENT", "mail has non-finite values")
            np.copyto(stage[pos : pos + n], src, casting="unsafe")
            pos += n
        if pos != stage.size:
            raise ParamError("INVALID_ARGUMENT", f"mail ended at {pos} of {stage.size} elements")
        return stage

    # ------------------------------------------------------------------ downloads
    def take(self, node: int, session: int, number: int) -> tuple[np.ndarray | None, float]:
        """Delivery ``number`` of ``node``'s mailbox: (vector, weight), or (None, 0.0) when it
        has no mail. Asking for ``number`` acknowledges ``number - 1``."""
        if number < 1:
            raise ParamError("INVALID_ARGUMENT", "deliveries are numbered from 1 (round_id)")
        with self._lock:
            box = self._boxes.setdefault(node, _Box())
            if box.session != session:  # a new run of the node: numbering starts again
                box.session, box.delivery = session, 0
                if box.delivering is not None:  # never acknowledged: deliver it again
                    self._merge_back(box)
            if box.delivering is not None:
                if number == box.delivery:
                    return box.delivering, box.delivering_weight  # resent
                if number != box.delivery + 1:
                    raise ParamError("INVALID_ARGUMENT", f"node {node} asked for delivery "
                                     f"{number}; the next is {box.delivery + 1}")
                box.delivering, box.delivering_weight = None, 0.0  # acknowledged
                self.delivered += 1
            elif number < box.delivery:  # (the same number again: it carried no mail)
                raise ParamError("INVALID_ARGUMENT", f"node {node} asked for delivery {number}; "
                                 f"the next is {box.delivery + 1}")
            box.delivery = number
            if box.pending is None:
                return None, 0.0
            box.delivering, box.delivering_weight = box.pending, box.pending_weight
            box.pending, box.pending_weight = None, 0.0
            return box.delivering, box.delivering_weight

    @staticmethod
    def _merge_back(box: _Box) -> None:
        if box.pending is None:  # (a copy: a stream of the old session may still read it)
            box.pending, box.pending_weight = box.delivering.copy(), box.delivering_weight
        else:
            box.pending += box.delivering
            box.pending_weight += box.delivering_weight
        box.delivering, box.delivering_weight = None, 0.0

    def weights_held(self) -> float:
        """The weight of all mail on the server (posted, not acknowledged)."""
        with self._lock:
            return sum(b.pending_weight + b.delivering_weight for b in self._boxes.values())
