"""Node shared memory: one segment holding every parameter vector of the node.

Layout (every vector a flat float32 array starting on a page boundary)::

    [ slot 0 | slot 1 | ... | slot W-1 | local_leader | global_leader | center | sum ]

Slot ``i`` is where worker ``i`` publishes its parameters at a round and pulls them in place;
the named buffers hold the rule's shared vectors (only those the rule needs are allocated). The
``StoreLayout`` descriptor (segment name, sizes, offsets) is all a worker needs to attach.

Only the creator (the local server) unlinks the segment, in ``close(unlink=True)``, which its
shutdown path always reaches; Python's resource tracker unlinks it even if the creator is killed.
When the whole node is killed at once (SIGKILL to every process, a lost machine), the next start
of that node removes the segments its earlier run left (``reclaim_stale``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")

PAGE = mmap.PAGESIZE
DTYPE = np.dtype(np.float32)


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class StoreLayout:
    """Where each vector lives in the node segment. Picklable; sent to every worker."""

    name: str
    param_count: int
    slots: int
    buffers: tuple[str, ...]

    @property
    def stride(self) -> int:
        """Bytes between consecutive vectors (page aligned)."""
        return _align(self.param_count * DTYPE.itemsize)

    @property
    def size(self) -> int:
        return self.stride * (self.slots + len(self.buffers))

    def offset_of_slot(self, i: int) -> int:
        if not 0 <= i < self.slots:
            raise IndexError(f"slot {i} out of range 0..{self.slots - 1}")
        return i * self.stride

    def offset_of(self, buffer: str) -> int:
        return (self.slots + self.buffers.index(buffer)) * self.stride

    @classmethod
    def new(cls, job_id: str, node_index: int, param_count: int, slots: int,
            buffers: tuple[str, ...]) -> "StoreLayout":
        """A layout with a fresh, unguessable segment name ``lsgd-<job>-n<node>-<random>``."""
        if param_count < 1:
            raise ValueError(f"param_count must be >= 1, got {param_count}")
        name = f"lsgd-{job_id}-n{node_index}-{secrets.token_hex(8)}"
        return cls(name, param_count, slots, tuple(buffers))


class SharedMemoryTooSmall(RuntimeError):
    """``/dev/shm`` cannot hold the node segment (a configuration problem: exit 2)."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(
            f"/dev/shm has {_mb(free)} free but this node's shared memory needs {_mb(needed)} "
            "(each worker's parameters plus the node's buffers); give /dev/shm more room "
            "(Docker: --shm-size, e.g. --shm-size=2g; Kubernetes: an emptyDir with medium: "
            "Memory mounted at /dev/shm) or run fewer WORKERS per node")
        self.needed, self.free = needed, free


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def shm_free() -> int | None:
    """Bytes free in ``/dev/shm`` (None where it cannot be told)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def reclaim_stale(job_id: str, node_index: int) -> list[str]:
    """Unlink this job's segments of node ``node_index`` that no live process has mapped.

    They are what an earlier run of the same node left when it was killed outright. A segment
    some process still maps (the same node started twice) is left alone. Returns the names removed.
    """
    if not SHM_DIR.is_dir():
        return []
    names = {p.name for p in SHM_DIR.glob(f"lsgd-{job_id}-n{node_index}-*")}
    if not names:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        names = {n for n in names if f"/dev/shm/{n}" not in text}
        if not names:
            return []
    for name in names:
        try:
            (SHM_DIR / name).unlink()
            log.warning("removed shared memory %s left by an earlier run of node %d", name, node_index)
        except OSError:
            pass
    return sorted(names)


SEMAPHORES = "semaphores"  # in RUN_DIR/node<i>: the named semaphores of this node's queues


def _shm_inodes_mapped() -> set[int]:
    """Inodes of /dev/shm files some live process maps (Linux /proc/<pid>/maps). By inode: glibc
    maps a named semaphore under the temporary name it was created with, not its final one."""
    inodes: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(str(SHM_DIR)):
                inodes.add(int(fields[4]))
    return inodes


def remember_semaphores(node_dir: Path, queue: object) -> None:
    """Note the named semaphores (``/dev/shm/sem.mp-*``) of a multiprocessing queue the node
    made, so that a later run can remove them if this one is killed outright (SIGKILL of its
    process group takes Python's resource tracker too, which would have unlinked them)."""
    names = [getattr(getattr(queue, attr, None), "_semlock", None) for attr in
             ("_rlock", "_wlock", "_sem")]
    lines = [n.name.lstrip("/") for n in names if n is not None and getattr(n, "name", None)]
    if lines:
        try:
            with open(node_dir / SEMAPHORES, "a") as f:
                f.write("".join(f"{line}\n" for line in lines))
        except OSError as exc:  # only a later cleanup is lost
            log.debug("cannot note the queue's semaphores: %s", exc)


def reclaim_semaphores(node_dir: Path) -> list[str]:
    """Unlink the named semaphores an earlier run of this node noted (``remember_semaphores``)
    that no live process maps; returns their names. The file then starts again."""
    path = node_dir / SEMAPHORES
    try:
        names = {n for n in path.read_text().split() if n.startswith("mp-") and "/" not in n}
    except OSError:
        return []
    mapped = _shm_inodes_mapped()
    removed = []
    for n in sorted(names):
        f = SHM_DIR / f"sem.{n}"
        try:
            if f.stat().st_ino in mapped:  # still in use (this node started twice)
                continue
            f.unlink()
            removed.append(f.name)
        except OSError:  # already gone (the run ended cleanly)
            pass
    if removed:
        log.warning("removed %d semaphore(s) left by an earlier run of this node", len(removed))
    path.unlink(missing_ok=True)
    return removed


class NodeStore:
    """Numpy views over the node segment."""

    def __init__(self, layout: StoreLayout, create: bool) -> None:
        self.layout = layout
        self._created = create
        free = shm_free() if create else None
        if free is not None and free < layout.size:
            raise SharedMemoryTooSmall(layout.size, free)
        self._shm = shared_memory.SharedMemory(name=layout.name, create=create,
                                               size=layout.size if create else 0)
        if create:
            self._reserve()
        if self._shm.size < layout.size:
            self._shm.close()
            raise ValueError(f"segment {layout.name} is {self._shm.size} bytes, expected {layout.size}")
        self._views: dict[object, np.ndarray] = {}

    def _reserve(self) -> None:
        """Allocate every page of the new segment now: a size that only ftruncate set is a
        promise, and touching a page /dev/shm has no room for kills the process (SIGBUS)."""
        try:
            os.posix_fallocate(self._shm._fd, 0, self.layout.size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: as before
                return
            self._shm.close()
            self._shm.unlink()
            if exc.errno == errno.ENOSPC:
                raise SharedMemoryTooSmall(self.layout.size, shm_free() or 0) from None
            raise

    @classmethod
    def create(cls, layout: StoreLayout) -> "NodeStore":
        return cls(layout, create=True)

    @classmethod
    def attach(cls, layout: StoreLayout) -> "NodeStore":
        return cls(layout, create=False)

    def _view(self, key: object, offset: int) -> np.ndarray:
        v = self._views.get(key)
        if v is None:
            v = np.ndarray((self.layout.param_count,), dtype=DTYPE, buffer=self._shm.buf, offset=offset)
            self._views[key] = v
        return v

    def slot(self, i: int) -> np.ndarray:
        """Worker ``i``'s parameter vector."""
        return self._view(i, self.layout.offset_of_slot(i))

    def buffer(self, name: str) -> np.ndarray:
        """A named vector (``local_leader``, ``global_leader``, ``center``, ``sum``)."""
        return self._view(name, self.layout.offset_of(name))

    def memory(self) -> np.ndarray:
        """The whole segment as bytes (a GPU worker page-locks it: ``torch_pinned.py``)."""
        v = self._views.get("memory")
        if v is None:
            v = self._views["memory"] = np.ndarray((self.layout.size,), np.uint8, self._shm.buf)
        return v

    def close(self, unlink: bool = False) -> None:
        """Drop the views and detach; the creator also unlinks when ``unlink``."""
        self._views.clear()
        try:
            self._shm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
        if unlink and self._created:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
