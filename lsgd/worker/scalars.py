"""``worker.log(scalars)``: the training loop's own numbers, next to lsgd's.

Both the real worker (``client.py``) and its stand-in outside lsgd (``solo.py``) keep a
``ScalarLog``. Each ``log({"train/accuracy": 0.91})`` call:

- with ``TENSORBOARD=1``, writes the scalars to ``RUN_DIR/tensorboard/worker<id>/`` (the writer
  is created at the first call, in the worker's process, and writes from a thread of its own);
- always calls every function registered with ``on_log(fn)`` as ``fn(scalars, step)``, so that
  a W&B or MLflow user routes the same numbers to their tracker::

      worker.on_log(lambda scalars, step: wandb.log(scalars, step=step))
      worker.on_log(lambda scalars, step: mlflow.log_metrics(scalars, step=step))

The step defaults to the worker's own iteration count. Nothing here runs in ``worker.step()``.
"""

from __future__ import annotations

import atexit
import numbers
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config import JobConfig
from ..tensorboard import EventWriter, board_dir

LogFn = Callable[[dict[str, float], int], Any]


class ScalarLog:
    """Checks and routes one worker's ``log()`` calls.

    Args:
        logdir: where TensorBoard event files go; None: no TensorBoard (callbacks only).
        default_step: the step of a call that gives none (the worker's iteration count).
    """

    def __init__(self, logdir: Path | None, default_step: Callable[[], int]) -> None:
        self.logdir = logdir
        self._default_step = default_step
        self._callbacks: list[LogFn] = []
        self._writer: EventWriter | None = None

    def on_log(self, fn: LogFn) -> LogFn:
        """Call ``fn(scalars, step)`` at every ``log()``; returns ``fn`` (usable as a decorator).

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"on_log() takes a function fn(scalars, step), got {type(fn).__name__}")
        self._callbacks.append(fn)
        return fn

    def log(self, scalars: Mapping[str, Any], step: int | None = None) -> None:
        """Check ``scalars``, write them (TensorBoard) and hand them to the callbacks.

        Raises:
            TypeError: not a mapping, a name that is not a string, a value that is not one
                number, a step that is not an integer.
            ValueError: an empty name, a negative step.
        """
        values = check_scalars(scalars)
        if step is None:
            step = self._default_step()
        elif isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"log(): step must be an integer, got {type(step).__name__}")
        elif step < 0:
            raise ValueError(f"log(): step must be >= 0, got {step}")
        step = int(step)
        if self.logdir is not None and values:
            if self._writer is None:
                self._writer = EventWriter(self.logdir)
                atexit.register(self.close)  # a loop that never reaches close()
            self._writer.add([(name, value, step) for name, value in values.items()])
        for fn in list(self._callbacks):
            fn(dict(values), step)

    def close(self) -> None:
        """Flush and close the event file (bounded wait; safe to call twice)."""
        if self._writer is not None:
            self._writer.close()


def for_worker(config: JobConfig, name: str, default_step: Callable[[], int]) -> ScalarLog:
    """The log of a worker process of a job: ``RUN_DIR/tensorboard/<name>/`` with
    ``TENSORBOARD=1``."""
    return ScalarLog(board_dir(config.run_dir, name) if config.tensorboard else None, default_step)


def for_solo(run_dir: str, default_step: Callable[[], int],
             environ: Mapping[str, str] = os.environ) -> ScalarLog:
    """The log of a script run alone (``python my_script.py``): the same knobs as a job,
    read from the environment, ``TENSORBOARD=1`` and ``RUN_DIR`` (default ``run_dir``); the
    events go to ``RUN_DIR/tensorboard/solo/``."""
    on = environ.get("TENSORBOARD", "").strip().lower() in ("1", "true", "yes", "on")
    where = environ.get("RUN_DIR", "").strip() or run_dir
    return ScalarLog(board_dir(where, "solo") if on else None, default_step)


def check_scalars(scalars: Any) -> dict[str, float]:
    """``{name: value}`` as floats; raises TypeError/ValueError naming the first bad entry."""
    if not isinstance(scalars, Mapping):
        raise TypeError(f"log() takes a dict of name -> number, got {type(scalars).__name__}")
    values: dict[str, float] = {}
    for name, value in scalars.items():
        if not isinstance(name, str):
            raise TypeError(f"log(): scalar names must be strings, got {name!r} "
                            f"({type(name).__name__})")
        if not name.strip():
            raise ValueError("log(): a scalar name is empty")
        values[name] = _number(name, value)
    return values


def _number(name: str, value: Any) -> float:
    """One number: a Python or numpy number, or a one-element array or tensor."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError(f"log(): '{name}' must be a number, got {type(value).__name__}")
    if isinstance(value, numbers.Real):
        return float(value)
    size = getattr(value, "size", None)  # numpy arrays: an attribute; torch tensors: a method
    count = value.numel() if hasattr(value, "numel") else size
    if count == 1:
        try:
            return float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"log(): '{name}' must be one number, got {type(value).__name__}"
                    + (f" of {count} elements" if isinstance(count, int) else ""))


__all__ = ["ScalarLog", "check_scalars", "for_solo", "for_worker"]
