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
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.process
import multiprocessing.util  # registers its exit handler (joins children) before ours below
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger("lsgd.local_server.server")

WATCH = 0.25  # seconds between a worker's checks that its local server is alive

_started: list[mp.process.BaseProcess] = []  # every worker process this node started


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Start child processes (the global server, workers) with a Ctrl-C held until they ignore
    it. Ctrl-C reaches the node's whole process group; the node decides how its children stop,
    and one arriving while a child was still starting (Python's own imports) ended that child,
    with a ``KeyboardInterrupt`` traceback.

    SIGINT is blocked in the calling thread only, while it starts them. A child inherits the
    mask across fork and exec, so a Ctrl-C stays pending in it through Python's start-up until
    ``lsgd/__init__.py`` sets SIGINT to ignored (which drops it) and unblocks it.

    This process's handlers of SIGINT and SIGTERM are held too, in the main thread (the only
    one that runs them): a signal that comes meanwhile (another thread takes it) is handled
    right after, never lost. Run in the middle of a start, the handler's ``KeyboardInterrupt``
    cut the start short while it wrote the child's preparation data: the child, already
    running, printed ``EOFError: Ran out of input`` with a traceback (CI). (Setting SIGINT to
    ignored around each start instead lost a Ctrl-C that came then, and the node trained on.)
    ``multiprocessing``'s resource tracker is started first: its own start unblocks SIGINT in
    the calling thread instead of restoring the mask.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    held: dict[int, Any] = {}
    came: list[tuple[int, Any]] = []
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # read only: nothing to undo yet
    try:  # (a Ctrl-C may end the call below once SIGINT is blocked: the mask is restored)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(sig)
                if callable(handler) or handler == signal.SIG_DFL:
                    held[sig] = handler
                    signal.signal(sig, lambda signum, frame: came.append((signum, frame)))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for signum, frame in came[:1]:  # the first one decides (a second does as it would)
            handler = held[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # the default action, as it would have been
                os.kill(os.getpid(), signum)


def start_process(ctx: Any, target: Callable, args: tuple, name: str) -> mp.process.BaseProcess:
    """Start a worker process (non-daemonic; see the module doc)."""
    proc = ctx.Process(target=target, args=args, name=name, daemon=False)
    try:
        with children_ignore_sigint():
            proc.start()
    finally:  # a Ctrl-C may end start() once the child runs: it is still ours to stop
        if getattr(proc, "_popen", None) is not None:
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
