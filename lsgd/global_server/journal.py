"""Write-ahead of the global server's rounds and membership, so a restart never repeats them.

``state.json`` is saved every ``state_every`` seconds; a server killed between two saves would
go on from an older state and issue round ids (and evaluation and checkpoint rounds) a second
time, and forget nodes that joined since. So, before any node can learn of a change (the
servicer calls ``write`` with its lock held):

- every change of the round schedule (a round opened, the stop target moved) rewrites
  ``rounds.json``: one page-sized record written in place by a single ``pwrite``, which a crash
  of the process cannot tear (~10 us);
- every change of membership (rare: a node joined) writes the whole state to ``members.json``
  (temporary file renamed over it).

Neither is fsynced: they guard against a crash of the server process, which is what a restart
recovers from (a crash of node 0's machine loses the job anyway). Every state the servicer takes
is numbered (``dump``); ``load`` goes on from the newest.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..files import open_private

log = logging.getLogger(__name__)

RECORD = 4096  # one page: a single write of it is never torn by a crash of the process
# What a round opening or a stop changes (Coordinator.rounds_state, numbered)
ROUND_FIELDS = ("dump", "done", "rounds_opened", "target", "target_kind", "period_start",
                "next_eval", "next_checkpoint", "stop_reason", "started", "stopped")


class Journal:
    def __init__(self, directory: Path) -> None:
        self.rounds_path = directory / "rounds.json"
        self.members_path = directory / "members.json"
        self._fd: int | None = None
        self._failed = False

    def clear(self) -> None:
        """Forget the journal of an earlier run in this RUN_DIR (a fresh start)."""
        for path in (self.rounds_path, self.members_path):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, state: dict, members: bool) -> None:
        """Record ``state``: a numbered ``Coordinator.rounds_state``, or its whole ``state``
        when ``members`` (membership changed)."""
        try:
            record = {k: state[k] for k in ROUND_FIELDS}
            if record["stop_reason"]:
                record["stop_reason"] = record["stop_reason"][:500]
            data = json.dumps(record).encode()
            if self._fd is None:
                self._fd = os.open(self.rounds_path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.pwrite(self._fd, data.ljust(RECORD), 0)
            if members:
                tmp = self.members_path.with_name(f".{self.members_path.name}.tmp")
                with open_private(tmp, "w") as f:
                    f.write(json.dumps(state))
                os.replace(tmp, self.members_path)
        except OSError as exc:
            if not self._failed:
                log.warning("cannot write the journal in %s (%s): a restart may repeat round ids",
                            self.rounds_path.parent, exc)
            self._failed = True

    def load(self, state: dict) -> dict:
        """The newest state: ``state`` (from state.json), the membership journal if newer, and
        the round schedule of the rounds journal if newer still."""
        if self.members_path.exists():
            members = json.loads(self.members_path.read_text())
            if int(members.get("dump", 0)) > int(state.get("dump", 0)):
                state = members
        if self.rounds_path.exists():
            rounds = json.loads(self.rounds_path.read_bytes().decode().strip() or "{}")
            if int(rounds.get("dump", 0)) > int(state.get("dump", 0)):
                # Not its counter: the nodes' request numbers in ``state`` belong with the
                # counter there, and a reattaching node counts the steps of a request whose
                # answer it lost only if the server's number for it is older. Mixing the newer
                # counter with the older numbers counted such steps twice.
                state = state | {k: rounds[k] for k in ROUND_FIELDS if k in rounds and k != "done"}
        return state
