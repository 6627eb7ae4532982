"""Center deltas of asynchronous rules: added to the center chunk by chunk, each exactly once.

A node of an asynchronous rule (``lsgd.rules.asynchronous``) sends what its workers added to
the center since its last upload, numbered 1, 2, ... per node session (``PushHeader.round_id``).
Each chunk is added under the store's lock, so concurrent uploads of several nodes never lose an
update, and nothing waits for a barrier. A download meanwhile is not held back: it may see a
delta in part (each element whole, before or after), as in Hogwild-style parameter servers. An upload that breaks midway has added its first chunks: the node
sends the same delta again under the same number, and ``DeltaLedger`` tells the store how many
leading elements to skip, so every element of every delta is added once.

The ledger is saved with the center (``saves.py``: one consistent snapshot, never torn by a
delta landing meanwhile), so a restarted global server skips what its saved center holds and
adds what it lacks: a delta sent again is added once. Deltas applied after that save, which the
node was told had arrived, are lost with the server (counted as ``lost``), as are the steps it
counted meanwhile.

The ledger is pure bookkeeping (no lock, no I/O); ``DeltaMixin.push_delta`` is the store's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..wire import aligned_empty, steady_heap
from .buffers import CENTER, ParamError

log = logging.getLogger(__name__)


@dataclass
class _Record:
    session: int
    seq: int  # the newest delta number seen from this node session
    applied: int  # leading elements of that delta already added to the center
    busy: bool  # an upload of it is being received
    done: bool = False  # that delta was applied in full
    restored: bool = False  # read from a save: the node may have moved on since (see begin)


class DeltaLedger:
    """Which delta of which node was applied how far. Not thread-safe: the store's lock."""

    def __init__(self) -> None:
        self._records: dict[int, _Record] = {}
        self.applied = 0  # deltas applied in full (for the server's summary)
        self.retried = 0  # uploads that continued a broken one
        self.lost = 0  # deltas applied after the last save of a server that then died
        self.moves = 0  # chunks added to the center (a save compares it: saves.py)

    def rows(self) -> list[tuple[int, int, int, int, bool]]:
        """(node, session, seq, applied, done) of every node: saved with the center."""
        return [(n, r.session, r.seq, r.applied, r.done) for n, r in sorted(self._records.items())]

    def restore(self, rows, counts) -> None:  # noqa: ANN001 - arrays of a save
        """The ledger of a save, with the center saved with it (a restarted server)."""
        self._records = {int(n): _Record(int(s), int(q), int(a), False, bool(d), True)
                         for n, s, q, a, d in rows}
        self.applied, self.retried, self.lost = (int(c) for c in counts)

    def begin(self, node: int, session: int, seq: int) -> int | None:
        """An upload of delta ``seq`` from ``node`` starts. Returns the number of leading
        elements to skip (already added), or None when the whole delta was applied before
        (an answer that was lost: nothing to do).

        Raises:
            ParamError: a number ahead of the next one, or an upload of the same delta in flight.
        """
        if seq < 1:
            raise ParamError("INVALID_ARGUMENT", "a center delta is numbered from 1 (round_id)")
        rec = self._records.get(node)
        if rec is None or rec.session != session:  # a new session (or a restarted server)
            self._records[node] = _Record(session, seq, 0, True)
            return 0
        if rec.busy:
            raise ParamError("ABORTED", f"node {node} is already uploading delta {rec.seq}")
        if rec.restored and seq > rec.seq + int(rec.done):
            # The server restarted from a save, and this node has moved on since: its deltas
            # after the save (up to seq - 1, and the rest of one in progress then) reached the
            # server that died. They are lost with it, as the steps it counted meanwhile.
            lost = seq - rec.seq - 1 + int(not rec.done)
            self.lost += lost
            log.warning("node %d: %d center delta(s) applied after the last state save were lost "
                        "with the global server that died", node, lost)
            rec.seq, rec.applied, rec.busy, rec.done, rec.restored = seq, 0, True, False, False
            return 0
        rec.restored = False
        if seq == rec.seq + 1:
            rec.seq, rec.applied, rec.busy, rec.done = seq, 0, True, False
            return 0
        if seq == rec.seq and rec.done:
            return None  # applied in full; the answer to the node was lost: nothing to do
        if seq == rec.seq:
            rec.busy = True
            self.retried += 1
            return rec.applied
        if seq < rec.seq:
            return None  # applied in full before the node moved on to a newer one
        raise ParamError("INVALID_ARGUMENT", f"node {node} sent center delta {seq}; the next "
                         f"is {rec.seq + 1}")

    def progress(self, node: int, applied: int) -> None:
        """Elements of the node's current delta added so far (the center just moved)."""
        self._records[node].applied = applied
        self.moves += 1

    def end(self, node: int, complete: bool) -> None:
        rec = self._records[node]
        rec.busy = False
        if complete:
            rec.done = True
            self.applied += 1


class DeltaMixin:
    """``ParamStore``'s part: receive a delta and add it to the center (methods of the store)."""

    def push_delta(self, node: int, session: int, seq: int, param_count: int,
                   chunks: Iterable[tuple[int, bytes]], dtype: np.dtype) -> None:
        """Add delta ``seq`` of ``node`` (chunks of (element offset, raw bytes)) to the center."""
        with self._cond:
            if self.param_count is None or param_count != self.param_count:
                raise ParamError("INVALID_ARGUMENT", f"upload of {param_count} parameters; the "
                                 f"job's model has {self.param_count}")
            if not self.center_ready:
                raise ParamError("FAILED_PRECONDITION", "the center is not seeded yet")
            skip = self.deltas.begin(node, session, seq)
        if skip is None:
            for _ in chunks:  # drain: the delta was applied in full before
                pass
            return
        center = self.buffers[CENTER]
        steady_heap()
        size = dtype.itemsize
        stage: np.ndarray | None = None
        total: np.ndarray | None = None  # center + delta, checked before the center takes it
        pos, complete = 0, False
        try:
            for offset, data in chunks:
                if offset != pos or len(data) % size or pos + len(data) // size > center.size:
                    raise ParamError("INVALID_ARGUMENT", f"chunk at {offset} of {len(data)} "
                                     f"bytes does not continue at {pos} of {center.size} elements")
                n = len(data) // size
                src = np.frombuffer(data, dtype=dtype)
                if not np.isfinite(src).all():  # a diverged or hostile node must not poison the job
                    raise ParamError("INVALID_ARGUMENT", f"delta has non-finite values at element "
                                     f"{pos + int(np.argmin(np.isfinite(src)))}")
                if dtype != center.dtype:  # decode outside the lock
                    if stage is None or stage.size < n:
                        stage = aligned_empty(n, center.dtype)
                    np.copyto(stage[:n], src, casting="unsafe")
                    src = stage[:n]
                lo = max(pos, skip)  # what a broken upload of this delta added already
                if lo < pos + n:
                    if total is None or total.size < n:
                        total = aligned_empty(n, center.dtype)
                    with self._cond:  # one chunk at a time: concurrent deltas all add up
                        out = total[:pos + n - lo]
                        with np.errstate(over="ignore"):  # checked just below
                            np.add(center[lo : pos + n], src[lo - pos :], out=out)
                        if not np.isfinite(out).all():  # finite, yet too big: refused (its earlier chunks stay)
                            raise ParamError("INVALID_ARGUMENT", "delta would make the center "
                                             "non-finite at element "
                                             f"{lo + int(np.argmin(np.isfinite(out)))}")
                        center[lo : pos + n] = out
                        self.deltas.progress(node, pos + n)
                pos += n
            if pos != center.size:
                raise ParamError("INVALID_ARGUMENT",
                                 f"delta ended at {pos} of {center.size} elements")
            complete = True
        finally:
            with self._cond:
                self.deltas.end(node, complete)
