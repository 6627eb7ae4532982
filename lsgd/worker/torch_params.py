"""PyTorch adapter (``pip install 'lsgd[torch]'``): an ``nn.Module`` or a list of tensors.

CPU tensors are copied straight between the model and the worker's shared-memory slot. CUDA
tensors are copied only at rounds, straight between the GPU and the slot: the worker page-locks
the node segment at registration (``pin``: asynchronous copies, one synchronisation), and a
float32 model is pulled on its GPU (``pull_toward``, ``torch_pinned.py``). Without that (CUDA
refused, the evaluator, a vector elsewhere) the copies go through one pinned host buffer
allocated at registration and reused. Training steps never touch the host.

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

from .torch_pinned import DevicePull, PinnedRegion

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
        self._pinned: PinnedRegion | None = None  # pin()
        self._device_pull: DevicePull | None = None
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

    def pin(self, region: np.ndarray, register: bool = True) -> bool:
        """Page-lock ``region`` (the node segment: the worker's slot and the node's buffers)
        for the model's GPU: rounds then copy straight between the model and the slot, and
        pull on the GPU (``torch_pinned.py``). The memory must stay mapped until ``unpin()``.
        False, and the pinned buffer and host pulls used, for a CPU model or where CUDA
        refuses. ``register=False``: the views alone, without CUDA (tests, on CPU tensors)."""
        if self._pinned is not None or (self._host is None and register):
            return False
        try:
            self._pinned = PinnedRegion(region, self.device, register)
        except OSError as exc:
            log.info("node memory not page-locked (%s): rounds copy through the pinned buffer "
                     "and pull on the CPU", exc)
            return False
        self._device_pull = DevicePull(self.tensors, self.spans)
        return True

    @property
    def pinned(self) -> bool:
        """Whether ``pin()`` page-locked the node memory."""
        return self._pinned is not None and self._pinned.registered

    @property
    def pulls_on_device(self) -> bool:
        """Whether pulls toward page-locked vectors run on the GPU (now)."""
        return self._device_pull is not None and self._device_pull.fits()

    def unpin(self) -> None:
        """Undo ``pin()`` (safe to call twice)."""
        pinned, self._pinned, self._device_pull = self._pinned, None, None
        if pinned is not None:
            pinned.close()

    def _direct(self, flat: np.ndarray) -> torch.Tensor | None:
        """``flat`` as a tensor over page-locked memory, when it lies there; else None."""
        return self._pinned.view(flat) if self._pinned is not None else None

    def can_pull(self, target: np.ndarray) -> bool:
        """Whether ``pull_toward(target, ...)`` runs on the GPU: a float32 model whose tensors
        are contiguous, and a target in page-locked memory."""
        return self.pulls_on_device and self._direct(target) is not None

    def pull_toward(self, target: np.ndarray, strength: float, count: int) -> float:
        """Pull the model's first ``count`` entries toward ``target`` on its GPU, in place
        (``ops.pull_toward_``'s arithmetic); the distance before. Only where ``can_pull``."""
        assert self._device_pull is not None
        src = self._direct(target)
        assert src is not None, "pull_toward needs a target in page-locked memory (can_pull)"
        return self._device_pull(src, strength, count)

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
