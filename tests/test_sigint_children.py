"""Ctrl-C while a node starts its processes (lsgd/local_server/procs.py): its children start
with SIGINT ignored, and the node's own handling of SIGINT is never changed meanwhile (a
Ctrl-C that came while it was once set to ignored was lost, and the node trained on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import json, multiprocessing as mp, threading
import sigint_probe
from lsgd.local_server.procs import ignore_sigint_in_children

if __name__ == "__main__":
    seen, stop = [], threading.Event()

    def watch():  # the parent's own SIGINT disposition, sampled while it starts children
        while not stop.is_set():
            seen.append(sigint_probe.sigint_ignored())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        ignore_sigint_in_children()
        for _ in range(3):
            p = ctx.Process(target=sigint_probe.report, args=(queue,))
            p.start()
            p.join(30)
    finally:
        stop.set()
        watcher.join()
    print(json.dumps({"children": [queue.get() for _ in range(3)], "samples": len(seen),
                      "parent_ignored": any(seen)}))
"""


def test_children_start_with_sigint_ignored_and_the_parent_keeps_its_own():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["samples"] > 0
    assert not got["parent_ignored"], "the parent ignored SIGINT while it started children"
    for child in got["children"]:  # lsgd not imported there: ignored from its start
        assert child == {"ignored": True, "lsgd_imported": False}, got
