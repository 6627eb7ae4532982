"""A node's side of an asynchronous rule: run each worker's exchange at once, and keep the node's
copy of the center in step with the global server from a thread of its own.

Buffers (node shared memory, ``lsgd.rules.asynchronous``): ``center`` (the node's copy),
``outbox`` (deltas not sent yet), ``sending`` (the delta in flight, kept until the server took
all of it), ``incoming`` (the center being downloaded), and the rule's per-worker vectors
(``<name>.<local index>``).

One lock covers ``center`` and ``outbox``: the node loop holds it for one worker's exchange, the
sync thread for two vector operations per sync. A sync, at most every ``sync_every`` seconds
and only after an exchange:

1. under the lock: ``sending = outbox``, ``outbox = 0`` (skipped while a delta is still owed);
2. send ``sending`` as delta number ``seq`` (a broken upload is sent again under the same
   number; the server adds only what it had not: ``global_server/deltas.py``);
3. download the center into ``incoming``;
4. under the lock: ``center = incoming + outbox`` (the deltas made meanwhile).

Nothing a worker adds is lost or added twice: it is in ``outbox``, in ``sending``, or in the
server's center. While the server is out of reach the deltas wait in ``outbox``, and the
workers go on exchanging with the node's copy.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import grpc
import numpy as np

from ..rules import ops
from ..rules.asynchronous import INCOMING, OUTBOX, SENDING, AsyncRule, Mine
from ..rules.base import CENTER, GLOBAL_LEADER
from .mailroom import MailRoom
from .store import NodeStore

log = logging.getLogger(__name__)

RETRY = 0.5  # seconds between attempts while the global server is out of reach


def buffer_names(rule: AsyncRule, workers: int) -> tuple[str, ...]:
    """Every node buffer of an asynchronous rule: the node's and each worker's own."""
    return tuple(rule.node_buffers) + tuple(f"{name}.{i}" for i in range(workers)
                                            for name in rule.worker_buffers)


class AsyncNode:
    """The node's part of an ``AsyncRule``."""

    def __init__(self, rule: AsyncRule, store: NodeStore, client, *, moved: int,
                 sync_every: float, wire: str = "float32", job_workers: int = 1) -> None:
        self.rule, self.store, self.client = rule, store, client
        self.moved = moved  # leading entries that exchanges move (the statistics tail is not)
        self.sync_every, self.wire = sync_every, wire
        self.lock = threading.Lock()
        has = set(store.layout.buffers)
        self.center = store.buffer(CENTER)[:moved] if CENTER in has else None
        self.outbox = store.buffer(OUTBOX)[:moved] if OUTBOX in has else None
        if self.outbox is not None:
            self.outbox.fill(0.0)
            store.buffer(SENDING).fill(0.0)
        self.scalars: dict[int, dict] = {i: {} for i in range(store.layout.slots)}
        self.mailroom = (MailRoom(store, client, self.lock, moved=moved,
                                  workers=store.layout.slots, job_workers=job_workers)
                         if rule.gossip else None)
        # No center (gossip): the newest parameters that passed an exchange on this node, kept
        # in the node's global_leader buffer (the initial model at first; the final round's
        # leader at the end). Not a worker's slot: the worker rewrites it for its next exchange,
        # maybe with the very non-finite values a reset must replace.
        self.latest = (store.buffer(GLOBAL_LEADER)[:moved] if self.center is None
                       and GLOBAL_LEADER in has else None)
        self.seq = 0  # the newest delta number used
        self.owed = False  # ``sending`` holds a delta the server has not taken whole
        self.closed = False  # after the last sync: exchanges move nothing
        self.exchanges = 0
        self.syncs = 0
        self.failures = 0
        self.rule_failures = 0  # exchanges the rule raised in
        self.refused = 0  # center deltas the global server refused for good (dropped)
        self.retired: set[int] = set()  # workers that left for good
        self._syncing = threading.Lock()  # one sync at a time: the thread's or flush's
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ node loop
    def mine(self, local: int) -> Mine:
        return Mine(local, {name: self.store.buffer(f"{name}.{local}")[:self.moved]
                            for name in self.rule.worker_buffers}, self.scalars[local])

    # NodeSide of a gossip rule (called by the rule, under the lock)
    def post(self, x: np.ndarray, weight: float) -> None:
        self.mailroom.post(self._current, x, weight)

    def mail(self, mine: Mine) -> tuple[np.ndarray, float]:
        return self.mailroom.mail(mine)

    def clear_mail(self, mine: Mine) -> None:
        self.mailroom.clear(mine)

    def bequeath(self, mine: Mine, x: np.ndarray, weight: float) -> None:
        self.mailroom.bequeath(mine.local, x, weight)

    def start_worker(self, local: int) -> None:
        """Worker ``local`` starts (again) from its slot."""
        with self.lock:
            self.rule.start_(self.store.slot(local)[:self.moved], self.mine(local))

    def restart_worker(self, local: int) -> None:
        """Worker ``local`` starts again (respawned) from the node's copy of the center; with
        no center (gossip), from its slot: its parameters at its last exchange (the node's
        newest exchanged ones if it died having written non-finite values there)."""
        x = self.store.slot(local)[:self.moved]
        with self.lock:
            if self.center is not None or not ops.all_finite(x):
                ops.copy_(x, self._fallback())
            self.rule.start_(x, self.mine(local))

    def retire_worker(self, local: int) -> None:
        """Worker ``local`` left the job for good (not restarted): the rule hands on what it
        held (``AsyncRule.retire_``), once."""
        with self.lock:
            if local in self.retired or self.closed:
                return
            self.retired.add(local)
            x = self.store.slot(local)[:self.moved]
            self.rule.retire_(x if ops.all_finite(x) else self._fallback(), self.mine(local),
                              self)
        self._dirty.set()

    def _fallback(self) -> np.ndarray:
        """What a diverged worker is reset to: the center; with none, the newest parameters
        that passed an exchange on this node (else the initial model)."""
        return self.center if self.center is not None else self.latest

    def exchange(self, local: int, action: int, healthy: bool) -> tuple[bool, float, bool]:
        """Run one exchange of worker ``local`` on its slot. Returns (slot changed, distance,
        reset). A worker whose parameters or losses are not finite is reset to the center."""
        x = self.store.slot(local)[:self.moved]
        with self.lock:
            if self.closed:
                return False, math.nan, False
            if not healthy:
                ops.copy_(x, self._fallback())
                self.rule.start_(x, self.mine(local))
                return True, math.nan, True
            self._current = local
            try:
                distance = self.rule.exchange_(action, x, self.mine(local), self)
            except Exception as exc:  # noqa: BLE001 - a rule's bug must not end the node
                self.rule_failures += 1
                log.log(logging.ERROR if self.rule_failures in (1, 10, 100) else logging.DEBUG,
                        "rule %s failed in an exchange of worker %d (%d so far); the worker "
                        "starts again from %s: %s: %s", self.rule.name, local,
                        self.rule_failures, "the center" if self.center is not None
                        else "the node's newest exchanged parameters", type(exc).__name__, exc)
                ops.copy_(x, self._fallback())
                self.rule.start_(x, self.mine(local))
                return True, math.nan, True
            self.exchanges += 1
            if self.latest is not None:
                ops.copy_(self.latest, x)
        self._dirty.set()
        return True, float(distance), False

    # ------------------------------------------------------------------ sync thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lsgd-async-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # Gossip: mail from other nodes comes whether or not this node's workers exchange.
            if not self._dirty.wait(0.5) and self.mailroom is None:
                continue
            self._dirty.clear()
            start = time.monotonic()
            if not self.sync():
                self._dirty.set()  # try again
                self._stop.wait(RETRY)
            self._stop.wait(max(0.0, self.sync_every - (time.monotonic() - start)))

    def sync(self) -> bool:
        """Send the node's deltas and fetch the center (gossip: send and take mail). Returns
        whether it all went through."""
        try:
            with self._syncing:
                if self.mailroom is not None:
                    self.mailroom.sync()
                else:
                    self._sync_center()
        except (grpc.RpcError, ValueError) as exc:
            self.failures += 1
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            log.log(logging.WARNING if self.failures in (1, 10, 100) else logging.DEBUG,
                    "exchange with the global server failed (%d so far; nothing is lost, it "
                    "waits on the node): %s", self.failures, details)
            return False
        self.syncs += 1
        return True

    @property
    def pending(self) -> bool:
        """Something of this node has not reached the global server yet."""
        if self.mailroom is not None:
            return self.mailroom.pending
        return self.owed or bool(np.any(self.outbox))

    def _sync_center(self) -> None:
        if not self.owed:
            with self.lock:
                ops.copy_(self.store.buffer(SENDING)[:self.moved], self.outbox)
                self.outbox.fill(0.0)
                self.seq += 1
                self.owed = True
        try:
            self.client.push("center_delta", self.store.buffer(SENDING), self.seq,
                             wire="float32")
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise  # out of reach, or busy: sent again under the same number
            self.refused += 1  # it would be refused again: the next delta goes on
            log.error("the global server refused center delta %d (%s); it is dropped (the "
                      "center may hold a part of it)", self.seq, exc.details())
        self.owed = False
        self.client.pull(CENTER, self.store.buffer(INCOMING), 0, wire=self.wire)
        with self.lock:
            incoming = self.store.buffer(INCOMING)[:self.moved]
            np.add(incoming, self.outbox, out=self.center)

    def stop(self) -> None:
        """Stop the sync thread (what it has not sent stays unsent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def flush(self, timeout: float) -> bool:
        """The job ends: stop the thread, send what is left, and move nothing more. No sync
        starts after ``timeout`` s, and none runs beside the thread's (a sync already in
        flight ends within its calls' deadlines). Returns whether every delta (gossip: every
        mail) reached the global server."""
        end = time.monotonic() + timeout
        self._stop.set()
        with self.lock:
            self.closed = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in a call to the server: never beside it
                log.warning("the node's last center deltas did not reach the global server "
                            "within %g s (a sync still waits for it)", timeout)
                return False
        take = self.mailroom is not None  # gossip: take this node's mail once more, too
        while take or self.pending:
            if time.monotonic() >= end:
                log.warning("the node's last center deltas did not reach the global server "
                            "within %g s", timeout)
                return False
            if self.sync():
                take = False
            else:
                time.sleep(min(RETRY, max(0.0, end - time.monotonic())))
        return True

    def stats(self) -> dict:
        out = {"exchanges": self.exchanges, "syncs": self.syncs, "sync_failures": self.failures,
               "rule_failures": self.rule_failures}
        if self.mailroom is None:
            return out | {"deltas_sent": self.seq - int(self.owed), "deltas_refused": self.refused}
        room = self.mailroom
        return out | {"mail_sent": room.sent - int(room.owed), "mail_received": room.received,
                      "mail_refused": room.refused,
                      "weights": {i: s.get("weight") for i, s in self.scalars.items()},
                      "mail_weight": room.weights()}
