"""Routes of the parameter plane (docs/design-scale.md): pure, no sockets, no clock of its own.

A *route* moves one vector between nodes for one exchange of a round, planned by the global
server:

- a **broadcast** starts at its source (the leader's node, or the server for a new center) and
  runs down a tree of ``fanout`` chains: each member forwards every chunk to its children as it
  arrives;
- a **reduce** runs the same tree the other way: each member adds its own sum to what its
  children sent, and forwards the partial sum to its parent; the root (the server) ends with
  the total.

Node 0 runs beside the global server, so a route that involves the server reaches it through
node 0 (loopback): the server's own link carries the vector once.

Faults. Routes are numbered by an *epoch*. When a member's transfer to a child stalls, the server
may grant a **bypass** (broadcast only): the stalled member leaves the route, its children are
handed to the member that reported it, and the epoch goes up. A reduce cannot bypass (the
stalled member's sum is already inside the partial sums in flight): it aborts, and the round's
exchange is skipped. A receiver keeps only the newest epoch's sender and accepts only the chunk
at its contiguous offset (``Reception``), which is also where a re-routed sender resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

SERVER = -1  # the global server, as a member of a route


class RouteError(ValueError):
    """A route request that cannot be granted; the message says why."""


class Kind(Enum):
    BROADCAST = "broadcast"
    REDUCE = "reduce"


@dataclass(frozen=True)
class Route:
    """One exchange's route, at one epoch. ``parent`` maps every member but the root to the
    member it receives from (broadcast) or sends to (reduce)."""

    kind: Kind
    root: int  # the source of a broadcast, the destination of a reduce (node index or SERVER)
    parent: dict[int, int]
    epoch: int = 0
    left: frozenset[int] = field(default_factory=frozenset)  # bypassed members

    @property
    def members(self) -> list[int]:
        return [self.root] + sorted(self.parent)

    def children(self, node: int) -> list[int]:
        """Whom ``node`` sends to (broadcast) or receives from (reduce), in a fixed order."""
        return sorted(n for n, p in self.parent.items() if p == node)

    def upstream(self, node: int) -> list[int]:
        """The members ``node`` receives from."""
        if node not in self.parent and node != self.root:
            raise RouteError(f"node {node} is not on this route")
        if self.kind == Kind.BROADCAST:
            return [] if node == self.root else [self.parent[node]]
        return self.children(node)

    def downstream(self, node: int) -> list[int]:
        """The members ``node`` sends to."""
        if node not in self.parent and node != self.root:
            raise RouteError(f"node {node} is not on this route")
        if self.kind == Kind.BROADCAST:
            return self.children(node)
        return [] if node == self.root else [self.parent[node]]

    def depth(self) -> int:
        """Hops from the root to the farthest member."""
        best = 0
        for n in self.parent:
            hops, at = 0, n
            while at != self.root:
                at, hops = self.parent[at], hops + 1
            best = max(best, hops)
        return best


def plan(kind: Kind, members: list[int], root: int, fanout: int = 1) -> Route:
    """The route of an exchange among ``members`` (node indices), rooted at ``root``.

    The members other than the root, in index order, are cut into ``fanout`` chains of nearly
    equal length, each hanging from the root. When the root is the server, node 0 (which runs
    beside it) is the server's one child and the chains hang from node 0.
    """
    if fanout < 1:
        raise RouteError(f"fanout must be >= 1, got {fanout}")
    if len(set(members)) != len(members) or any(m < 0 for m in members):
        raise RouteError(f"members must be distinct node indices, got {members}")
    if root != SERVER and root not in members:
        raise RouteError(f"the root {root} is not a member")
    rest = sorted(m for m in members if m != root)
    parent: dict[int, int] = {}
    top = root
    if root == SERVER:
        if 0 not in rest:
            raise RouteError("a route to or from the server needs node 0, which runs beside it")
        rest.remove(0)
        parent[0] = SERVER
        top = 0
    chains = max(1, min(fanout, len(rest)))
    size, extra = divmod(len(rest), chains)
    start = 0
    for c in range(chains):
        length = size + (1 if c < extra else 0)
        above = top
        for node in rest[start:start + length]:
            parent[node] = above
            above = node
        start += length
    return Route(kind, root, parent)


def bypass(route: Route, reporter: int, stalled: int) -> Route:
    """The route without ``stalled``, whose transfer from ``reporter`` stalled (broadcast only).

    ``reporter`` must be ``stalled``'s parent in this epoch. The stalled member's children
    hang from ``reporter`` instead; the epoch goes up by one.
    """
    if route.kind != Kind.BROADCAST:
        raise RouteError("a reduce cannot bypass a member (its sum is already in the partial "
                         "sums in flight): the exchange is aborted")
    if stalled == route.root:
        raise RouteError(f"the source {stalled} stalled: nothing can be bypassed")
    if stalled not in route.parent:
        raise RouteError(f"node {stalled} is not on route epoch {route.epoch}")
    if route.parent[stalled] != reporter:
        raise RouteError(f"node {reporter} does not send to node {stalled} in route epoch "
                         f"{route.epoch}")
    parent = {n: (reporter if p == stalled else p) for n, p in route.parent.items() if n != stalled}
    return replace(route, parent=parent, epoch=route.epoch + 1, left=route.left | {stalled})


def stalled(last_progress: float, now: float, chunk_bytes: int, bandwidth_Bps: float,
            floor: float = 2.0) -> bool:
    """A transfer that made no progress for ``max(floor, 20 * chunk / bandwidth)`` seconds has
    stalled (a hung member keeps its heartbeat: death is not the test)."""
    return now - last_progress > max(floor, 20.0 * chunk_bytes / max(bandwidth_Bps, 1.0))


class Reception:
    """A receiver's view of one vector of ``count`` elements: which epoch's sender it takes,
    and how far the contiguous prefix it holds reaches."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise RouteError(f"a vector has at least one element, got {count}")
        self.count = count
        self.epoch = -1
        self.offset = 0  # elements held, from 0
        self.closed: str | None = None  # why it takes nothing more (its round failed or ended)

    def close(self, why: str) -> None:
        """Take nothing more: a connection of an ended round still open writes no byte."""
        self.closed = self.closed or why

    def open(self, epoch: int) -> int:
        """A sender of ``epoch`` connects: the offset it must resume from. An older epoch than
        the one taken is refused (its sender was bypassed)."""
        if self.closed is not None:
            raise RouteError(f"the transfer is over: {self.closed}")
        if epoch < self.epoch:
            raise RouteError(f"route epoch {epoch} is older than epoch {self.epoch}")
        self.epoch = epoch
        return self.offset

    def accept(self, epoch: int, offset: int, n: int) -> None:
        """A chunk of ``n`` elements at ``offset`` from the sender of ``epoch``; refused unless
        it is the current epoch's and starts where the held prefix ends."""
        if self.closed is not None:
            raise RouteError(f"the transfer is over: {self.closed}")
        if epoch != self.epoch:
            raise RouteError(f"a chunk of route epoch {epoch}; epoch {self.epoch} is current")
        if offset != self.offset:
            raise RouteError(f"a chunk at offset {offset}; expected {self.offset}")
        if n < 1 or offset + n > self.count:
            raise RouteError(f"a chunk of {n} elements at {offset} overruns {self.count}")
        self.offset += n

    @property
    def complete(self) -> bool:
        return self.offset == self.count
