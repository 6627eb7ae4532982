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

import ast
import atexit
import gc
import importlib
import importlib.machinery
import importlib.util
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
from ..lograte import log_format
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


def check_entry(entry: str) -> str | None:
    """Why ``entry`` (``module:function``) cannot run, found before any worker starts; None
    when it may.

    Runs none of the user's code: the module is looked up on ``sys.path`` package by package without importing anything, and its source
    is parsed (``ast``) for a top-level name ``function``. What this cannot rule out (a module
    without Python source, a star import, a module ``__getattr__``, names made at run time)
    is accepted, and ``load_entry`` in the worker has the last word.
    """
    if is_script(entry):
        return None  # JobConfig checked that the script exists
    module_name, _, func_name = entry.partition(":")
    spec = _find_module(module_name)
    if spec is None:
        return f"ENTRY '{entry}': no module named '{module_name}' (check ENTRY and PYTHONPATH)"
    names = _top_level_names(spec)
    if names is not None and func_name not in names:
        return f"ENTRY '{entry}': {module_name} has no function {func_name}"
    return None


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of module ``name``, found without importing it or its packages (None: none)."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None) or importlib.machinery.ModuleSpec(name, None)
    spec = None
    path = None
    parts = name.split(".")
    for i in range(len(parts)):
        if spec is not None and spec.submodule_search_locations is None:
            return None  # a module, not a package, has no submodules
        try:
            spec = (importlib.util.find_spec(parts[0]) if i == 0 else
                    importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path))
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    return spec


def _top_level_names(spec: importlib.machinery.ModuleSpec) -> set[str] | None:
    """Names bound at the top level of the module's source; None when that cannot be told."""
    if not spec.origin or not spec.origin.endswith(".py") or not os.path.isfile(spec.origin):
        return None
    try:
        with open(spec.origin, "rb") as f:
            tree = ast.parse(f.read(), spec.origin)
    except (OSError, SyntaxError, ValueError):
        return None  # the worker's import reports it with its traceback
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # names inside are not the module's
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Name):
                if child.id in ("globals", "setattr", "exec", "vars"):
                    return None  # names made at run time
                if isinstance(child.ctx, ast.Store):
                    names.add(child.id)
            elif isinstance(child, ast.Attribute) and child.attr == "modules":
                return None  # sys.modules[__name__] = ...: anything goes
            elif not isinstance(child, ast.Lambda):
                todo.append(child)
    return None if "__getattr__" in names else names


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
    # Exit fast: at exit, leave every object to the process's end instead of the interpreter's
    # final garbage collections, which with PyTorch loaded cost ~1 s of CPU per process (several
    # seconds with a node's workers ending at once on a busy machine; the node allows 5 s).
    # Registered first, so it runs after the user's own exit handlers.
    atexit.register(gc.freeze)
    lead_own_group(ctx.parent_pid)
    if ctx.gpu is not None:  # before the user's code can start CUDA (local_server/gpus.py)
        os.environ["CUDA_VISIBLE_DEVICES"] = ctx.gpu
    who = "evaluator" if ctx.evaluator else f"worker {ctx.config.worker_id(ctx.local_index)}"
    logging.basicConfig(level=log_level, format=log_format(who))
    if log_level > logging.DEBUG:  # PyTensor's dozen "Suppressed KeyError" lines at import
        logging.getLogger("pytensor.configparser").setLevel(logging.WARNING)
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
        # told to stop before it could train (the node failed and said why): no second error
        (log.info if worker._stopped else log.error)("%s; exiting", exc)
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
