"""Entry point of a worker process (started by the local server with the ``spawn`` context).

It imports the user's worker function (``module:function``), calls it with a ``Worker``, and
reports an exception to the local server as one line plus its traceback before exiting 1.
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys
import traceback
from typing import Callable

from ..local_server import messages as m
from .client import LocalServerGone, Worker, WorkerContext

log = logging.getLogger(__name__)


def load_entry(entry: str) -> Callable[[Worker], None]:
    """Import ``package.module:function``; raise ValueError with a clear message if missing."""
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entry '{entry}': cannot import {module_name}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"entry '{entry}': {module_name} has no function {func_name}")
    return fn


def worker_main(ctx: WorkerContext, log_level: int) -> None:
    """Run one worker; exits the process with 0 on success, 1 on failure."""
    # Ctrl-C reaches the whole process group; the local server decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s worker {ctx.config.worker_id(ctx.local_index)} "
                               "%(levelname)s %(message)s")
    worker = Worker(ctx)
    try:
        entry = load_entry(ctx.config.entry)
    except ValueError as exc:  # a configuration error: one line, no traceback
        ctx.inbox.put(m.Failed(ctx.local_index, str(exc)))
        sys.exit(1)
    try:
        entry(worker)
        worker.close()
    except LocalServerGone as exc:
        log.error("%s; exiting", exc)
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - reported to the local server, then exit 1
        ctx.inbox.put(m.Failed(ctx.local_index, f"{type(exc).__name__}: {exc}",
                               traceback.format_exc()))
        worker.close()
        sys.exit(1)
    sys.exit(0)
