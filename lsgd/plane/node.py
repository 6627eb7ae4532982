"""A node's side of the parameter plane (PLANE=chain, docs/design-scale.md): its data listener,
and the broadcast of a round's leader along the route the global server planned.

- The node listens on a plain TCP socket (``DataPlane.address``, told to the server at Join).
- At a global round the server's answer carries the route. ``begin`` registers it. A member
  receives the leader into its staging buffer (``stage``) and forwards every chunk to its
  children as it arrives. The source sends from its own buffer (``send``).
- ``receive`` returns the staging buffer once every element has arrived, never before: nothing
  partial is applied.
- A send that breaks or stalls asks the server for a **bypass** (``bypass`` callback, the
  ``Bypass`` RPC). The stalled member's children become the caller's, and each resumes at the
  offset it already holds.
- Every wait ends at the transfer's deadline (the round's timeout); a member that got nothing
  by then skips its pull this round, as a failed download from the server is skipped.

Threads: one accepting connections, one per incoming connection (at most ``MAX_CONNECTIONS``),
one per child being sent to. They share one condition, which also guards the receptions.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..wire import aligned_empty
from .route import Kind, Reception, Route, RouteError
from .wire import (AUTH_WAIT, Header, TransferError, Unanswered, as_bytes, receive_vector,
                   send_vector)

log = logging.getLogger("lsgd.plane")

CHUNK = 1 << 16  # elements per chunk at least (256 KiB of float32)
MAX_ROUTE_CHUNK = 1 << 18  # and at most (1 MiB): see chunk_for
STALL = 3.0  # seconds a receiver may take nothing before its sender asks for a bypass
RECEIVE_STALL = 10.0  # seconds without a chunk after which a member stops waiting on its route
ADMIT_WAIT = 5.0  # seconds an incoming transfer waits for this node to learn its round's route
MAX_CONNECTIONS = 32  # incoming connections at once (one that does not authenticate within
# AUTH_WAIT is dropped); more are closed at once, and their senders try again for a while


def chunk_for(count: int, depth: int) -> int:
    """Elements per chunk on a route ``depth`` hops deep, for a vector of ``count`` elements.

    A pipeline of ``k`` hops takes about ``k - 1`` chunks' time beyond one transfer (its fill),
    and each chunk costs its system calls, its MAC and a wake-up: with small chunks those,
    not the link, set the pace on a fast link (256 KiB chunks moved 100 MB over loopback at
    0.64-0.74x a plain socket's speed, 1 MiB chunks at 1.06-1.13x). So a chunk is as large as
    keeps the fill under an eighth of the transfer, between ``CHUNK`` and
    ``MAX_ROUTE_CHUNK``. ``count`` 0 (unknown): ``CHUNK``."""
    if count <= 0:
        return CHUNK
    fill = count // (8 * max(1, depth - 1)) // 4096 * 4096
    return max(CHUNK, min(MAX_ROUTE_CHUNK, fill))


@dataclass(frozen=True)
class RouteInfo:
    """One round's route as the nodes get it: the tree, the members' addresses, who feeds the
    global server, and the chunk size."""

    round_id: int
    route: Route
    addresses: dict[int, str]
    feeds_server: int
    chunk: int = CHUNK
    total_summands: int = 0  # a reduce: what the total it brings the server sums up
    total_weight: float = 0.0

    @property
    def reduce(self) -> bool:
        return self.route.kind == Kind.REDUCE

    def ancestors(self, node: int) -> list[int]:
        """The members above ``node``, nearest first (any may send to it after bypasses)."""
        out, at = [], node
        while at in self.route.parent:
            at = self.route.parent[at]
            out.append(at)
        return out


class Transfer:
    """One round's broadcast as this node sees it."""

    def __init__(self, info: RouteInfo, count: int, deadline: float) -> None:
        self.info = info
        self.reception = Reception(count)
        self.deadline = deadline
        self.progress_at = time.monotonic()  # when the last chunk (or the route) arrived
        self.failed: str | None = None
        self.served: set[int] = set()  # children a sender thread was started for
        self.aborted = False  # a reduce that failed here was reported to the server
        self.threads: list[threading.Thread] = []
        self.results: dict[int, bool] = {}  # child -> whether it got the whole vector
        self.sockets: set[socket.socket] = set()  # this transfer's connections to its children

    def fail(self, why: str) -> None:
        """Take nothing more, and end the sends to the children now: a sender waiting on a
        child that went silent would otherwise wait out the round's deadline (the caller holds
        the plane's lock and notifies)."""
        self.failed = self.failed or why
        self.reception.close(self.failed)
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class DataPlane:
    """A node's data listener and its part of each round's broadcast."""

    def __init__(self, *, job_id: str, index: int, count: int, secret: str | None, host: str,
                 timeout: float,
                 bypass: Callable[[int, int, int, str, bool], RouteInfo], port: int = 0) -> None:
        self.job_id, self.index, self.count = job_id, index, count
        self.secret = secret.encode() if secret else None
        self.timeout = timeout  # a transfer's whole deadline
        self.bypass = bypass  # (round, epoch, stalled, why, reduce) -> the new route; raises
        self.stage = aligned_empty(count, np.float32)
        self.stage.fill(0.0)  # its pages are faulted in now, not during the first transfer
        self.cond = threading.Condition()
        self.current: Transfer | None = None
        self.connections = 0
        self.closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)
        self.sock.settimeout(0.5)
        port = self.sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # transfers: received whole, sent whole to a child, bypasses asked, receptions failed,
        # and receptions resumed from a new sender after a bypass
        self.stats = {"received": 0, "sent": 0, "bypasses": 0, "failed": 0, "resumed": 0}
        self._acceptor = threading.Thread(target=self._accept, name="lsgd-data", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ the node loop's side
    def begin(self, info: RouteInfo, own: np.ndarray | None = None) -> None:
        """Take part in round ``info.round_id``'s transfer. Broadcast: a member starts
        forwarding to its children as soon as chunks arrive. Reduce: ``own`` is this node's
        sum; the staging buffer starts from it, incoming partial sums are added to it chunk by
        chunk, and each chunk goes on toward the route's end once added (a member with nothing
        upstream sends its own at once). Waits (bounded) for the last round's senders, which
        read the staging buffer."""
        self._finish_previous()
        t = Transfer(info, self.count, time.monotonic() + self.timeout)
        if info.reduce:
            assert own is not None and own.size == self.count
            np.copyto(self.stage, own)
        with self.cond:
            self.current = t
            self.cond.notify_all()
        ready = self._ready(t) if info.route.upstream(self.index) else None
        if info.reduce or self.index != info.route.root:
            for child in info.route.downstream(self.index):
                self._start_sender(t, child, as_bytes(self.stage), ready=ready)

    def reduce(self) -> np.ndarray | None:
        """A reduce: wait until this node's part is done (its partial sum sent on; at the
        route's end, the total received). Returns the staging buffer (at the end: the total)
        or None when the reduce failed: the server was told, and skips the round's exchange."""
        t = self.current
        assert t is not None and t.info.reduce
        if t.info.route.upstream(self.index) and self.receive() is None:
            self._abort(t, "no whole partial sum arrived")
            return None
        if not t.info.route.downstream(self.index):
            return self.stage
        if self._join(t):
            return self.stage
        self._abort(t, "the partial sum could not be sent on")
        return None

    def send(self, vec: np.ndarray) -> bool:
        """The source: send ``vec`` (whole) to the route's first members and wait for them.
        True when every child, or the children of a bypassed one, got it."""
        t = self.current
        assert t is not None and t.info.route.root == self.index
        data = as_bytes(vec)
        for child in t.info.route.downstream(self.index):
            self._start_sender(t, child, data, ready=None)
        return self._join(t)

    def receive(self) -> np.ndarray | None:
        """The staging buffer once the whole leader has arrived; None at the deadline, after
        ``RECEIVE_STALL`` seconds without a chunk (a member above hung after its own sender was
        done: nobody would bypass it), or when the transfer failed. The caller copies it out;
        it stays untouched until the next ``begin``. Once None is returned the transfer takes
        nothing more, and this node's children stop too (they fall back in turn)."""
        t = self.current
        assert t is not None
        with self.cond:
            while not (t.reception.complete or t.failed is not None or self.closed):
                now = time.monotonic()
                if now >= t.deadline:
                    t.failed = "no complete leader arrived before the round's deadline"
                elif now - t.progress_at >= RECEIVE_STALL:
                    t.failed = (f"nothing arrived for {RECEIVE_STALL:g} s (element "
                                f"{t.reception.offset} of {self.count})")
                else:
                    self.cond.wait(min(t.deadline, t.progress_at + RECEIVE_STALL) - now)
            if t.reception.complete:
                self.stats["received"] += 1
                return self.stage
            t.fail("the node is shutting down")
            self.stats["failed"] += 1
            self.cond.notify_all()
        log.warning("round %d: %s (route epoch %d)", t.info.round_id, t.failed, t.info.route.epoch)
        return None

    def reduce_aborted(self, round_id: int) -> None:
        """The global server aborted round ``round_id``'s reduce (a member could not go on; a
        heartbeat's answer says so): a member still waiting on it stops now, not after
        ``RECEIVE_STALL`` seconds without a chunk (one that died before it ever connected
        sent none that could break)."""
        with self.cond:
            t = self.current
            if (t is not None and t.info.reduce and t.info.round_id == round_id
                    and t.failed is None):  # (a member holding its whole sum stops sending too)
                t.aborted = True  # the server knows: nothing to tell it
                t.fail(f"the global server aborted round {round_id}'s reduce")
                self.cond.notify_all()

    def stop(self, why: str) -> None:
        """End this node's part of the transfer in progress (the job stopped): a wait on it
        returns at once, as if it had failed, and its senders stop."""
        with self.cond:
            t = self.current
            if t is not None and t.failed is None:
                t.fail(why)
            self.cond.notify_all()

    @property
    def feeds_server(self) -> int | None:
        """The member that uploads this round's leader to the server (a bypass may change it)."""
        return None if self.current is None else self.current.info.feeds_server

    def close(self) -> None:
        with self.cond:
            self.closed = True
            if self.current is not None:
                self.current.fail("the node is shutting down")
            self.cond.notify_all()
        self.sock.close()
        self._acceptor.join(2.0)

    # ------------------------------------------------------------------ sending
    def _ready(self, t: Transfer) -> Callable[[int], int]:
        def chunk_ready(end: int) -> int:
            with self.cond:
                self.cond.wait_for(lambda: t.reception.offset >= end or t.failed is not None
                                   or self.current is not t,
                                   timeout=max(0.0, t.deadline - time.monotonic()))
                if t.failed is not None or self.current is not t:
                    raise TransferError(t.failed or "a newer round began")
                if t.reception.offset < end:
                    raise TransferError("nothing more arrived before the deadline")
                return t.reception.offset
        return chunk_ready

    def _start_sender(self, t: Transfer, child: int, data: memoryview,
                      ready: Callable[[int], int] | None) -> None:
        with self.cond:
            if child in t.served:
                return
            t.served.add(child)
        th = threading.Thread(target=self._send_to, args=(t, child, data, ready),
                              name=f"lsgd-data-to-{child}", daemon=True)
        t.threads.append(th)
        th.start()

    def _send_to(self, t: Transfer, child: int, data: memoryview,
                 ready: Callable[[int], int] | None) -> None:
        """Send to ``child``; when that breaks, have the server bypass it and send to its
        children instead (each resumes where it stopped)."""
        ok = False
        knocked = time.monotonic()
        while True:
            info = t.info
            try:
                self._send_once(t, info, child, data, ready)
                ok = True
                break
            except Unanswered as exc:  # its listener is full: try again before giving up on it
                why = str(exc)
                if (time.monotonic() - knocked < AUTH_WAIT + 1.0 and not self.closed
                        and t.failed is None):
                    time.sleep(0.1)
                    continue
            except (TransferError, OSError) as exc:
                why = str(exc)
            if info.reduce:  # no bypass: the server skips the exchange
                self._abort(t, f"sending to node {child} failed: {why}", child)
                break
            if time.monotonic() >= t.deadline or t.failed is not None or self.closed:
                log.warning("round %d: sending the leader to node %d failed: %s",
                            info.round_id, child, why)
                break
            try:
                new = self.bypass(info.round_id, info.route.epoch, child, why, False)
            except Exception as exc:  # noqa: BLE001 - refused, or the server is away
                log.warning("round %d: sending the leader to node %d failed (%s), and the "
                            "global server did not bypass it: %s", info.round_id, child, why, exc)
                break
            log.warning("round %d: node %d bypassed (%s); route epoch %d", info.round_id, child,
                        why, new.route.epoch)
            with self.cond:
                self.stats["bypasses"] += 1
                if new.route.epoch > t.info.route.epoch:
                    t.info = new
            try:
                heirs = [n for n in new.route.downstream(self.index) if n not in t.served]
            except RouteError:  # this node was bypassed itself meanwhile: its part is over
                break
            if not heirs:  # it was a leaf: nothing left to send
                ok = True
                break
            child = heirs[0]
            with self.cond:
                t.served.add(child)
            for other in heirs[1:]:
                self._start_sender(t, other, data, ready)
        with self.cond:
            t.results[child] = ok
            if ok:
                self.stats["sent"] += 1

    def _send_once(self, t: Transfer, info: RouteInfo, child: int, data: memoryview,
                   ready: Callable[[int], int] | None) -> None:
        host, _, port = info.addresses[child].rpartition(":")
        left = t.deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the round's deadline passed")
        header = Header(self.job_id, info.round_id, info.route.epoch, int(info.reduce), 0,
                        self.index, child, self.count, info.chunk)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(STALL, left)) as s:
            with self.cond:
                if t.failed is not None:
                    raise TransferError(t.failed)
                t.sockets.add(s)
            try:
                send_vector(s, header, data, self.secret, timeout=left, chunk_ready=ready,
                            stall=STALL)
            finally:
                with self.cond:
                    t.sockets.discard(s)

    def _join(self, t: Transfer) -> bool:
        """Wait for every sender of ``t``, those a bypass starts meanwhile too (bounded by its
        deadline). True when each child got the whole vector."""
        end = t.deadline + 1.0
        while True:
            with self.cond:
                running = [th for th in t.threads if th.is_alive()]
            if not running or time.monotonic() >= end:
                break
            for th in running:
                th.join(max(0.0, end - time.monotonic()))
        with self.cond:
            return all(t.results.values()) and len(t.results) >= len(
                [th for th in t.threads])  # every sender told its outcome

    def _abort(self, t: Transfer, why: str, stalled: int | None = None) -> None:
        """A reduce failed here: stop every part of it on this node (which breaks the
        neighbours' connections in turn) and tell the server once, which skips the exchange."""
        with self.cond:
            t.fail(why)
            self.cond.notify_all()
            if t.aborted:
                return
            t.aborted = True
        if stalled is None:
            near = t.info.route.upstream(self.index) or t.info.route.downstream(self.index)
            stalled = near[0] if near else self.index
        log.warning("round %d: the reduce of the sums failed here (%s)", t.info.round_id, why)
        try:
            self.bypass(t.info.round_id, 0, stalled, why, True)
        except Exception as exc:  # noqa: BLE001 - the answer is the abort itself
            log.debug("round %d: abort answered: %s", t.info.round_id, exc)

    def _finish_previous(self) -> None:
        """The last round's senders finish (at its deadline at the latest) before the staging
        buffer is written again."""
        t = self.current
        if t is None:
            return
        self._join(t)
        with self.cond:
            t.fail("a newer round began")  # a connection of that round still open writes nothing
            self.cond.notify_all()

    # ------------------------------------------------------------------ receiving
    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with self.cond:
                busy = self.connections >= MAX_CONNECTIONS
                if not busy:
                    self.connections += 1
            if busy:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="lsgd-data-in",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer = conn.getpeername()[0]
            fed: list[Transfer] = []  # the transfer this connection was admitted to
            receive_vector(conn, None, None, self.secret, ADMIT_WAIT + self.timeout,
                           admit=lambda h: self._admit(h, peer, fed), on_chunk=self._arrived,
                           lock=self.cond, add=lambda h: bool(fed) and fed[0].info.reduce)
        except TransferError as exc:
            log.debug("an incoming transfer ended: %s", exc)
            if fed and fed[0].info.reduce and not fed[0].reception.complete:
                self._abort(fed[0], f"the partial sum from upstream broke: {exc}")
        except OSError as exc:
            log.debug("an incoming connection broke: %s", exc)
        finally:
            conn.close()
            with self.cond:
                self.connections -= 1
                self.cond.notify_all()

    def _arrived(self, at: int, n: int) -> None:  # a chunk was taken (the lock is held)
        if self.current is not None:
            self.current.progress_at = time.monotonic()
        self.cond.notify_all()

    def _admit(self, h: Header, peer: str,
               fed: list[Transfer]) -> "str | tuple[memoryview, Reception]":
        """Which reception an incoming transfer feeds, or why it is refused. The sender must be
        a member above this node, connecting from the host it announced, at a route epoch at
        which it can be this node's parent (each bypass moves a parent up by one)."""
        if h.job != self.job_id or h.receiver != self.index or h.kind not in (0, 1) or h.wire != 0:
            return (f"a transfer for job {h.job!r}, node {h.receiver}, kind {h.kind}, wire "
                    f"{h.wire}; this is job {self.job_id!r}, node {self.index} (float32 only)")
        with self.cond:
            def known() -> bool:  # this round's transfer of that kind, or a later round
                c = self.current
                return c is not None and (c.info.round_id > h.round_id or (
                    c.info.round_id == h.round_id and c.info.reduce == bool(h.kind)))

            self.cond.wait_for(lambda: self.closed or known(), timeout=ADMIT_WAIT)
            t = self.current
            if t is None or t.info.round_id != h.round_id or t.failed is not None:
                return f"this node is not on a route of round {h.round_id} now"
            if t.info.reduce != bool(h.kind):
                return f"round {h.round_id}'s route is {t.info.route.kind.value}, not kind {h.kind}"
            above = ([] if t.info.reduce else t.info.ancestors(self.index))
            if t.info.reduce and h.sender in t.info.route.upstream(self.index) and h.epoch == 0:
                pass  # a reduce has no bypass: only the member below, at epoch 0
            elif (h.sender not in above or h.epoch < above.index(h.sender)
                    or h.epoch > len(t.info.route.members)):
                return (f"node {h.sender} (route epoch {h.epoch}) does not send to node "
                        f"{self.index} in round {h.round_id}")
            host = t.info.addresses[h.sender].rpartition(":")[0].strip("[]")
            if not _same_host(host, peer):
                return f"node {h.sender} announced {host}, not {peer}"
            fed.append(t)
            if t.reception.offset and h.epoch > t.reception.epoch:
                self.stats["resumed"] += 1
                log.info("round %d: node %d goes on sending the leader from element %d (route "
                         "epoch %d)", h.round_id, h.sender, t.reception.offset, h.epoch)
            return memoryview(self.stage).cast("B"), t.reception


def _same_host(a: str, b: str) -> bool:
    import ipaddress

    try:
        ia, ib = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    ia = getattr(ia, "ipv4_mapped", None) or ia
    ib = getattr(ib, "ipv4_mapped", None) or ib
    return ia == ib
