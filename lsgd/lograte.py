"""Warnings that may repeat every round, logged once and then counted.

A condition that holds round after round (a worker reset after non-finite losses, a node that
reports a round too late) would otherwise print one line per round. ``RepeatedLog`` logs the
first occurrence of each kind in full, then at most one line per ``every`` seconds saying how
many more there were, and keeps a total per kind for the run summary::

    repeats = RepeatedLog(log, every=30.0)
    repeats.warning("late report", "round %d: this node reported too late", rid)
    ...
    summary["repeated_warnings"] = repeats.flush()
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

# Set (to "1") by a node whose stderr is a terminal where progress lines may be drawn; its
# processes then start each log record by clearing the terminal's current line (``log_format``).
LIVE_LINE_ENV = "LSGD_LIVE_LINE"
CLEAR_LINE = "\r\x1b[K"  # carriage return, erase to the end of the line


def log_format(who: str) -> str:
    """The log record format of a process of the job (``who``: node 0, worker 3, global).

    On a terminal where a node draws a live progress line (``local_server/progress.py``), each
    record first erases that line, so a record never lands in the middle of it; the line is
    drawn again below the record a moment later.
    """
    clear = ""
    if os.environ.get(LIVE_LINE_ENV) == "1":
        try:
            clear = CLEAR_LINE if sys.stderr is not None and sys.stderr.isatty() else ""
        except (AttributeError, ValueError, OSError):
            pass
    return f"{clear}%(asctime)s {who} %(levelname)s %(message)s"


class RepeatedLog:
    """Rate-limits log lines per kind: the first in full, then a count every ``every`` s.

    Not thread-safe: one owner (the node loop) calls it.
    """

    def __init__(self, logger: logging.Logger, every: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every, self.clock = logger, every, clock
        self.totals: dict[str, int] = {}
        self._last: dict[str, float] = {}  # kind -> when a line was last logged
        self._held: dict[str, int] = {}  # kind -> occurrences not logged since then

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        """Count one occurrence of ``kind``; log it unless one was logged within ``every`` s."""
        now = self.clock()
        self.totals[kind] = self.totals.get(kind, 0) + 1
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        if held:
            msg += f" ({held} more like this in the last {now - last:.0f} s, not logged)"
        self._last[kind] = now
        self.logger.log(level, msg, *args)

    def flush(self) -> dict[str, int]:
        """Log the counts not logged yet (at the end of a run); returns the totals per kind."""
        for kind, held in sorted(self._held.items()):
            self.logger.warning("%s: %d more time(s) since it was last logged (%d in all)", kind,
                                held, self.totals[kind])
        self._held.clear()
        return dict(self.totals)
