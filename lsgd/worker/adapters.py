"""Parameter adapters: copy a model's parameters to and from one flat float32 vector.

A round copies the model into the worker's shared-memory slot (``read_into``), pulls the slot
in place, and copies it back (``write_from``). Both directions copy into existing storage, so a
round allocates nothing proportional to the model.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class ParamAdapter(Protocol):
    """What the worker needs from a model's parameters."""

    param_count: int

    def read_into(self, flat: np.ndarray) -> None:
        """Copy the model's parameters into ``flat``."""

    def write_from(self, flat: np.ndarray) -> None:
        """Overwrite the model's parameters with ``flat``."""


class _Segments:
    """Shared bookkeeping: the (offset, size, shape) of each tensor in the flat vector."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.spans: list[tuple[int, int, tuple[int, ...]]] = []
        pos = 0
        for shape in shapes:
            size = int(np.prod(shape, dtype=np.int64))
            self.spans.append((pos, size, tuple(shape)))
            pos += size
        self.param_count = pos


class NumpyParams(_Segments):
    """A list of float32 numpy arrays, updated in place."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise TypeError(f"parameter {i} must be a float32 numpy array, got "
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
            np.copyto(a, flat[pos : pos + size].reshape(shape))


class PyTensorParams(_Segments):
    """A list of PyTensor (Theano-style) shared variables holding float32 arrays.

    The variables' storage is updated in place (``get_value(borrow=True)``), so compiled
    functions see the new values without a ``set_value`` copy.
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        values = []
        for i, v in enumerate(variables):
            val = v.get_value(borrow=True, return_internal_type=True)
            if not isinstance(val, np.ndarray) or val.dtype != np.float32:
                raise TypeError(f"shared variable {i} ({v.name}) must hold a float32 array, got "
                                f"{getattr(val, 'dtype', type(val).__name__)}")
            values.append(val)
        super().__init__([val.shape for val in values])
        self.variables = list(variables)

    def _storage(self, v: Any) -> np.ndarray:
        # Compiled updates may swap the storage array; fetch it at every copy.
        return v.get_value(borrow=True, return_internal_type=True)

    def read_into(self, flat: np.ndarray) -> None:
        for (pos, size, _), v in zip(self.spans, self.variables):
            flat[pos : pos + size] = self._storage(v).reshape(-1)

    def write_from(self, flat: np.ndarray) -> None:
        for (pos, size, shape), v in zip(self.spans, self.variables):
            np.copyto(self._storage(v), flat[pos : pos + size].reshape(shape))


def as_params(params: Any) -> ParamAdapter:
    """Wrap ``params`` (an adapter, numpy arrays or PyTensor shared variables) in an adapter."""
    if hasattr(params, "read_into") and hasattr(params, "write_from"):
        return params
    items = list(params)
    if not items:
        raise ValueError("no parameters to register")
    if all(isinstance(p, np.ndarray) for p in items):
        return NumpyParams(items)
    if all(hasattr(p, "get_value") and hasattr(p, "set_value") for p in items):
        return PyTensorParams(items)
    raise TypeError("register() takes a list of float32 numpy arrays, a list of PyTensor shared "
                    "variables, or a ParamAdapter")
