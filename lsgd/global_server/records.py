"""What the coordinator keeps and answers: the round schedule, per-node and per-round state,
and the answers to credit requests and round reports (plain data, no logic beyond arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..leader import Candidate
from ..rules.base import RoundKind


class CoordinatorError(Exception):
    """A request the coordinator refuses; ``code`` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "INVALID_ARGUMENT" | "FAILED_PRECONDITION" | "NOT_FOUND"


NO_END = 1 << 62  # the target of a job without rounds or an iteration budget


@dataclass(frozen=True)
class Schedule:
    """Where the rounds fall on the global counter, and the iteration budget."""

    local_period: int | None  # None: no local rounds
    global_period: int  # without rounds: still the most credits a node holds, as if it had them
    max_iterations: int | None
    rounds: bool = True  # False: an asynchronous rule, whose only round is the final one

    @classmethod
    def for_job(cls, *, num_groups: int, workers: int, l_comm: int, g_comm: int,
                local_rounds: bool, max_iterations: int | None,
                rounds: bool = True) -> "Schedule":
        n = num_groups * workers
        return cls(n * l_comm if local_rounds and rounds else None, n * g_comm, max_iterations,
                   rounds)

    @property
    def period(self) -> int:
        """The most iterations between two rounds: no node can hold more credits."""
        return self.local_period or self.global_period

    @property
    def detached_steps(self) -> int:
        """Steps a node cut off from the server may take on credits of its own, per detachment
        (one global period; the node keeps the same rule)."""
        return self.global_period

    def next_event(self, after: int) -> tuple[int, RoundKind]:
        """The first boundary strictly after ``after`` and the kind of round it triggers."""
        if not self.rounds:  # the end of the budget (none: the time budget ends the job)
            return (self.max_iterations if self.max_iterations is not None else NO_END), RoundKind.FINAL
        candidates = [((after // self.global_period) + 1) * self.global_period]
        if self.local_period:
            candidates.append(((after // self.local_period) + 1) * self.local_period)
        target = min(candidates)
        kind = RoundKind.GLOBAL if target % self.global_period == 0 else RoundKind.LOCAL
        if self.max_iterations is not None and target >= self.max_iterations:
            return self.max_iterations, RoundKind.FINAL
        return target, kind


_COUNTED = frozenset({"outstanding", "alive", "left", "session"})


@dataclass
class NodeState:
    """One node as the coordinator sees it. Once in a ``NodeTable``, every change of a counted
    field (``_COUNTED``) goes through ``__setattr__`` into the table's running totals."""

    index: int
    session: int
    workers: int
    joined_at: float
    last_seen: float
    outstanding: int = 0
    last_round_seen: int = 0
    alive: bool = True
    left: bool = False
    dropped_at: float = 0.0  # when the server dropped it for silence (alive is then False)
    consumed: int = 0  # total steps this node reported
    spare: int = 0  # credits no longer outstanding that it may still step on (claims.py)
    last_seq: int = 0  # newest numbered credit request
    last_grant: "Grant | None" = None  # the answer to it (given again to a retry)
    needs_resume: bool = False  # restored from saved state: must reattach (Join) first
    timed: tuple[float, float] = (0.0, 0.0)  # decaying sums of steps and their ms (shares.py)
    granted_in: int = -1  # the newest round opened when it was last granted credits

    def __setattr__(self, name: str, value: object) -> None:
        table = self.__dict__.get("_table")
        if table is None or name not in _COUNTED:
            object.__setattr__(self, name, value)
            return
        if value != self.__dict__.get(name) and name in ("session", "alive", "left"):
            table.changes += 1  # who is there changed
            if name == "session":
                table.version += 1
        table._count(self, -1)
        object.__setattr__(self, name, value)
        table._count(self, 1)


class NodeTable(dict):
    """The coordinator's nodes by index, with running totals kept as their fields change, so
    that no call is O(nodes): the credits alive nodes hold, the number of live nodes (alive and
    not left), and a version that moves on every join and new session (what the journal's
    membership file must follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.outstanding = 0
        self.live = 0
        self.version = 0
        self.changes = 0  # moves on every join, new session, drop, leave and return

    def _count(self, node: NodeState, sign: int) -> None:
        if node.alive:
            self.outstanding += sign * node.outstanding
            if not node.left:
                self.live += sign

    def __setitem__(self, index: int, node: NodeState) -> None:
        old = self.get(index)
        if old is not None:
            self._count(old, -1)
            object.__setattr__(old, "_table", None)
        super().__setitem__(index, node)
        object.__setattr__(node, "_table", self)
        self._count(node, 1)
        self.version += 1
        self.changes += 1

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("nodes are added one by one and never removed (they leave or are "
                        "dropped): the running totals count every one")

    __delitem__ = pop = popitem = clear = setdefault = update = _refuse  # type: ignore[assignment]


@dataclass
class RoundState:
    id: int
    kind: RoundKind
    iteration: int
    opened_at: float
    expected: set[int]
    reports: dict[int, tuple[Candidate | None, int]] = field(default_factory=dict)
    closed: bool = False
    leader: Candidate | None = None
    leader_node: int | None = None
    evaluate: bool = False  # nodes upload their sums so that node 0 can evaluate the average
    checkpoint: bool = False  # every node (and the server) saves a checkpoint at this round
    # Expected nodes not yet known to be done with the round (reported, dropped or left):
    # trimmed lazily from the front, so that checking whether the round still waits is O(1)
    # amortised rather than a pass over every node on every call.
    pending: set[int] = field(default_factory=set)
    # The answer to every node that reported in time, made once when the round closes (its
    # reports and leader are final then): N answers per round, each O(1), not O(N).
    outcome: "RoundOutcome | None" = None

    def __post_init__(self) -> None:
        self.pending = set(self.expected)


@dataclass(frozen=True)
class Grant:
    """Answer to a credit request."""

    grant: int = 0
    round: RoundState | None = None  # run this round before training on
    wait: bool = False  # nothing to give yet: ask again (the servicer long-polls)


@dataclass(frozen=True)
class RoundOutcome:
    """Answer to a round report."""

    ready: bool  # False: the round is still open, wait
    missed: bool = False
    leader: Candidate | None = None
    leader_node: int | None = None
    participants: int = 0
    nodes: tuple[int, ...] = ()
    evaluate: bool = False
    checkpoint: bool = False


def _due(target: int, every: int, next_at: int) -> tuple[bool, int]:
    """Whether a global round at ``target`` is the first at or past ``next_at`` (an evaluation
    or checkpoint round, every ``every`` iterations; 0: never), and the next such counter."""
    if not every or target < next_at:
        return False, next_at
    return True, (target // every + 1) * every
