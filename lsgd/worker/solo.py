"""The stand-in worker that ``lsgd.connect()`` returns outside ``train.sh``, and the checks of
the user's calls that it shares with the real worker (``client.py``), so that a quick local run
refuses the same mistakes: ``step()`` before ``register()``, registering twice, a loss that is
not one number, a per-step scalar (``step(loss, grad_norm=g)``) that is not one number.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..config import JobConfig
from . import scalars as worker_scalars
from .adapters import ParamAdapter, as_params
from .scalars_window import grad_norm_source, scalar_value


class SoloWorker:
    """What ``connect()`` returns outside lsgd: the script trains alone, unchanged.

    It checks the registered parameters (so mistakes show up in a quick local run) and lets the
    loop run until its own end.
    """

    is_evaluator = False
    local_index = worker_id = 0
    num_workers = 1

    def __init__(self) -> None:
        self.config = JobConfig()
        self.iterations = 0
        self._params: ParamAdapter | None = None
        self._checked: set[str] = set()  # per-step scalars whose first value was checked
        self._scalars = worker_scalars.for_solo(self.config.run_dir, lambda: self.iterations)

    def register(self, params: Any, evaluate: Callable[[], dict[str, float]] | None = None, *,
                 buffers: str = "local", state: Any = None, grad_norm: bool | None = None) -> None:
        check_register(self._params)
        self._params = as_params(params, buffers=buffers)
        grad_norm_source(self._params, grad_norm, False)  # the same checks; no rule reads it

    def shard(self, *arrays: Any, mode: str | None = None) -> Any:
        return arrays[0] if len(arrays) == 1 else arrays

    def step(self, loss: float, **scalars: Any) -> bool:
        check_step(self._params)
        loss_value(loss)
        for name, value in scalars.items():  # the first value of each (a job: at rounds)
            if name not in self._checked:
                scalar_value(name, value)
                self._checked.add(name)
        self.iterations += 1
        return True

    def wants(self, name: str) -> bool:
        """No rule runs outside a job: no per-step scalar is needed."""
        return False

    rule_scalars: tuple[str, ...] = ()

    def log(self, scalars: Mapping[str, float], step: int | None = None) -> None:
        """As ``Worker.log``; with ``TENSORBOARD=1`` the events go to
        ``RUN_DIR/tensorboard/solo/``."""
        self._scalars.log(scalars, step)

    def on_log(self, fn: worker_scalars.LogFn) -> worker_scalars.LogFn:
        return self._scalars.on_log(fn)

    @property
    def registered(self) -> bool:
        return self._params is not None

    def close(self) -> None:
        self._scalars.close()


def check_register(registered: ParamAdapter | None) -> None:
    if registered is not None:
        raise RuntimeError("register() may be called once")


def check_step(registered: ParamAdapter | None) -> None:
    if registered is None:
        raise RuntimeError("call register() before step()")


def loss_value(loss: Any) -> Any:
    """The minibatch loss as ``step()`` keeps it: a float, or a detached one-element framework
    tensor (read only at rounds, so a GPU loss costs no synchronisation per step).

    Raises:
        ValueError: anything but one number (checked at the step, not at the next round).
    """
    if isinstance(loss, float):
        return loss
    if hasattr(loss, "detach"):  # a framework tensor
        if loss.numel() != 1:
            raise ValueError(f"step() takes the minibatch loss, a scalar; got a tensor of "
                             f"shape {tuple(loss.shape)}")
        return loss.detach()
    try:
        return float(loss)  # numbers, numpy scalars, 0-d arrays
    except TypeError:
        arr = np.asarray(loss)  # a one-element array, like a one-element tensor
        if arr.size != 1 or not np.issubdtype(arr.dtype, np.number):
            raise ValueError(f"step() takes the minibatch loss, a scalar; got "
                             f"{type(loss).__name__} of shape {arr.shape}") from None
        return float(arr.reshape(-1)[0])
