"""A spawned child's report on its SIGINT handling (tests/test_sigint_children.py). It imports
nothing of lsgd, so what it sees comes from how it was started."""

from __future__ import annotations

import signal
import sys


def sigint_ignored() -> bool:
    """Whether the kernel ignores SIGINT for this process (``SigIgn`` in /proc/self/status)."""
    with open("/proc/self/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def report(queue) -> None:
    queue.put({"ignored": sigint_ignored(), "lsgd_imported": "lsgd" in sys.modules})
