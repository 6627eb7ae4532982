"""Which GPU each of a node's worker processes sees: local worker i gets GPU i mod n.

The local server sets ``CUDA_VISIBLE_DEVICES`` of each worker process to one GPU, so the
user's code keeps saying ``cuda`` (``--device cuda``, ``model.cuda()``) and lands on its own
GPU, with any framework. The evaluator shares local worker 0's GPU. A respawned worker gets the
GPU it had. The GPUs are, in order:

- ``DEVICES`` when set: a comma-separated list of GPU indices, or ``GPU-…`` / ``MIG-…`` UUIDs;
  an index counts the GPUs the node sees (where the node's own ``CUDA_VISIBLE_DEVICES`` is
  ``4,5``, ``DEVICES=1`` is GPU 5); an entry may repeat, ``0,0,1,1`` puts two workers per GPU;
- else the node's own ``CUDA_VISIBLE_DEVICES``, when set (a scheduler's allocation);
- else every NVIDIA GPU the node can use (``nvidia-smi -L``, else ``/proc/driver/nvidia/gpus``).

``DEVICES=all`` leaves every worker seeing every GPU of the node (code that places its model
itself, or uses several GPUs per worker). With no GPU found nothing is set, and CPU jobs are
unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping

ALL = "all"
_ENTRY = re.compile(r"\d{1,4}|(GPU|MIG)-[0-9A-Za-z./-]{1,120}")
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def check(devices: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What is wrong with a ``DEVICES`` value (None: nothing). Where the node's
    ``CUDA_VISIBLE_DEVICES`` is set, an index must count one of the GPUs it names."""
    if devices in ("", ALL):
        return None
    entries = devices.split(",")
    if len(entries) > 1024:
        return f"devices lists {len(entries)} GPUs; at most 1024"
    for e in entries:
        if not _ENTRY.fullmatch(e.strip()):
            return (f"devices entry '{e.strip()[:40]}' is not a GPU: give indices or GPU-/MIG- "
                    f"UUIDs separated by commas, e.g. 0,1 (or 'all', or empty for every GPU)")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    seen = visible_list(environ)
    if seen is not None:
        for e in entries:
            if e.strip().isdigit() and int(e) >= len(seen):
                return (f"devices entry {e.strip()} counts the GPUs this node sees, and it sees "
                        f"{len(seen)} (CUDA_VISIBLE_DEVICES={visible[:80]}): use 0..{len(seen) - 1}"
                        if seen else f"devices entry {e.strip()}: this node sees no GPU "
                        "(CUDA_VISIBLE_DEVICES is empty)")
    return None


def machine_gpus(proc: Path = PROC_GPUS, smi: str | None = "nvidia-smi",
                 timeout: float = 10.0) -> int:
    """How many NVIDIA GPUs this node can use (0 without the driver): ``nvidia-smi -L``, which
    lists only a container's own GPUs, else the driver's /proc entries."""
    path = shutil.which(smi) if smi else None
    if path is not None:
        try:
            child = subprocess.Popen([path, "-L"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        except OSError:
            child = None
        if child is not None:
            try:
                out, _ = child.communicate(timeout=timeout)
                return sum(1 for line in out.splitlines() if line.startswith("GPU "))
            except subprocess.TimeoutExpired:  # a wedged driver: do not wait on it again
                child.kill()
    try:
        return sum(1 for p in proc.iterdir() if p.is_dir())
    except OSError:
        return 0


def visible_list(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The GPUs the node's ``CUDA_VISIBLE_DEVICES`` names, as CUDA reads it: up to its first
    entry that is not a GPU (``-1`` hides them all); None when it is not set."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    seen: list[str] = []
    for e in visible.split(","):
        if not _ENTRY.fullmatch(e.strip()):
            break
        seen.append(e.strip())
    return seen


def node_gpus(devices: str, environ: Mapping[str, str] = os.environ,
              count: int | None = None) -> list[str] | None:
    """The node's GPUs in worker order; None: leave the workers' environment as it is."""
    if devices == ALL:
        return None
    seen = visible_list(environ)
    if devices:
        wanted = [e.strip() for e in devices.split(",")]
        # an index counts the GPUs this node sees, as cuda:0, cuda:1, ... would
        return [seen[int(e)] if seen and e.isdigit() and int(e) < len(seen) else e
                for e in wanted]  # (check() refuses an index past the list at start)
    if seen is not None:
        return seen or None  # set empty: the node sees no GPU
    n = machine_gpus() if count is None else count
    return [str(i) for i in range(n)] or None


def for_worker(gpus: list[str] | None, local_index: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of local worker ``local_index`` (negative: the evaluator, on
    worker 0's GPU); None: left as it is."""
    if not gpus:
        return None
    return gpus[max(local_index, 0) % len(gpus)]


def describe(gpus: list[str] | None, workers: int, devices: str = "") -> str | None:
    """One line for the node's log, e.g. ``workers on GPUs 0, 1, 0, 1 (...)``."""
    if not gpus:
        return None
    each = ", ".join(for_worker(gpus, i) or "" for i in range(workers))
    how = "from DEVICES" if devices else "set DEVICES to choose"
    return f"workers on GPUs {each} (local worker i on GPU i mod {len(gpus)}; {how})"


def unseen(devices: str, environ: Mapping[str, str] = os.environ,
           count: int | None = None) -> str | None:
    """Why ``DEVICES`` names GPUs this node does not have, where that can be told (None: it
    does, or there is no telling)."""
    if devices in ("", ALL) or visible_list(environ) is not None:
        return None  # indices within CUDA_VISIBLE_DEVICES are checked at start (check())
    n = machine_gpus() if count is None else count
    beyond = [e for e in devices.split(",") if e.strip().isdigit() and int(e) >= n]
    if not beyond:
        return None
    sees = f"{n} GPU{'s' if n != 1 else ''}" if n else "no GPU"
    return (f"DEVICES names GPU {beyond[0].strip()} but this node sees {sees}: its workers "
            "will find no GPU there")
