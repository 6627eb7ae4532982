"""The local server's bookkeeping records (shared by ``server.py`` and its mixins)."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field


class NodeError(RuntimeError):
    """The node cannot go on; the message says why."""


class JoinedTooLate(NodeError):
    """The job was finishing when this node joined: there is nothing left for it to do."""


class JoinRefused(NodeError):
    """The global server refused this node's settings or place in the job (a different job id,
    algorithm, NUM_GROUPS or WORKERS, an index out of range or taken): a configuration error."""


class DataPortError(JoinRefused):
    """PLANE=chain: the node cannot listen where DATA_HOST and DATA_PORT say (a configuration
    error, like a port in use)."""


@dataclass
class WorkerState:
    local: int
    worker_id: int
    proc: mp.process.BaseProcess
    replies: object
    last_contact: float
    outstanding: int = 0  # credits granted and not reported used
    released: bool = False  # its credits were released; what it reports next is late
    iterations: int = 0
    absent: bool = False  # missed a round; rounds do not wait for it until it is heard from
    gone: bool = False
    error: str | None = None
    reported: bool = False  # it reported its own failure (a Python error): not respawned
    respawns: list[float] = field(default_factory=list)  # time.time() of each respawn
    reading: frozenset[str] = frozenset()  # node buffers its unanswered Pull reads (rounds.py)
    starting: bool = False  # respawned, not sent its Setup yet: nothing else may reach it
    set_up_at: int = 0  # its step count when its process got its Setup (none taken since: equal)

    @property
    def life(self) -> int:
        """Which process of this worker is the current one (0: the first; ``Hello.life``)."""
        return len(self.respawns)


@dataclass
class Report:
    """Counts not yet reported to the global server."""

    consumed: int = 0
    late: int = 0
    released: int = 0
