"""The GPU side of a round (``torch_params.py``): page-locked node memory, and pulls on the GPU.

A worker whose model is on a GPU page-locks the whole node segment once
(``cudaHostRegister``): its slot and the node's leader / center buffers. Copies between the GPU
and any of them then run at the copy engine's speed, with no staging buffer, and a pull can run
on the GPU: the target is copied up in chunks and the model's tensors are pulled in place, with
the arithmetic of ``ops.pull_toward_`` (float32, the same operations in the same order, so the
same results), instead of a pass over the slot on one CPU core.
"""

from __future__ import annotations

import math

import numpy as np
import torch

CHUNK = 1 << 22  # float32 elements per upload of a pull's target (16 MiB of device scratch)


class PinnedRegion:
    """Host memory page-locked for the GPU, and float32 tensor views into it."""

    def __init__(self, region: np.ndarray, device: torch.device, register: bool = True) -> None:
        """Raises OSError where CUDA refuses (the caller goes on without). ``register=False``
        only makes the views (tests on the CPU)."""
        if region.nbytes % 4 or not region.flags.c_contiguous:
            raise ValueError("a region is a contiguous run of whole float32 words")
        self.device, self.base, self.nbytes = device, region.ctypes.data, region.nbytes
        self.registered = False
        if register:
            with torch.cuda.device(device):
                err = int(torch.cuda.cudart().cudaHostRegister(self.base, self.nbytes, 0))
                if err != 0:
                    _clear_last_error()
                    raise OSError(f"cudaHostRegister failed with cudaError {err}")
            self.registered = True
        self._words = torch.from_numpy(region.reshape(-1).view(np.float32))

    def view(self, flat: np.ndarray) -> torch.Tensor | None:
        """``flat`` as a tensor over the page-locked memory; None when it lies outside."""
        if flat.dtype != np.float32 or flat.ndim != 1 or not flat.flags.c_contiguous:
            return None
        offset = flat.ctypes.data - self.base
        if offset < 0 or offset % 4 or offset + flat.nbytes > self.nbytes:
            return None
        return self._words[offset // 4 : offset // 4 + flat.size]

    def close(self) -> None:
        """Unregister (safe to call twice); the memory must still be mapped."""
        if self.registered:
            self.registered = False
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(self.base)


def _clear_last_error() -> None:
    """A failed runtime call leaves CUDA's last error set in this thread, and PyTorch reads it
    after its next kernel launch, which would then fail for nothing. A throwaway launch takes
    it, and the error it raises is that stale one."""
    for _ in range(2):
        try:
            torch.ones(1, device="cuda").add_(1)
            return
        except RuntimeError:
            continue


class DevicePull:
    """Pulls of a model's tensors toward vectors in page-locked memory, on their device."""

    def __init__(self, tensors: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
        self.tensors = tensors  # viewed at each pull: ``module.to(...)`` may swap their storage
        self.spans = spans
        self._upload: torch.Tensor | None = None  # device scratch, allocated at the first pull
        self._diff: torch.Tensor | None = None

    def fits(self) -> bool:
        """Whether the tensors can be pulled in place here: float32 and contiguous, on one
        device (checked at each round, for the same reason)."""
        device = self.tensors[0].device
        return all(t.dtype == torch.float32 and t.is_contiguous() and t.device == device
                   for t in self.tensors)

    @torch.no_grad()
    def __call__(self, target: torch.Tensor, strength: float, count: int) -> float:
        """``x <- x - strength * (x - target)`` over the first ``count`` entries; the distance
        ``||x - target||`` before, as ``ops.pull_toward_`` returns it. Only where ``fits()``."""
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"pulling strength must be in [0, 1], got {strength}")
        device = self.tensors[0].device
        if self._upload is None or self._upload.device != device:
            size = min(CHUNK, max(n for _, n in self.spans))
            self._upload = torch.empty(size, dtype=torch.float32, device=device)
            self._diff = torch.empty_like(self._upload)
        s = float(np.float32(strength))
        total = torch.zeros((), dtype=torch.float64, device=device)
        for (pos, size), t in zip(self.spans, self.tensors):
            if pos >= count:
                break
            x, n = t.view(-1), min(size, count - pos)
            for lo in range(0, n, CHUNK):
                k = min(CHUNK, n - lo)
                up, d, xs = self._upload[:k], self._diff[:k], x[lo : lo + k]
                up.copy_(target[pos + lo : pos + lo + k], non_blocking=True)
                torch.sub(xs, up, out=d)
                total += torch.dot(d, d)
                if s == 1.0:  # replace: exactly the target
                    xs.copy_(up)
                elif s:
                    d.mul_(s)
                    xs.sub_(d)
        return math.sqrt(float(total))  # one synchronisation per pull
