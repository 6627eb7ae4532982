"""Worker processes and the processes they start.

Workers are started non-daemonic, so that the user's code can start processes of its own
(PyTorch ``DataLoader(num_workers=...)``, ``multiprocessing.Pool``): Python refuses children to
a daemonic process. What ``daemon=True`` gave is kept by other means, for the whole tree:

- Each worker leads a process group of its own (``lead_own_group``, first thing in the worker
  process), which the processes it starts inherit. When a worker dies or the node shuts down,
  the node ends the worker's group (``end_group``), so a Pool or DataLoader worker never
  outlives its worker, even when the worker was SIGKILLed (its children cannot be found from
  its pid once it is gone; its group can).
- A worker watches its parent from a thread; when the local server is gone (SIGKILL, crash),
  it ends its own group at once, whatever the training loop is doing.
- At interpreter exit, ``multiprocessing`` joins non-daemonic children without a timeout; a
  handler that runs before it kills any worker still alive, so the node never waits there
  (e.g. after a second Ctrl-C cut its shutdown short).

A process group, not ``PR_SET_PDEATHSIG``: that signal reaches only the direct child and is not
inherited by the processes the worker forks, and a new session (``setsid``) would take the
workers out of the node's session, where ``kill`` and job control find them. A process that
the user's code puts in a group or session of its own (``start_new_session=True``) is its own.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.process
import multiprocessing.util  # registers its exit handler (joins children) before ours below
import os
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger("lsgd.local_server.server")

WATCH = 0.25  # seconds between a worker's checks that its local server is alive

_started: list[mp.process.BaseProcess] = []  # every worker process this node started


_LAUNCHER = """#!/bin/sh
# Written by lsgd (lsgd/local_server/procs.py) and removed when the node exits: starts a process
# of the node (the global server, a worker) with SIGINT ignored from its first instruction.
trap '' INT
exec {python} "$@"
"""
_launcher_lock = threading.Lock()
_launcher: list[str] = []  # the launcher's path once written ("" where none can be used)


def ignore_sigint_in_children() -> None:
    """From now on, the processes this node spawns start with SIGINT ignored.

    Ctrl-C reaches the node's whole process group, and one arriving while a child was still
    starting (Python's own imports, before it could ignore it) ended that child with a
    ``KeyboardInterrupt`` traceback; the node decides how its children stop. An ignored signal
    stays ignored across exec, so ``multiprocessing`` starts them through a two-line ``/bin/sh``
    launcher that ignores SIGINT, then execs Python. This process's own handling of SIGINT is
    never touched: setting it to ignored around each start lost a Ctrl-C that came meanwhile
    (any other thread took it and dropped it), and the node then trained on.

    Where the temporary directory is mounted ``noexec`` (or there is no ``/bin/sh``), children
    start as before and ignore SIGINT from their first import of lsgd (``lsgd/__init__.py``).
    """
    import multiprocessing.spawn as spawn

    with _launcher_lock:
        if not _launcher:
            _launcher.append(_write_launcher(spawn.get_executable()))
        if _launcher[0] and os.fsdecode(spawn.get_executable()) != _launcher[0]:
            spawn.set_executable(_launcher[0])


def _write_launcher(python: str) -> str:
    import shlex
    import shutil
    import tempfile

    if not os.path.exists("/bin/sh"):
        return ""
    try:
        folder = tempfile.mkdtemp(prefix="lsgd-launch-")
    except OSError:
        return ""
    atexit.register(shutil.rmtree, folder, True)
    if os.statvfs(folder).f_flag & os.ST_NOEXEC:
        return ""
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(_LAUNCHER.format(python=shlex.quote(os.fsdecode(python))))
    os.chmod(path, 0o700)
    return path


def start_process(ctx: Any, target: Callable, args: tuple, name: str) -> mp.process.BaseProcess:
    """Start a worker process (non-daemonic; see the module doc)."""
    proc = ctx.Process(target=target, args=args, name=name, daemon=False)
    ignore_sigint_in_children()
    proc.start()
    _started[:] = [p for p in _started if p.exitcode is None] + [proc]
    return proc


def end_group(pid: int) -> None:
    """SIGKILL what is left of the process group worker ``pid`` leads (the processes it started).

    Called right after the worker's exit was seen, so ``pid`` cannot have been reused yet (a
    group id stays taken while the group has a member). A worker that never got to lead its
    group has none: nothing happens.
    """
    if not pid or pid <= 1 or pid == os.getpgrp():  # killpg(0) is our own group: never that
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: mp.process.BaseProcess, grace: float) -> None:
    """Terminate, then kill, a worker that did not stop by itself; then end its group."""
    if proc.exitcode is None:
        proc.terminate()
        proc.join(grace)
    if proc.exitcode is None:
        proc.kill()
        proc.join(grace)
    end_group(proc.pid)
    if proc.exitcode is None:  # not even SIGKILL took it (uninterruptible sleep): never join it
        log.error("%s (pid %d) survived SIGKILL; leaving it", proc.name, proc.pid)
        multiprocessing.process._children.discard(proc)


@atexit.register  # registered after multiprocessing's own handler, so it runs before it
def _end_leftovers() -> None:
    for proc in _started:
        if proc.exitcode is None:
            stop_process(proc, 1.0)


# ---------------------------------------------------------------- in the worker process


def lead_own_group(parent_pid: int) -> None:
    """Make this worker the leader of a new process group and end the group with the parent."""
    try:
        os.setpgid(0, 0)
    except OSError as exc:  # the node then cannot end what this worker starts, only the worker
        log.warning("worker %d: cannot lead a process group of its own: %s", os.getpid(), exc)
    else:
        # Now a background group of the terminal: writing to it must not stop us (``stty tostop``).
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="lsgd-parent-watch",
                     daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH)
    try:  # not through sys.stderr, whose lock the training loop may hold
        os.write(2, f"lsgd worker {os.getpid()}: the local server is gone; ending this worker "
                    "and the processes it started\n".encode())
    finally:
        end_own_group()


def end_own_group() -> None:
    """SIGKILL this worker and the processes it started (its local server is gone)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # leading no group of our own: only ourselves
