"""Entry point of a worker process (started by the local server with the ``spawn`` context).

It runs the user's code, in one of three forms (``ENTRY``):

- ``path/to/script.py [args]``: the script runs as ``__main__`` with those arguments, exactly
  as ``python path/to/script.py [args]`` would; it calls ``lsgd.connect()``.
- ``package.module:function`` where the function takes no argument: it calls ``lsgd.connect()``.
- ``package.module:function`` where the function takes one argument: it gets the worker.

An exception is reported to the local server as one line plus its traceback before exit 1.
The process leads a process group of its own, so that the processes the user's code starts
(DataLoader workers, a ``multiprocessing.Pool``) end with it (``local_server/procs.py``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import runpy
import shlex
import signal
import sys
import traceback
from typing import Callable

from ..config import is_script
from ..local_server import messages as m
from ..local_server.procs import end_own_group, lead_own_group
from . import client
from .client import EvaluatorDone, LocalServerGone, NotTraining, Worker, WorkerContext

log = logging.getLogger(__name__)


def load_entry(entry: str) -> Callable[[], None]:
    """Resolve ``entry`` to a callable that runs the user's code in this process.

    Raises ValueError with a clear message when the script or function cannot be found.
    """
    if is_script(entry):
        path, *args = shlex.split(entry)
        if not os.path.isfile(path):
            raise ValueError(f"entry script '{path}' not found (relative paths start in the "
                             f"directory train.sh runs in: {os.getcwd()})")

        def run_script() -> None:
            sys.argv = [path, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exc:  # a script's sys.exit(0) is a normal end
                if exc.code not in (None, 0):
                    raise RuntimeError(f"script {path} exited with status {exc.code}") from None

        return run_script
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entry '{entry}': cannot import {module_name}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"entry '{entry}': {module_name} has no function {func_name}")
    try:  # a required positional parameter receives the worker
        wants_worker = any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                           for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        wants_worker = True
    if wants_worker:
        return lambda: fn(client.connect())
    return fn


def _tell(ctx: WorkerContext, msg: object) -> None:
    """Send ``msg`` to the local server if it is still there."""
    try:
        ctx.inbox.put(msg)
    except OSError:
        pass


def _close(worker: Worker) -> None:
    try:
        worker.close()
    except LocalServerGone:
        pass


def worker_main(ctx: WorkerContext, log_level: int) -> None:
    """Run one worker (or the evaluator); exits the process with 0 on success, 1 on failure."""
    # Ctrl-C reaches the whole process group; the local server decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lead_own_group(ctx.parent_pid)
    who = "evaluator" if ctx.evaluator else f"worker {ctx.config.worker_id(ctx.local_index)}"
    logging.basicConfig(level=log_level, format=f"%(asctime)s {who} %(levelname)s %(message)s")
    worker = Worker(ctx)
    client._current = worker
    try:
        entry = load_entry(ctx.config.entry)
    except ValueError as exc:  # a configuration error: one line, no traceback
        _tell(ctx, m.Failed(ctx.local_index, str(exc), life=ctx.restarts))
        sys.exit(1)
    try:
        entry()
        if not worker.registered:
            raise RuntimeError(f"entry '{ctx.config.entry}' returned without registering the "
                               "model: call lsgd.connect() and worker.register(params)")
        worker.close()
    except EvaluatorDone:
        worker.close()
    except LocalServerGone as exc:
        log.error("%s; exiting", exc)
        if os.getppid() != ctx.parent_pid:  # dead, not stuck: nobody else will end our group
            end_own_group()
        sys.exit(1)
    except NotTraining as exc:  # the user's loop, not lsgd: one line naming the fix
        _tell(ctx, m.Failed(ctx.local_index, str(exc), life=ctx.restarts))
        _close(worker)
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - reported to the local server, then exit 1
        _tell(ctx, m.Failed(ctx.local_index, f"{type(exc).__name__}: {exc}",
                            traceback.format_exc(), life=ctx.restarts))
        _close(worker)
        sys.exit(1)
    sys.exit(0)
