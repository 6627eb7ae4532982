"""Ctrl-C while a node starts its processes (lsgd/local_server/procs.py): a Ctrl-C that reaches
a child during its start-up is held, then dropped, never ending it; and the node's own handling
of SIGINT is never changed meanwhile (a Ctrl-C that came while it was once set to ignored was
lost, and the node trained on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import json, multiprocessing as mp, os, signal, threading
import sigint_child, sigint_probe
from lsgd.local_server.procs import children_ignore_sigint

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a node does (lsgd/__main__)
    seen, stop = [], threading.Event()

    def watch():  # the parent's own SIGINT disposition, sampled while it starts children
        while not stop.is_set():
            seen.append(sigint_probe.sigint_state()["ignored"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    codes, reports = [], []
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        for target in (sigint_probe.report, sigint_child.report):
            p = ctx.Process(target=target, args=(queue,))
            with children_ignore_sigint():
                p.start()
            p.join(30)
            reports.append(queue.get())
        for _ in range(8):  # Ctrl-C at the child the moment it exists
            p = ctx.Process(target=sigint_child.survive)
            with children_ignore_sigint():
                p.start()
                os.kill(p.pid, signal.SIGINT)
            p.join(30)
            codes.append(p.exitcode)
    finally:
        stop.set()
        watcher.join()
    print(json.dumps({"reports": reports, "codes": codes, "samples": len(seen),
                      "parent_ignored": any(seen)}))
"""


def test_a_ctrl_c_during_a_childs_start_is_held_then_dropped_and_the_parent_keeps_its_own():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["samples"] > 0
    assert not got["parent_ignored"], "the parent ignored SIGINT while it started children"
    start, after_lsgd = got["reports"]  # held from its first instruction; ignored once lsgd is in
    assert start == {"blocked": True, "ignored": False, "lsgd_imported": False}, got
    assert after_lsgd == {"blocked": False, "ignored": True}, got
    assert got["codes"] == [0] * 8, f"a child ended by a Ctrl-C during its start: {got}"
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr


PARENT = r"""
import json, multiprocessing as mp, os, signal, sys
import sigint_child
from lsgd.local_server.procs import children_ignore_sigint

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a node does (lsgd/__main__)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # as the node's handler ends it
    which = signal.SIGTERM if sys.argv[1] == "term" else signal.SIGINT
    reached, how = False, "nothing"
    p = mp.get_context("spawn").Process(target=sigint_child.survive)
    try:
        with children_ignore_sigint():
            os.kill(os.getpid(), which)  # as if it came while the child's data were written
            p.start()
            reached = True  # the start went on to its end
    except KeyboardInterrupt:
        how = "KeyboardInterrupt"
    except SystemExit as exc:
        how = f"exit {exc.code}"
    p.join(30)
    print(json.dumps({"reached": reached, "how": how, "child": p.exitcode,
                      "handler_back": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
"""


def test_a_signal_to_the_parent_during_a_start_is_handled_once_the_start_is_over():
    # Its handler used to run in the middle of the start: the child, already running, read
    # half of its preparation data and printed "EOFError: Ran out of input" (CI)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    for which, how in (("int", "KeyboardInterrupt"), ("term", "exit 143")):
        done = subprocess.run([sys.executable, "-c", PARENT, which], env=env,
                              capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout.splitlines()[-1])
        assert got == {"reached": True, "how": how, "child": 0, "handler_back": True}, got
        assert "Traceback" not in done.stderr, done.stderr
