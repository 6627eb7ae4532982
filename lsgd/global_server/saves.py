"""Saving the leader, the center and the rule's server state (``STATE_EVERY`` and checkpoints)
without stopping the exchange: a mixin of ``ParamStore`` (``params.py``).

Each vector streams from its buffer to the .npz chunk by chunk, outside the lock; a vector that
changed meanwhile (its version moved) makes the save start again, and a vector an upload is
writing is taken from the previous save. See ``ParamStore.save``.

The vectors a rule names in ``server_state`` (DiLoCo's outer momentum) are members
``state.<name>`` of the same file. They change only with the center (``Rule.update_``, under
the lock, one center version), so they are saved and loaded as one with it: a save never pairs
a center with the state of another round. A file without them (an older version's, or a rule
without state) loads with that state at zero.

Asynchronous rules move the center by deltas (``deltas.py``), a chunk at a time under the lock,
without a version: the ledger's ``moves`` count them, a save writes when they moved and starts
again when one landed while it wrote, and the ledger (which delta of which node was added how
far) is saved with the center it describes (members ``deltas``, ``delta_counts``, once there is
one), so a restarted server adds a delta sent again only where its saved center lacks it.
"""

from __future__ import annotations

import logging
import math
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np

from ..files import atomic_path
from .buffers import CENTER, LEADER, SAVED_AS
from .snapshot import CHUNK, NpzReader, NpzWriter

log = logging.getLogger("lsgd.global_server.params")


DELTAS = "deltas"  # members of the save: the ledger of center deltas (deltas.py) ...
DELTA_COUNTS = "delta_counts"  # ... and its counts (applied, continued, lost)


class _Changed(Exception):
    """A vector changed while a save wrote it: that attempt is discarded."""



def state_member(name: str) -> str:
    """The .npz member of the rule's server state vector ``name``."""
    return f"state.{name}"


def norm(vec: np.ndarray) -> float:
    """The L2 norm of a flat float32 vector, summed in float64 a chunk at a time (a
    fingerprint for the logs: no full-size temporary)."""
    step = CHUNK // 4
    sq = 0.0
    for lo in range(0, vec.size, step):
        part = vec[lo : lo + step].astype(np.float64)
        sq += float(np.dot(part, part))
    return math.sqrt(sq)


class SavedParams:
    """``save`` and ``load`` of the leader, the center and the rule's server state (methods of
    ``ParamStore``)."""

    @property
    def writing(self) -> bool:
        """True while an upload is writing the leader or the center."""
        with self._cond:
            return any(v % 2 for v in self.versions.values())

    def save(self, path, force: bool = False, fallback=None) -> bool:  # noqa: ANN001 - Paths
        """Write the leader, the center and the rule's state to ``path`` if they changed since
        the last save (or ``force``). Returns True when it wrote.

        The file is an .npz (``snapshot``: ``load`` and ``np.load`` read it), replaced atomically.
        Each vector streams from its buffer to the file chunk by chunk, without the lock and
        without a copy; if a vector changed meanwhile (its version moved) the save starts again,
        and a third attempt holds the lock while it writes (rare: a vector changes once a
        round). A vector that is not complete now (an upload is writing it, however long that
        upload hangs, or the last one broke) is copied from ``fallback`` (default ``path``: the
        previous save) with its flag there, i.e. its newest complete values saved; it is never
        written torn as complete. The rule's state vectors go with the center: streamed from
        their buffers under the center's version check, or copied from ``fallback`` when the
        center is.
        """
        path = Path(path)
        with self._cond:
            if self.param_count is None or (self._last_saved == self._saved_key() and not force):
                return False
        for attempt in range(3):
            try:
                with self._cond if attempt == 2 else nullcontext():  # the last one: nothing moves
                    key = self._write(path, Path(fallback or path))
            except _Changed:
                continue
            with self._cond:
                self._last_saved = key
            return True
        raise AssertionError("a save that holds the lock saw a vector change")

    def _write(self, path: Path, fallback: Path) -> int:
        """One attempt of ``save``; raises _Changed when a vector changed while it was written."""
        with self._cond:
            key = self._saved_key()
            versions = dict(self.versions)
            moves = self.deltas.moves  # the center's deltas: the ledger below goes with them
            ledger = np.array(self.deltas.rows(), dtype=np.int64).reshape(-1, 5)
            counts = np.array([self.deltas.applied, self.deltas.retried, self.deltas.lost],
                              dtype=np.int64)
            live = {LEADER: versions[LEADER] % 2 == 0 and self.leader_complete,
                    CENTER: versions[CENTER] % 2 == 0 and self.center_ready}
        with ExitStack() as stack:
            old, old_flags, old_state = None, (False, False), set()
            if not all(live.values()):
                old, old_flags, old_state = self._saved(fallback, stack)
            flags = []
            tmp = stack.enter_context(atomic_path(path))
            out = stack.enter_context(NpzWriter(tmp))
            for i, name in enumerate((LEADER, CENTER)):
                member = SAVED_AS[name]
                copied = not live[name] and old is not None
                if copied:
                    out.copy(old, member)
                elif live[name]:
                    out.vector(member, self.buffers[name])
                else:  # nothing complete to save yet (maybe being written now): zeros, not
                    # ready. np.zeros maps the zero page: no memory, and no torn bytes.
                    out.vector(member, np.zeros(self.param_count, np.float32))
                flags.append(live[name] or (copied and old_flags[i]))
            for name, vec in self.state.items():  # with the center they were made with
                member = state_member(name)
                if not live[CENTER] and old is not None and member in old_state:
                    out.copy(old, member)
                else:  # live (checked with the center's version below); or not updated yet
                    out.vector(member, vec)
            if not live[CENTER] and old is not None and DELTAS in old.members():
                for member in (DELTAS, DELTA_COUNTS):  # with the center they describe
                    out.copy(old, member)
            elif ledger.size or counts.any():  # (a synchronous rule's save has none)
                out.small(DELTAS, ledger)
                out.small(DELTA_COUNTS, counts)
            out.small("flags", np.array(flags, dtype=np.bool_))
            with self._cond:
                if any(live[n] and self.versions[n] != versions[n] for n in live):
                    raise _Changed
                if live[CENTER] and self.deltas.moves != moves:  # a delta landed meanwhile
                    raise _Changed
        return key

    def _saved(self, path: Path,
               stack: ExitStack) -> tuple["NpzReader | None", tuple[bool, bool], set[str]]:
        """The vectors and flags of an earlier save at ``path``, if it is one of this model, and
        the members of the rule's state it holds."""
        if not path.exists():
            return None, (False, False), set()
        try:
            reader = stack.enter_context(NpzReader(path))
            flags = reader.small("flags")
            for member in SAVED_AS.values():
                if reader.header(member) != ((self.param_count,), np.dtype("<f4")):
                    raise ValueError(f"{path}: '{member}' is not a vector of {self.param_count}")
            if flags.shape != (2,) or flags.dtype != np.bool_:
                raise ValueError(f"{path}: no flags")
            held = reader.members()
            state = {state_member(n) for n in self.state if state_member(n) in held
                     and reader.header(state_member(n)) == ((self.param_count,), np.dtype("<f4"))}
        except (OSError, ValueError) as exc:
            log.warning("the previous save cannot be reused (%s); an incomplete leader or center "
                        "is saved as not ready", exc)
            return None, (False, False), set()
        return reader, (bool(flags[0]), bool(flags[1])), state

    def _saved_key(self) -> int:
        return hash((self.versions[LEADER], self.versions[CENTER], self.center_ready,
                     self.leader_complete, self.deltas.moves))

    def load(self, path) -> None:  # noqa: ANN001 - a Path
        """Restore the leader, the center and the rule's state saved by ``save`` (or by
        ``np.savez``, as earlier versions saved them), read chunk by chunk into the buffers.
        A state vector the file lacks starts at zero (one log line says so)."""
        with NpzReader(path) as z:
            flags = z.small("flags")
            shape, dtype = z.header("leader")
            if (dtype != np.dtype("<f4") or len(shape) != 1 or not shape[0]
                    or z.header("center") != (shape, dtype) or flags.shape != (2,)
                    or flags.dtype != np.bool_):
                raise ValueError(f"{path}: not a saved leader and center")
            held = z.members()
            names = self.rule.server_state
            found = [n for n in names if state_member(n) in held]
            for n in found:
                if z.header(state_member(n)) != (shape, dtype):
                    raise ValueError(f"{path}: '{state_member(n)}' is not a vector of {shape[0]}")
            ledger = None
            if DELTAS in held:
                ledger, counts = z.small(DELTAS), z.small(DELTA_COUNTS)
                if (ledger.ndim != 2 or ledger.shape[1] != 5 or ledger.dtype != np.int64
                        or counts.shape != (3,)):
                    raise ValueError(f"{path}: '{DELTAS}' is not a ledger of center deltas")
            with self._cond:
                self.set_param_count(shape[0])
                if ledger is not None:
                    self.deltas.restore(ledger.tolist(), counts.tolist())
                z.into("leader", self.buffers[LEADER])
                z.into("center", self.buffers[CENTER])
                for n in names:
                    if n in found:
                        z.into(state_member(n), self.state[n])
                    else:
                        self.state[n].fill(0.0)
                self.leader_complete, self.center_ready = bool(flags[0]), bool(flags[1])
                self.versions[LEADER] += 2
                self.versions[CENTER] += 2
        missing = [n for n in names if n not in found]
        if missing:
            log.warning("%s holds no state of rule %s (%s), saved by an earlier version or "
                        "another rule: it starts at zero", path, self.rule.name or
                        type(self.rule).__name__, ", ".join(missing))
        if found:
            log.info("restored the server state of rule %s from %s: %s", self.rule.name or
                     type(self.rule).__name__, path,
                     ", ".join(f"{n} (norm {norm(self.state[n]):.6e})" for n in found))
