"""PyTorch adapter (``pip install 'lsgd[torch]'``): an ``nn.Module`` or a list of tensors.

CPU tensors are copied straight between the model and the worker's shared-memory slot. CUDA
tensors are copied only at rounds, through one pinned host buffer allocated at registration and
reused: device -> pinned buffer (asynchronous copies, one synchronisation) -> slot, and back.
Training steps never touch the host.

Batch-norm running statistics (a module's floating-point buffers) are the vector's tail: never
pulled, but carried into the leader / average / center buffers, so that evaluating one of them
uses statistics that belong to it. Each worker keeps its own (``buffers="local"``, the default)
or they are set to their mean over each round's participants on the node
(``buffers="average"``). Integer buffers such as ``num_batches_tracked`` always stay per worker.
Optimizer state (momentum buffers, Adam moments) is not registered: it stays with the user's
optimizer, and keeps describing the worker's own trajectory after a pull.

The registered tensors are updated in place; a module whose tensor is replaced after
registration (``model.fc.weight = nn.Parameter(...)``) no longer trains what lsgd exchanges,
which ``replaced()`` reports at each round.

``grad_norm()`` is the gradient-norm hook of ``register(model, grad_norm=...)``: the L2 norm of
the parameters' ``.grad`` (the last ``backward()``), read at rounds only
(``lsgd/worker/scalars_window.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class TorchParams:
    """Adapter for a PyTorch module or parameter list (CPU or CUDA, any float dtype)."""

    def __init__(self, model: Any, buffers: str = "local") -> None:
        self._module: torch.nn.Module | None = None
        if isinstance(model, torch.nn.Module):
            params = list(model.parameters())
            stats = [b for b in model.buffers() if b.is_floating_point()]
            self._module, self._named = model, self._tensors_of(model)
        else:
            params, stats = list(model), []
            if buffers != "local":
                raise ValueError("buffers='average' needs an nn.Module (its buffers are the statistics)")
        seen: set[int] = set()
        unique = []
        for t in params:  # tied weights appear once
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        for i, t in enumerate(unique + stats):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"tensor {i} must be a floating-point torch tensor, got "
                                f"{type(t).__name__} {getattr(t, 'dtype', '')}")
        if not unique:
            raise ValueError("no parameters to register")
        self.tensors = unique + stats
        self._trained = unique  # what has gradients
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.spans: list[tuple[int, int]] = []
        pos = 0
        for t in self.tensors:
            self.spans.append((pos, t.numel()))
            pos += t.numel()
        self.param_count = pos
        self.stats_count = sum(t.numel() for t in stats)
        self.average_stats = buffers == "average" and self.stats_count > 0
        self._host: torch.Tensor | None = None
        self._slot: tuple[int, int, torch.Tensor] | None = None  # pin(): (address, size, view)
        if self.device.type == "cuda":  # pinned through the model's GPU, not cuda:0's context
            with torch.cuda.device(self.device):
                self._host = torch.empty(pos, dtype=torch.float32, pin_memory=True)

    @staticmethod
    def _tensors_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        named = dict(module.named_parameters())
        named.update((n, b) for n, b in module.named_buffers() if b.is_floating_point())
        return named

    def replaced(self) -> str | None:
        """Which of the module's tensors is no longer the one registered (None: none is)."""
        if self._module is None:
            return None
        for name, t in self._tensors_of(self._module).items():
            if self._named.get(name) is not t:
                return f"the model's tensor '{name}' was replaced after register()"
        return None

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor | None:
        """The L2 norm of the parameters' gradients (``.grad``) as a 0-d tensor on their
        device (read by the worker at rounds: ``register(model, grad_norm=...)``); None when
        no parameter has one."""
        norms = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g,
                                          dtype=torch.promote_types(g.dtype, torch.float32))
                 for g in (t.grad for t in self._trained) if g is not None]
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) if norms else None

    def _sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def pin(self, slot: np.ndarray) -> bool:
        """Page-lock the worker's shared-memory slot for the GPU (``cudaHostRegister``), so
        that rounds copy straight between the model and the slot, with no pinned buffer and no
        host-side copy between them. Until ``unpin()``, the slot's memory must stay mapped (the
        worker unpins before it detaches). False, and the pinned buffer still used, for a CPU
        model or where CUDA refuses."""
        if self._host is None or self._slot is not None:
            return False
        ptr = slot.ctypes.data
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, slot.nbytes, 0))
        if err != 0:
            log.info("slot not page-locked (cudaError %d): rounds copy through the pinned "
                     "buffer", err)
            return False
        self._slot = (ptr, slot.size, torch.from_numpy(slot))
        return True

    def unpin(self) -> None:
        """Undo ``pin()`` (safe to call twice)."""
        if self._slot is not None:
            ptr, _, _ = self._slot
            self._slot = None
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(ptr)

    def _direct(self, flat: np.ndarray) -> torch.Tensor | None:
        """The page-locked slot as a tensor when ``flat`` is it, else None."""
        if self._slot is not None and flat.ctypes.data == self._slot[0] and flat.size == self._slot[1]:
            return self._slot[2]
        return None

    @torch.no_grad()
    def read_into(self, flat: np.ndarray) -> None:
        if self._host is None:  # a CPU model: straight into flat
            host = torch.from_numpy(flat)
            for (pos, size), t in zip(self.spans, self.tensors):
                host[pos : pos + size].copy_(t.reshape(-1))
            return
        direct = self._direct(flat)
        host = direct if direct is not None else self._host
        for (pos, size), t in zip(self.spans, self.tensors):
            host[pos : pos + size].copy_(t.reshape(-1), non_blocking=True)
        self._sync()
        if direct is None:
            np.copyto(flat, self._host.numpy())

    @torch.no_grad()
    def write_from(self, flat: np.ndarray) -> None:
        if self._host is None:
            host = torch.from_numpy(flat)
            for (pos, size), t in zip(self.spans, self.tensors):
                t.copy_(host[pos : pos + size].view(t.shape))
            return
        host = self._direct(flat)
        if host is None:
            np.copyto(self._host.numpy(), flat)
            host = self._host
        for (pos, size), t in zip(self.spans, self.tensors):
            t.copy_(host[pos : pos + size].view(t.shape), non_blocking=True)
        self._sync()  # the slot or the pinned buffer may be rewritten once this returns
