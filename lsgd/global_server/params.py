"""Parameter buffers held by the global server and the exchange of one round.

The global leader, the EASGD center and the running sum of node uploads live here as flat
float32 vectors. Uploads and downloads are streams of raw chunks (never one huge message); sums
are accumulated chunk by chunk in place, so the server's memory is a fixed 3x the model size.

An *exchange* belongs to one global or final round: it knows which uploads it expects (the
leader's node, or every reporting node's sum), and settles when they have all arrived, one
failed, or its deadline passed. Downloads for that round wait until it settles.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

from ..wire import aligned_empty, steady_heap, wire_dtype
from ..rules import ops
from ..rules.base import MAX_WEIGHT, MIN_WEIGHT, RoundKind, Rule, Exchange as ExchangeKind
from .buffers import AVERAGE, CENTER, HELD, LEADER, SUM, ParamError, _size, available_memory
from .deltas import DeltaLedger, DeltaMixin
from .digests import LeaderDigests
from .mail import Mailboxes
from .saves import SavedParams

if TYPE_CHECKING:
    from ..plane.node import RouteInfo

log = logging.getLogger(__name__)


@dataclass
class Exchange:
    round_id: int
    kind: RoundKind
    expected: set[tuple[int, str]]  # (node, buffer) uploads not started yet
    deadline: float
    in_flight: set[tuple[int, str]] = field(default_factory=set)  # uploads being received
    leader_ok: bool = False
    summands: int = 0
    weight: float = 0.0  # of the summands (their count, for an unweighted rule)
    center_ok: bool = True  # the center of this round is the rule's update (CENTER rules)
    participants: dict[int, int] = field(default_factory=dict)  # node -> reported in the round
    average: bool = False  # the sums make an average (final and evaluation rounds)
    sums_ok: bool = True
    reduce: "RouteInfo | None" = None  # PLANE=chain: the sums come as one total (begin)
    leader_route: bool = False  # PLANE=chain: the leader comes down a route (needs its digest)
    settled: bool = False
    failed: list[str] = field(default_factory=list)


class ParamStore(DeltaMixin, SavedParams):
    """The global server's parameter buffers. Thread-safe."""

    def __init__(self, rule: Rule, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule
        self.clock = clock
        self.param_count: int | None = None
        self.buffers: dict[str, np.ndarray] = {}
        self.state: dict[str, np.ndarray] = {}  # the rule's ``server_state`` vectors
        self.rule_failures = 0  # rounds whose Rule.update_ failed (see _update_center)
        self.center_ready = False
        self._seeding = False
        self.exchange: Exchange | None = None
        # Writes to the leader and the center bump their version before and after (odd: being
        # written), so a download outside a round (round 0: a node joining a running job)
        # can tell that it read one consistent vector.
        self.versions = {LEADER: 0, CENTER: 0}
        self.leader_complete = False  # the leader buffer holds a whole uploaded leader
        # a round's leader, encoded once for every node's download of it (pull_whole): by
        # wire format, (the round's exchange, (round, leader version), bytes)
        self._whole: "dict[str, tuple[Exchange, tuple[int, int], bytes]]" = {}
        self._last_saved: int | None = None  # versions at the last save
        self._cond = threading.Condition()
        self.memory = available_memory  # bytes free for new buffers (tests replace it)
        self.deltas = DeltaLedger()  # asynchronous rules' center deltas (deltas.py)
        self.mail: Mailboxes | None = None  # gossip rules' mail between nodes (mail.py)
        self.digests = LeaderDigests()  # PLANE=chain: each round's leader, as its source sent it
        # Called (lock held, any thread) whenever a download may have become ready or never
        # will: the session server wakes the downloads it holds on its loop (aio_session.py).
        self.on_change: Callable[[], None] | None = None
        self._leader_uploaders: frozenset[int] = frozenset()  # the newest exchange's (uploaders)

    def _changed(self, news: bool = True) -> None:
        """Wake whatever waits on this store's state (lock held); ``news``: a download may
        have become ready, or never will (the session server's waiters hear only of that)."""
        self._cond.notify_all()
        hook = self.on_change  # read once: the session server may drop it meanwhile
        if news and hook is not None:
            hook()

    def check_param_count(self, count: int) -> None:
        """Raise ParamError unless a node with ``count`` parameters may join."""
        if count < 1:
            raise ParamError("INVALID_ARGUMENT", f"param_count must be >= 1, got {count}")
        if self.param_count is not None and count != self.param_count:
            raise ParamError("FAILED_PRECONDITION",
                             f"this node's model has {count} parameters but the job's has "
                             f"{self.param_count}; every node must run the same model")
        if self.param_count is None:
            vectors = len(HELD) + len(self.rule.server_state)
            needed, free = vectors * 4 * count, self.memory()
            if free is not None and needed > free:
                raise ParamError("RESOURCE_EXHAUSTED",
                                 f"a model of {count} parameters needs {_size(needed)} of memory "
                                 f"on the global server (node 0) for its {vectors} buffers; "
                                 f"{_size(free)} is available")

    def reserve(self, count: int) -> dict[str, np.ndarray] | None:
        """The buffers of a model of ``count`` parameters, allocated but not installed (None
        when the size is fixed already), or ParamError; changes nothing."""
        with self._cond:
            self.check_param_count(count)
            if self.param_count is not None:
                return None
        try:
            return {name: np.zeros(count, dtype=np.float32)
                    for name in HELD + tuple(f"state.{n}" for n in self.rule.server_state)}
        except MemoryError:
            raise ParamError("RESOURCE_EXHAUSTED", f"cannot allocate the buffers of a model of "
                             f"{count} parameters on the global server") from None

    def install(self, count: int, buffers: dict[str, np.ndarray] | None) -> None:
        """Fix the model size with buffers from ``reserve`` (no-op with None)."""
        with self._cond:
            if buffers is None or self.param_count is not None:
                return
            self.buffers.update(buffers)
            self.state = {n: self.buffers[f"state.{n}"] for n in self.rule.server_state}
            self.param_count = count
            self.mail = Mailboxes(count, self.memory)

    def set_param_count(self, count: int) -> None:
        """Fix the model size (``reserve`` + ``install``); later joins must match."""
        self.install(count, self.reserve(count))

    # ------------------------------------------------------------------ exchange
    def begin(self, round_id: int, kind: RoundKind, leader_node: int | None,
              reports: dict[int, int], timeout: float, average: bool = False,
              leader_uploader: int | None = None, reduce: "RouteInfo | None" = None) -> None:
        """Start the exchange of a closed global/final round.

        Args:
            reports: node index -> participants, for every node that reported in time.
            average: every node uploads its sum, to be averaged (a round that evaluates).
            leader_uploader: the node that uploads the leader when not its own node (PLANE=chain:
                node 0, which got it along the route, beside the server).
            reduce: the round's sums come along this route (PLANE=chain): its end (node 0)
                uploads their total, the other members upload nothing.
        """
        average = average or kind == RoundKind.FINAL
        expected: set[tuple[int, str]] = set()
        # The leader's upload serves the other nodes: with a single node in the round it stays
        # home (except when it is evaluated: at the end, and in rounds that evaluate).
        if leader_node is not None and (average or (
                self.rule.exchange == ExchangeKind.LEADER and len(reports) > 1)):
            expected.add((leader_node if leader_uploader is None else leader_uploader, LEADER))
        if average or self.rule.exchange == ExchangeKind.CENTER:
            expected |= {(n, SUM) for n, p in reports.items() if p > 0
                         if reduce is None or n not in reduce.addresses}
            if reduce is not None:
                expected.add((reduce.feeds_server, SUM))
        with self._cond:
            if self.exchange is not None and self.exchange.round_id >= round_id:
                return
            if any(b == SUM for _, b in expected) and self.param_count:
                self.buffers[SUM].fill(0.0)
            self._leader_uploaders = frozenset(n for n, b in expected if b == LEADER)
            self.exchange = Exchange(round_id, kind, expected, self.clock() + timeout,
                                     participants=dict(reports), average=average, reduce=reduce,
                                     leader_route=leader_uploader is not None)
            self._maybe_settle()
            self._changed()

    def fail(self, round_id: int, why: str) -> None:
        """The exchange of round ``round_id`` cannot complete (PLANE=chain: its reduce was
        aborted): it settles now, failed, and changes no center."""
        with self._cond:
            ex = self.exchange
            if ex is not None and ex.round_id == round_id and not ex.settled:
                ex.failed.append(why)
                ex.sums_ok = False
                self._maybe_settle()
                self._changed()

    def leader_waits(self, round_id: int) -> bool:
        """Whether an upload of ``round_id``'s leader may wait for its digest (PLANE=chain: the
        leader came down a route; ``digests.WAIT``). Read without the lock, as ``uploaders``;
        True when the newest exchange is not that round's."""
        ex = self.exchange
        return ex is None or ex.round_id != round_id or ex.leader_route

    def leader_pending(self) -> int:
        """The round whose leader the other nodes' downloads still wait for (0: none): the
        newest exchange expects it from a node (not down a route) and does not hold it yet.
        Read without the lock, as ``uploaders``: the state moves before its news is sent, so
        a reader that sees it pending hears of its arrival."""
        ex = self.exchange
        if (ex is None or ex.settled or ex.leader_ok or ex.leader_route
                or not self._leader_uploaders):
            return 0
        return ex.round_id

    def uploaders(self) -> frozenset[int]:
        """The nodes the newest exchange expects the leader from (the other nodes' downloads
        wait for it). Read without the lock (the session server's loop asks at every round
        close, and must not wait while another thread holds the lock for a model-sized job)."""
        return self._leader_uploaders

    def settled(self, round_id: int) -> bool:
        """Whether the exchange of round ``round_id`` is over (or was never started)."""
        with self._cond:
            ex = self.exchange
            return ex is None or ex.round_id != round_id or ex.settled

    def reassign_upload(self, round_id: int, buffer: str, old: int, new: int) -> bool:
        """Expect ``buffer`` of round ``round_id`` from node ``new`` instead of ``old`` (PLANE=
        chain: the member that was to feed the server was bypassed). False, changing nothing,
        when that upload is not expected from ``old`` or has started."""
        with self._cond:
            ex = self.exchange
            if ex is None or ex.round_id != round_id or ex.settled or (old, buffer) not in ex.expected:
                return False
            ex.expected.discard((old, buffer))
            ex.expected.add((new, buffer))
            if buffer == LEADER:
                self._leader_uploaders = frozenset({new})
            return True

    def _maybe_settle(self) -> None:
        ex = self.exchange
        if ex is None or ex.settled:
            return
        waiting = ex.expected | ex.in_flight
        if waiting and self.clock() < ex.deadline and not ex.failed:
            return
        if waiting:
            ex.failed.append(f"missing uploads {sorted(waiting)}")
            ex.sums_ok = False
            log.warning("round %d exchange incomplete: %s", ex.round_id, "; ".join(ex.failed))
        ex.settled = True
        if ex.sums_ok and ex.summands > 0:
            if ex.average:  # SUM holds the (weighted) average from now on
                ops.scale_(self.buffers[SUM], 1.0 / ex.weight)
            if ex.kind == RoundKind.GLOBAL and self.rule.exchange == ExchangeKind.CENTER:
                weight = 1.0 if ex.average else ex.weight
                ex.center_ok = self._update_center(ex.round_id, self.buffers[SUM], weight,
                                                   ex.summands)
                self.versions[CENTER] += 2
        self._changed()

    def _update_center(self, round_id: int, total: np.ndarray, weight: float, count: int) -> bool:
        """``Rule.update_`` (under the lock). A rule that raises or makes the center
        non-finite does not stop the job: the center becomes the participants' mean, the
        rule's state starts again at zero, and the error is logged. Returns whether the
        rule's own update was used."""
        center = self.buffers[CENTER]
        start = time.monotonic()
        try:
            self.rule.update_(center, total, weight, count, self.state)
            problem = None if ops.all_finite(center) else "made the center non-finite"
        except Exception as exc:  # noqa: BLE001 - the user's code
            problem = f"raised {type(exc).__name__}: {exc}"
        took = time.monotonic() - start
        if took > 1.0:
            log.warning("round %d: rule %s's update_ took %.1f s under the server's lock (every "
                        "call waits meanwhile); keep it chunked and in place", round_id,
                        self.rule.name, took)
        if problem is None:
            return True
        log.error("round %d: rule %s's update_ %s; the center is set to the participants' "
                  "mean instead and the rule's server state to zero", round_id, self.rule.name,
                  problem)
        ops.mean_into_(center, total, weight)
        for vec in self.state.values():
            vec.fill(0.0)
        self.rule_failures += 1
        return ops.all_finite(center)

    def abort(self, why: str) -> None:
        """The job was stopped: settle the exchange in progress now (downloads waiting for it
        stop waiting; what has not arrived is missing)."""
        with self._cond:
            ex = self.exchange
            if ex is not None and not ex.settled:
                ex.failed.append(why)
                self._maybe_settle()

    def poll(self) -> None:
        """Settle an exchange whose deadline has passed (called by the server's ticker)."""
        with self._cond:
            self._maybe_settle()

    # ------------------------------------------------------------------ uploads
    def push(self, node: int, round_id: int, buffer: str, param_count: int, summands: int,
             chunks: Iterable[tuple[int, bytes]], wire: str = "float32",
             weight: float = 0.0, finite: bool = False) -> None:
        """Receive an upload of ``buffer`` from ``node``; ``chunks`` yields (offset, raw bytes)
        (``finite``: their values were checked already).

        ``wire`` is the chunks' encoding (``lsgd.wire.WIRE_FORMATS``); offsets count elements.
        """
        dtype = _wire_dtype(wire)  # before anything is taken: a refused format changes nothing
        with self._cond:
            if self.param_count is None or param_count != self.param_count:
                raise ParamError("INVALID_ARGUMENT",
                                 f"upload of {param_count} parameters; the job's model has "
                                 f"{self.param_count}")
            if buffer == CENTER and round_id == 0:
                # One seed upload at a time; if it breaks, the next one may seed.
                end = self.clock() + 60.0
                while self._seeding and not self.center_ready and self.clock() < end:
                    self._cond.wait(0.2)
                if self.center_ready or self._seeding:
                    raise ParamError("ALREADY_EXISTS", "the center is already seeded")
                self._seeding = True
                ex = None
            else:
                ex = self.exchange
                if ex is None or ex.round_id != round_id or ex.settled or (node, buffer) not in ex.expected:
                    raise ParamError("FAILED_PRECONDITION",
                                     f"no upload of {buffer} from node {node} is expected for "
                                     f"round {round_id} (closed, settled or not elected)")
                most = ex.participants.get(node, 0)  # a node sums at most what it reported
                if buffer == SUM and ex.reduce is not None and node == ex.reduce.feeds_server:
                    r = ex.reduce  # the route's total: exactly what its members reported
                    if summands != r.total_summands or not math.isclose(
                            weight or summands, r.total_weight, rel_tol=1e-9):
                        why = (f"the reduce of round {round_id} sums {r.total_summands} "
                               f"participants of weight {r.total_weight}, not {summands} of "
                               f"{weight}")
                        ex.failed.append(why)  # that total will not come right: settle now
                        ex.sums_ok = False
                        self._maybe_settle()
                        raise ParamError("INVALID_ARGUMENT", why)
                    most = summands
                if buffer == SUM and not 1 <= summands <= most:
                    raise ParamError("INVALID_ARGUMENT", f"summands must be in 1..{most} (node "
                                     f"{node}'s participants in round {round_id}), got {summands}")
                weight = weight or float(summands)  # 0: unweighted
                if buffer == SUM and not sum_weight_ok(summands, weight):
                    raise ParamError("INVALID_ARGUMENT", f"the weight of {summands} summands must "
                                     f"be in [{summands * MIN_WEIGHT:g}, "
                                     f"{summands * MAX_WEIGHT:g}], got {weight}")
                # Taken: a retry cannot add twice, and the round cannot settle mid-upload.
                ex.expected.discard((node, buffer))
                ex.in_flight.add((node, buffer))
            if buffer in self.versions:
                self.versions[buffer] += 1
                if buffer == LEADER:
                    self.leader_complete = False
        target = self.buffers[SUM if buffer == SUM else (CENTER if buffer == CENTER else LEADER)]
        try:
            self._receive(target, chunks, add=(buffer == SUM), exchange=ex, dtype=dtype,
                          finite=finite)
            if buffer == LEADER and ex is not None:  # PLANE=chain: the source's leader only
                self.digests.check(round_id, target, required=ex.leader_route)
        except Exception as exc:
            with self._cond:
                if buffer in self.versions:
                    self.versions[buffer] += 1
                if ex is None:
                    self._seeding = False
                    self._changed()
                if ex is not None:
                    ex.in_flight.discard((node, buffer))
                    if not ex.settled:
                        ex.failed.append(f"upload of {buffer} from node {node} broke: {exc}")
                        if buffer == SUM:
                            ex.sums_ok = False
                        self._maybe_settle()
            raise
        with self._cond:
            if buffer in self.versions:
                self.versions[buffer] += 1
                self.leader_complete = self.leader_complete or buffer == LEADER
            if ex is None:
                self.center_ready, self._seeding = True, False
            else:
                ex.in_flight.discard((node, buffer))
                if buffer == SUM:
                    ex.summands += summands
                    ex.weight += weight
                else:
                    ex.leader_ok = True
                self._maybe_settle()  # (news itself when it settles the round)
            # a download can become ready only with a leader, a center or a settled round: a
            # sum that leaves the round open wakes no download (N of them, N times a round)
            self._changed(news=ex is None or buffer != SUM or ex.settled)

    def _receive(self, target: np.ndarray, chunks: Iterable[tuple[int, bytes]], add: bool,
                 exchange: Exchange | None, dtype: np.dtype = np.dtype("<f4"),
                 finite: bool = False) -> None:
        steady_heap()
        size = dtype.itemsize
        stage: np.ndarray | None = None  # float32 staging of a converted chunk (page aligned)
        pos = 0
        for offset, data in chunks:
            if exchange is not None and exchange.settled:
                raise ParamError("DEADLINE_EXCEEDED", f"round {exchange.round_id} settled before "
                                 "this upload finished")
            if offset != pos or len(data) % size or pos + len(data) // size > target.size:
                raise ParamError("INVALID_ARGUMENT",
                                 f"chunk at {offset} of {len(data)} bytes does not continue at "
                                 f"{pos} of {target.size} elements")
            n = len(data) // size
            src = np.frombuffer(data, dtype=dtype)
            # a diverged or hostile node must not poison the job
            if not finite and not np.isfinite(src).all():
                raise ParamError("INVALID_ARGUMENT", f"upload has non-finite values at element "
                                 f"{pos + int(np.argmin(np.isfinite(src)))}")
            if not add:
                np.copyto(target[pos : pos + n], src, casting="unsafe")  # decodes bfloat16
            else:
                if dtype != target.dtype:  # decode outside the lock
                    if stage is None or stage.size < n:
                        stage = aligned_empty(n, target.dtype)
                    np.copyto(stage[:n], src, casting="unsafe")
                    src = stage[:n]
                with self._cond:  # uploads of several nodes add into one sum
                    if exchange is not None and (exchange.settled or self.exchange is not exchange):
                        raise ParamError("DEADLINE_EXCEEDED", f"round {exchange.round_id} settled "
                                         "before this upload finished")
                    target[pos : pos + n] += src
            pos += n
        if pos != target.size:
            raise ParamError("INVALID_ARGUMENT", f"upload ended at {pos} of {target.size} elements")

    # ------------------------------------------------------------------ downloads
    def pull(self, round_id: int, buffer: str, chunk: int, timeout: float,
             wire: str = "float32", views: bool = False,
             stable: bool = False) -> Iterator[tuple[int, bytes]]:
        """Wait until ``buffer`` is ready for ``round_id`` (0: now), then yield its chunks.

        Chunks are (element offset, raw bytes in the ``wire`` encoding); with ``views``, a
        memoryview of the buffer (or of a staging buffer reused for the next chunk) instead of
        a copy: the caller sends it before it asks for the next. ``stable``: always the staging
        buffer, which no write to the buffer can change while the caller reads it (a caller
        that computes a MAC over a chunk, then sends it). A write during the download ends it
        with ABORTED either way (round 0: the buffer's version moved; a round: the exchange).
        """
        dtype = _wire_dtype(wire)
        steady_heap()
        with self._cond:
            self._ready_or_raise(round_id, buffer, timeout)
            version = self.versions.get(buffer)
        src = self.buffers[SUM if buffer == AVERAGE else buffer]
        copy = dtype != src.dtype or (views and stable)
        stage = aligned_empty(min(chunk, src.size), dtype) if copy else None
        for lo in range(0, src.size, chunk):
            part = src[lo : lo + chunk]
            if stage is not None:  # encode (bfloat16: rounded to nearest even), or copy
                np.copyto(stage[: part.size], part, casting="unsafe")
                part = stage[: part.size]
            yield lo, (memoryview(part.view(np.uint8)) if views else part.tobytes())
        if not round_id and version is not None and self.versions[buffer] != version:
            raise ParamError("ABORTED", f"{buffer} changed during the download; try again")
        if round_id and (self.exchange is None or self.exchange.round_id != round_id):
            raise ParamError("ABORTED", f"{buffer} changed during the download of round {round_id}")

    def pull_whole(self, round_id: int, buffer: str, timeout: float,
                   wire: str = "float32") -> bytes:
        """The whole of ``buffer`` as ``pull`` gives it, in one piece (a small vector: it is
        read under the lock). A round's leader is encoded once: every node's download of it
        gets the same bytes (at 512 nodes, 511 downloads of each round's leader)."""
        with self._cond:
            self._ready_or_raise(round_id, buffer, timeout)
            ex, whole = self.exchange, self._whole.get(wire)
            key = ((round_id, self.versions[LEADER])
                   if buffer == LEADER and round_id > 0 and ex is not None else None)
            if key is not None and whole is not None and whole[0] is ex and whole[1] == key:
                return whole[2]
            # ``pull``'s one chunk, read while the lock is held (it is reentrant): no write
            # can come between its checks and its bytes
            data = b"".join(d for _, d in self.pull(round_id, buffer, self.param_count or 1,
                                                    0.0, wire))
            if key is not None:
                self._whole[wire] = (ex, key, data)
        return data

    def _ready_or_raise(self, round_id: int, buffer: str, timeout: float) -> None:
        """Wait (lock held) until ``buffer`` is ready for ``round_id``; ``ParamError`` when it
        is not within ``timeout`` (DEADLINE_EXCEEDED) or never will be (FAILED_PRECONDITION)."""
        reason = self._wait_ready(round_id, buffer, timeout)
        if reason is not None and reason.startswith("!"):
            raise ParamError("FAILED_PRECONDITION", reason[1:])
        if reason is not None:
            raise ParamError("DEADLINE_EXCEEDED", f"{buffer} not ready: {reason}")

    def center_digest(self, round_id: int, timeout: float) -> bytes | None:
        """The SHA-256 of round ``round_id``'s new center once it is made (PLANE=chain: what
        node 0 sends down the route after the reduce); None when the round has none within
        ``timeout`` seconds."""
        if round_id <= 0:
            return None
        with self._cond:
            if self._wait_ready(round_id, CENTER, timeout) is not None:
                return None
            return self.digests.center(round_id, self.buffers[CENTER])  # it cannot move meanwhile

    def _wait_ready(self, round_id: int, buffer: str, timeout: float) -> str | None:
        """Wait (lock held) up to ``timeout`` seconds for ``buffer`` of ``round_id``: None when
        it is ready, else why not (starting with '!': it never will be)."""
        end = self.clock() + timeout
        while True:
            self._maybe_settle()
            reason = self._not_ready(round_id, buffer)
            left = end - self.clock()
            if reason is None or reason.startswith("!") or left <= 0:
                return reason
            self._cond.wait(min(left, 0.2))

    def _not_ready(self, round_id: int, buffer: str) -> str | None:
        """None when ready; a reason to wait; a reason starting with '!' to give up."""
        if self.param_count is None:
            return "no node has joined"
        if buffer in self.versions and self.versions[buffer] % 2:
            return f"{buffer} is being written"
        if buffer == CENTER and round_id == 0:
            return None if self.center_ready else "the center is not seeded yet"
        if buffer == LEADER and round_id == 0:  # the newest leader, outside any round
            return None if self.leader_complete else "!no global leader has been uploaded yet"
        ex = self.exchange
        if ex is None or ex.round_id < round_id:
            return f"round {round_id} has not closed"
        if ex.round_id > round_id:
            return f"!round {round_id} is over; round {ex.round_id} is current"
        if buffer == LEADER and ex.leader_ok:
            return None  # complete: it need not wait for the nodes' sums of the same round
        if not ex.settled:
            return f"round {round_id} uploads are still arriving"
        if buffer == LEADER and not ex.leader_ok:
            return f"!round {round_id} has no global leader ({'; '.join(ex.failed) or 'no eligible worker'})"
        if buffer == AVERAGE and not (ex.average and ex.sums_ok and ex.summands):
            return f"!round {round_id} has no average"
        if (buffer == CENTER and ex.kind == RoundKind.GLOBAL
                and self.rule.exchange == ExchangeKind.CENTER
                and not (ex.sums_ok and ex.summands and ex.center_ok)):
            # the center did not move this round: a rule that pulls toward this round's new
            # center must not pull toward the old one (its node leaves those pulls out)
            return f"!round {round_id} has no new center ({'; '.join(ex.failed) or 'no sums'})"
        return None


def sum_weight_ok(summands: int, weight: float) -> bool:
    """Whether ``weight`` can be the total weight of a sum of ``summands`` participants (each
    of weight in [MIN_WEIGHT, MAX_WEIGHT]; NaN is not)."""
    return summands * MIN_WEIGHT * (1 - 1e-9) <= weight <= summands * MAX_WEIGHT * (1 + 1e-9)


def _wire_dtype(wire: str) -> np.dtype:
    """The element dtype of a wire format; a ParamError the caller can answer with."""
    try:
        return wire_dtype(wire)
    except ImportError as exc:
        raise ParamError("UNIMPLEMENTED", f"this server cannot use the {wire} wire format: {exc}") from None
    except ValueError as exc:
        raise ParamError("INVALID_ARGUMENT", str(exc)) from None
