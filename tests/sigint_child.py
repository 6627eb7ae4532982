"""A child as a node's are: its target's module imports lsgd while the child starts
(tests/test_sigint_children.py)."""

from __future__ import annotations

import time

import lsgd  # noqa: F401 - imported while multiprocessing unpickles the target, as in a node
from sigint_probe import sigint_state


def report(queue) -> None:
    queue.put(sigint_state())


def survive() -> None:
    time.sleep(0.3)
