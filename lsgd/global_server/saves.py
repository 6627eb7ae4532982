"""Saving the leader and the center (``STATE_EVERY`` and checkpoints) without stopping the
exchange: a mixin of ``ParamStore`` (``params.py``).

Each vector streams from its buffer to the .npz chunk by chunk, outside the lock; a vector that
changed meanwhile (its version moved) makes the save start again, and a vector an upload is
writing is taken from the previous save. See ``ParamStore.save``.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np

from ..files import atomic_path
from .buffers import CENTER, LEADER, SAVED_AS
from .snapshot import NpzReader, NpzWriter

log = logging.getLogger("lsgd.global_server.params")


class _Changed(Exception):
    """A vector changed while a save wrote it: that attempt is discarded."""



class SavedParams:
    """``save`` and ``load`` of the leader and the center (methods of ``ParamStore``)."""

    @property
    def writing(self) -> bool:
        """True while an upload is writing the leader or the center."""
        with self._cond:
            return any(v % 2 for v in self.versions.values())

    def save(self, path, force: bool = False, fallback=None) -> bool:  # noqa: ANN001 - Paths
        """Write the leader and the center to ``path`` if they changed since the last save (or
        ``force``). Returns True when it wrote.

        The file is an .npz (``snapshot``: ``load`` and ``np.load`` read it), replaced atomically.
        Each vector streams from its buffer to the file chunk by chunk, without the lock and
        without a copy; if a vector changed meanwhile (its version moved) the save starts again,
        and a third attempt holds the lock while it writes (rare: a vector changes once a
        round). A vector that is not complete now (an upload is writing it, however long that
        upload hangs, or the last one broke) is copied from ``fallback`` (default ``path``: the
        previous save) with its flag there, i.e. its newest complete values saved; it is never
        written torn as complete.
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
            live = {LEADER: versions[LEADER] % 2 == 0 and self.leader_complete,
                    CENTER: versions[CENTER] % 2 == 0 and self.center_ready}
        with ExitStack() as stack:
            old, old_flags = None, (False, False)
            if not all(live.values()):
                old, old_flags = self._saved(fallback, stack)
            flags = []
            tmp = stack.enter_context(atomic_path(path))
            out = stack.enter_context(NpzWriter(tmp))
            for i, name in enumerate((LEADER, CENTER)):
                member = SAVED_AS[name]
                if live[name]:
                    out.vector(member, self.buffers[name])
                elif old is not None:
                    out.copy(old, member)
                else:  # nothing complete to save yet: saved as not ready
                    out.vector(member, self.buffers[name])
                flags.append(live[name] or (old is not None and old_flags[i]))
            out.small("flags", np.array(flags, dtype=np.bool_))
            with self._cond:
                if any(live[n] and self.versions[n] != versions[n] for n in live):
                    raise _Changed
        return key

    def _saved(self, path: Path, stack: ExitStack) -> tuple["NpzReader | None", tuple[bool, bool]]:
        """The vectors and flags of an earlier save at ``path``, if it is one of this model."""
        if not path.exists():
            return None, (False, False)
        try:
            reader = stack.enter_context(NpzReader(path))
            flags = reader.small("flags")
            for member in SAVED_AS.values():
                if reader.header(member) != ((self.param_count,), np.dtype("<f4")):
                    raise ValueError(f"{path}: '{member}' is not a vector of {self.param_count}")
            if flags.shape != (2,) or flags.dtype != np.bool_:
                raise ValueError(f"{path}: no flags")
        except (OSError, ValueError) as exc:
            log.warning("the previous save cannot be reused (%s); an incomplete leader or center "
                        "is saved as not ready", exc)
            return None, (False, False)
        return reader, (bool(flags[0]), bool(flags[1]))

    def _saved_key(self) -> int:
        return hash((self.versions[LEADER], self.versions[CENTER], self.center_ready,
                     self.leader_complete))

    def load(self, path) -> None:  # noqa: ANN001 - a Path
        """Restore the leader and the center saved by ``save`` (or by ``np.savez``, as earlier
        versions saved them), read chunk by chunk into the buffers."""
        with NpzReader(path) as z:
            flags = z.small("flags")
            shape, dtype = z.header("leader")
            if (dtype != np.dtype("<f4") or len(shape) != 1 or not shape[0]
                    or z.header("center") != (shape, dtype) or flags.shape != (2,)
                    or flags.dtype != np.bool_):
                raise ValueError(f"{path}: not a saved leader and center")
            with self._cond:
                self.set_param_count(shape[0])
                z.into("leader", self.buffers[LEADER])
                z.into("center", self.buffers[CENTER])
                self.leader_complete, self.center_ready = bool(flags[0]), bool(flags[1])
                self.versions[LEADER] += 2
                self.versions[CENTER] += 2
