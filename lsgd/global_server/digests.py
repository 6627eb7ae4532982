"""The SHA-256 of each PLANE=chain round's leader, as the round's source registered it, and of
each new center the server sends down a route (docs/design-scale.md, build step 6).

A member of a route holds the job secret, and so could feed its descendants a vector of its own
(or claim to be one of their ancestors, from the same host). So the source registers the
digest of the leader it sends before it sends, a member keeps what came down the route only if
it matches, and the server refuses a leader upload that does not. Pure bookkeeping, thread-safe;
the servicer checks who may register (``Digest``).
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np

from .buffers import ParamError

SIZE = 32  # bytes of a SHA-256
KEEP = 4  # rounds kept: a member asks within its round, a bypassed one a little later
WAIT = 5.0  # seconds a member's question waits for the source's registration


def sha256_of(vec: np.ndarray) -> bytes:
    """The digest of a vector's bytes (hashlib releases the GIL for large buffers)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(vec)).cast("B")).digest()


class LeaderDigests:
    """Round -> the leader's digest, and the new center's (``center``), the newest ``KEEP``
    rounds of each."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_round: dict[int, bytes] = {}
        self._centers: dict[int, bytes] = {}

    def center(self, round_id: int, vec: np.ndarray) -> bytes:
        """The digest of ``round_id``'s new center ``vec``, made once (the caller holds the
        lock that keeps the center from moving meanwhile)."""
        with self._cond:
            made = self._centers.get(round_id)
        if made is None:
            made = sha256_of(vec)
            with self._cond:
                self._centers[round_id] = made
                for old in sorted(self._centers)[:-KEEP]:
                    del self._centers[old]
        return made

    def register(self, round_id: int, digest: bytes) -> None:
        """The source's digest for ``round_id``; a different second one is refused."""
        if len(digest) != SIZE:
            raise ParamError("INVALID_ARGUMENT", f"a digest is {SIZE} bytes, got {len(digest)}")
        with self._cond:
            had = self._by_round.get(round_id)
            if had is not None and had != digest:
                raise ParamError("FAILED_PRECONDITION",
                                 f"round {round_id}'s leader digest is registered already")
            self._by_round[round_id] = digest
            for old in sorted(self._by_round)[:-KEEP]:
                del self._by_round[old]
            self._cond.notify_all()

    def get(self, round_id: int, wait: float = 0.0) -> bytes | None:
        """The digest of ``round_id``'s leader, waiting up to ``wait`` seconds for it."""
        end = time.monotonic() + wait
        with self._cond:
            while round_id not in self._by_round:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._by_round[round_id]

    def check(self, round_id: int, vec: np.ndarray, required: bool = False) -> None:
        """Refuse ``vec`` as ``round_id``'s leader when its source registered another digest,
        or, where the leader came down a route (``required``), none within ``WAIT`` seconds.
        On the star there is nothing to check."""
        want = self.get(round_id, WAIT if required else 0.0)
        if want is None and required:
            raise ParamError("FAILED_PRECONDITION", f"round {round_id}'s leader came down a route "
                             "whose source registered no digest: it is not taken")
        if want is not None and sha256_of(vec) != want:
            raise ParamError("INVALID_ARGUMENT", f"the leader uploaded for round {round_id} is "
                             "not the one its source sent (SHA-256 differs)")
