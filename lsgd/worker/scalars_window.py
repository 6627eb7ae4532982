"""Per-step scalars a rule asks for (``Rule.scalars``), from the training loop to its rounds.

The loop gives them to ``step()`` as keyword arguments, ``worker.step(loss, grad_norm=g)``.
``step()`` only keeps the latest value of each (one dict update; a float, a numpy scalar or a
framework tensor is kept as given and read at the next round, so a GPU value costs no
synchronisation per step; None stands for no value). PyTorch users need not compute the gradient norm: with
``register(model)`` the worker reads it from the parameters' ``.grad`` at each round when the
job's rule asks for ``grad_norm`` (``grad_norm=False`` turns that off, ``True`` insists).

At each round the worker takes part in, ``ScalarsWindow.read()`` folds the value of each scalar
the rule names into an exponential moving average with bias correction, as GRAWA's code does
with its gradient norms (momentum ``mu = Rule.scalar_momentum``, ``0.9 ** 8 ~ 0.43`` by default)::

    m_k = mu * m_(k-1) + (1 - mu) * v_k          estimate_k = m_k / (1 - mu ** k)

where ``k`` counts the values folded in so far. ``v_k`` is the value at the round (the last
minibatch's, or the hook's), one estimate per round like GRAWA's one-batch estimate, rather
than a mean of every step since the last round: the per-step cost stays a dict update, and a
tensor is read once per round. A value that is not finite is left out (logged once); a scalar
with no finite value yet is absent from the round's ``Join``, and the local server warns once
that the rule falls back to its default (GRAWA: weight 1, plain averaging).
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Callable, Mapping, Sequence

log = logging.getLogger(__name__)

GRAD_NORM = "grad_norm"
MOMENTUM = 0.9 ** 8  # GRAWA's (inherited from EASGD's code), ~0.43
NO_GRAD = ("register(): the parameters have no gradients at this round (.grad is None), so "
           "no grad_norm was read; call worker.step() after loss.backward() and before "
           "optimizer.zero_grad(), or pass it yourself: worker.step(loss, grad_norm=g)")

Source = Callable[[], Any]  # read at a round when the loop gave no value since the last one


class ScalarsWindow:
    """One worker's per-step scalars: the latest values, and their averages across rounds.

    Args:
        names: the scalars the rule uses (``Rule.scalars``); others given to ``step()`` are
            kept until the next round and then dropped.
        momentum: ``mu`` of the moving average, in [0, 1) (0: the latest value).
        sources: name -> function read at a round when the loop gave that scalar no value
            since the last round (the PyTorch ``.grad`` hook); it may return None.
    """

    def __init__(self, names: Sequence[str] = (), momentum: float = MOMENTUM,
                 sources: Mapping[str, Source] | None = None) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"scalar momentum must be in [0, 1), got {momentum}")
        self.names = tuple(names)
        self.momentum = float(momentum)
        self.sources = dict(sources or {})
        self.latest: dict[str, Any] = {}  # step() updates it: name -> value as given
        self._avg = dict.fromkeys(self.names, 0.0)
        self._count = dict.fromkeys(self.names, 0)
        self._warned: set[str] = set()

    def read(self, stepped: bool = True) -> dict[str, float]:
        """At a round: fold the latest values into the averages; return the estimates of the
        scalars that have one (name -> bias-corrected average).

        Args:
            stepped: steps were taken since the last round (a source that finds no value
                then is worth a warning).

        Raises:
            TypeError: a value that is not one number (names the scalar).
        """
        given, self.latest = self.latest, {}
        estimates: dict[str, float] = {}
        for name in self.names:
            value = given.get(name)
            if value is None and name in self.sources:
                value = self.sources[name]()
                if value is None and stepped:
                    self._warn_once(f"source:{name}", NO_GRAD if name == GRAD_NORM else
                                    f"register(): no value of '{name}' at this round")
            if value is not None:
                self._fold(name, scalar_value(name, value))
            if self._count[name]:
                estimates[name] = self._avg[name] / (1.0 - self.momentum ** self._count[name])
        return estimates

    def reset(self) -> None:
        """Forget the averages (the worker was reset to another model)."""
        self.latest.clear()
        self._avg = dict.fromkeys(self.names, 0.0)
        self._count = dict.fromkeys(self.names, 0)

    def _fold(self, name: str, value: float) -> None:
        avg = self.momentum * self._avg[name] + (1.0 - self.momentum) * value
        if not (math.isfinite(value) and math.isfinite(avg)):
            self._warn_once(f"finite:{name}", f"step(): a non-finite {name} ({value!r}) was left "
                            "out of this worker's moving average (later finite values are used)")
            return
        self._avg[name] = avg
        self._count[name] += 1

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)


def scalar_value(name: str, value: Any) -> float:
    """One number as a float: a Python or numpy number, a one-element array or tensor.

    Raises:
        TypeError: anything else (the message names the scalar).
    """
    if isinstance(value, float):
        return value
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError(f"step(): scalar '{name}' must be a number, got {type(value).__name__}")
    if isinstance(value, numbers.Real):
        return float(value)
    count = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)
    if count == 1 and hasattr(value, "item"):
        try:
            return float(value.item())
        except (TypeError, ValueError):
            pass
    raise TypeError(f"step(): scalar '{name}' must be one number, got {type(value).__name__}"
                    + (f" of {count} elements" if isinstance(count, int) else ""))


def grad_norm_source(params: Any, grad_norm: bool | None, wanted: bool) -> Source | None:
    """The ``register(..., grad_norm=...)`` hook: the adapter's ``.grad`` reader, or None.

    Args:
        params: the registered adapter (``TorchParams`` has ``grad_norm()``).
        grad_norm: None (default): read it when the rule wants it and the adapter can;
            True: the same, and an adapter that cannot is an error; False: never.
        wanted: the job's rule uses ``grad_norm``.

    Raises:
        TypeError: ``grad_norm`` is not a bool or None, or True for an adapter with no
            ``.grad`` to read.
    """
    if grad_norm is not None and not isinstance(grad_norm, bool):
        raise TypeError(f"register(): grad_norm must be True, False or None, got {grad_norm!r}")
    reader = getattr(params, "grad_norm", None)
    if grad_norm and not callable(reader):
        raise TypeError("register(grad_norm=True) reads the gradients (.grad) of PyTorch "
                        "parameters; with other frameworks pass the norm yourself: "
                        "worker.step(loss, grad_norm=g)")
    if grad_norm is False or not wanted or not callable(reader):
        return None
    return reader


__all__ = ["GRAD_NORM", "MOMENTUM", "ScalarsWindow", "grad_norm_source", "scalar_value"]
