"""The names of the global server's parameter buffers, its refusals, and how much memory
it may still take for them."""

from __future__ import annotations

import os

LEADER, CENTER, SUM, AVERAGE = "global_leader", "center", "sum", "average"
DELTA = "center_delta"  # asynchronous rules: added to the center (push only; deltas.py)
MAIL = "mail"  # gossip rules: messages between nodes (mail.py)
HELD = (LEADER, CENTER, SUM)  # the vectors the server holds, each param_count float32
SAVED_AS = {LEADER: "leader", CENTER: "center"}  # member names in the saved .npz


class ParamError(Exception):
    """A refused upload or download; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, capped by the
    cgroup's (container's) limit; None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                text = f.read().strip()
                if text != "max":
                    found.append(max(0, int(text) - int(g.read().strip())))
            break
        except (OSError, ValueError):
            continue
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return min(found) if found else None




def _size(n: int) -> str:
    """Bytes for people: 1.2 GB, 4.0 TB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
