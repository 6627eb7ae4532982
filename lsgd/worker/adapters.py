"""Parameter adapters: copy a model's parameters to and from one flat float32 vector.

A round copies the model into the worker's shared-memory slot (``read_into``), pulls the slot
in place, and copies it back (``write_from``). Both directions copy into existing storage, so a
round allocates nothing proportional to the model.

The flat vector has two parts: the first ``param_count - stats_count`` entries are the trained
parameters, which the rule pulls toward the leader or the center; the last ``stats_count``
entries are running statistics (PyTorch batch-norm buffers), which are never pulled. They
travel with the parameters, so an evaluated leader, average or center carries statistics of its
own; with ``average_stats`` they are also set to their mean over each round's participants on
the node. Integer tensors (counters) never enter the vector.

An adapter may do more of a round itself: the PyTorch adapter of a GPU model page-locks the
node's shared memory (``pin`` / ``unpin``) and pulls the model on its GPU (``can_pull`` /
``pull_toward``, ``torch_pinned.py``); the worker uses these where they exist.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class ParamAdapter(Protocol):
    """What the worker needs from a model's parameters."""

    param_count: int  # length of the flat vector
    stats_count: int  # trailing entries never pulled (0: none)
    average_stats: bool  # the node averages them over each round's participants

    def read_into(self, flat: np.ndarray) -> None:
        """Copy the model's parameters into ``flat``."""

    def write_from(self, flat: np.ndarray) -> None:
        """Overwrite the model's parameters with ``flat``."""


class _Segments:
    """Shared bookkeeping: the (offset, size, shape) of each tensor in the flat vector."""

    stats_count = 0
    average_stats = False

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.spans: list[tuple[int, int, tuple[int, ...]]] = []
        pos = 0
        for shape in shapes:
            size = int(np.prod(shape, dtype=np.int64))
            self.spans.append((pos, size, tuple(shape)))
            pos += size
        self.param_count = pos


def _exchanged(dtype: np.dtype) -> bool:
    """Floating-point arrays are exchanged; integer and boolean ones stay with their worker."""
    return np.issubdtype(dtype, np.floating)


class NumpyParams(_Segments):
    """A list of floating-point numpy arrays, updated in place.

    float32 is exchanged exactly; other float types travel (and are pulled) as float32.
    """

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or not _exchanged(a.dtype):
                raise TypeError(f"parameter {i} must be a floating-point numpy array, got "
                                f"{type(a).__name__} {getattr(a, 'dtype', '')}")
            if not a.flags.writeable:
                raise ValueError(f"parameter {i} is read-only")
        super().__init__([a.shape for a in arrays])
        self.arrays = list(arrays)

    def read_into(self, flat: np.ndarray) -> None:
        for (pos, size, _), a in zip(self.spans, self.arrays):
            flat[pos : pos + size] = a.reshape(-1)

    def write_from(self, flat: np.ndarray) -> None:
        for (pos, size, shape), a in zip(self.spans, self.arrays):
            np.copyto(a, flat[pos : pos + size].reshape(shape), casting="unsafe")


class PyTensorParams(_Segments):
    """A list of PyTensor (Theano-style) shared variables.

    Floating-point variables are exchanged: float32 exactly, float64 (and float16) converted to
    float32 on the way out and back, so a pull computes in float32 while a variable no pull
    touches keeps its full precision. Integer and boolean variables (step counters, masks) are
    never pulled: they stay as each worker has them. ``keep`` names further variables (or
    their names) that stay per worker.

    The variables' storage is updated in place (``get_value(borrow=True)``), so compiled
    functions see the new values without a ``set_value`` copy.
    """

    def __init__(self, variables: Sequence[Any], keep: Sequence[Any] = ()) -> None:
        keep_ids = {id(k) for k in keep} | {k for k in keep if isinstance(k, str)}
        chosen, shapes = [], []
        for i, v in enumerate(variables):
            val = v.get_value(borrow=True, return_internal_type=True)
            if not isinstance(val, np.ndarray):
                raise TypeError(f"shared variable {i} ({v.name}) must hold a numpy array, got "
                                f"{type(val).__name__}")
            if id(v) in keep_ids or v.name in keep_ids or not _exchanged(val.dtype):
                continue
            chosen.append(v)
            shapes.append(val.shape)
        if not chosen:
            raise ValueError("no floating-point shared variable to exchange among those registered")
        super().__init__(shapes)
        self.variables = chosen

    def _storage(self, v: Any) -> np.ndarray:
        # Compiled updates may swap the storage array; fetch it at every copy.
        return v.get_value(borrow=True, return_internal_type=True)

    def read_into(self, flat: np.ndarray) -> None:
        for (pos, size, _), v in zip(self.spans, self.variables):
            flat[pos : pos + size] = self._storage(v).reshape(-1)

    def write_from(self, flat: np.ndarray) -> None:
        for (pos, size, shape), v in zip(self.spans, self.variables):
            np.copyto(self._storage(v), flat[pos : pos + size].reshape(shape), casting="unsafe")


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" or any(
        c.__module__.startswith("torch.") for c in type(obj).__mro__)


def as_params(params: Any, buffers: str = "local") -> ParamAdapter:
    """Wrap ``params`` in an adapter.

    Accepts an adapter, a list of numpy arrays, a list of PyTensor shared variables, or (with
    PyTorch installed) an ``nn.Module`` or a list of tensors. ``buffers`` applies to a PyTorch
    module's floating-point buffers (batch-norm statistics), which are never pulled: ``"local"``
    keeps each worker's own, ``"average"`` averages them over each round's participants on the
    node.
    """
    if hasattr(params, "read_into") and hasattr(params, "write_from"):
        return params
    if buffers not in ("local", "average"):
        raise ValueError(f"buffers must be 'local' or 'average', got {buffers!r}")
    if _is_torch(params):
        from .torch_params import TorchParams

        return TorchParams(params, buffers=buffers)
    items = list(params)
    if not items:
        raise ValueError("no parameters to register")
    if buffers != "local" and not _is_torch(items[0]):
        raise ValueError("buffers='average' applies to a PyTorch nn.Module only")
    if all(isinstance(p, np.ndarray) for p in items):
        return NumpyParams(items)
    if all(hasattr(p, "get_value") and hasattr(p, "set_value") for p in items):
        return PyTensorParams(items)
    if all(_is_torch(p) for p in items):
        from .torch_params import TorchParams

        return TorchParams(items, buffers=buffers)
    raise TypeError("register() takes a list of numpy arrays, a list of PyTensor shared "
                    "variables, a PyTorch nn.Module or list of tensors, or a ParamAdapter")
