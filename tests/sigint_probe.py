"""Spawned children's reports on their SIGINT handling (tests/test_sigint_children.py); this
module imports nothing of lsgd, ``sigint_child.py`` does."""

from __future__ import annotations

import signal
import sys


def sigint_state() -> dict[str, bool]:
    """Whether the kernel holds SIGINT blocked or ignored for this thread (/proc/self/status)."""
    masks = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn"):
                masks[key] = bool(int(value, 16) >> (signal.SIGINT - 1) & 1)
    return {"blocked": masks["SigBlk"], "ignored": masks["SigIgn"]}


def report(queue) -> None:
    """This module imports nothing of lsgd: how the child was started."""
    queue.put(sigint_state() | {"lsgd_imported": "lsgd" in sys.modules})
