"""The global server's side of the parameter plane (PLANE=chain, docs/design-scale.md): the
nodes' data addresses, each global round's leader route, and bypasses.

Called by the servicer with its lock held; pure apart from logging (no sockets: the server
never touches the data connections).
"""

from __future__ import annotations

import logging
import math

from ..plane.messages import (PlaneError, center_route, check_data_address, leader_route,
                              sum_route, to_pb)
from ..proto import lsgd_pb2 as pb
from ..plane.node import RouteInfo
from ..plane.route import RouteError, bypass
from ..rules.base import MAX_WEIGHT, MIN_WEIGHT
from .records import CoordinatorError

log = logging.getLogger("lsgd.global_server.routes")
MAX_WHY = 200


class Routes:
    """Data addresses by node, and the newest global round's route."""

    def __init__(self, fanout: int = 1) -> None:
        self.addresses: dict[int, str] = {}
        self.fanout = fanout
        self.count = 0  # the model's elements, once known (they size a route's chunks)
        self.current: RouteInfo | None = None
        self.center: RouteInfo | None = None  # a reduce round's broadcast of the new center
        self.bypasses = 0
        self.aborts = 0  # reduces aborted
        self.aborted_round = 0  # the newest round whose reduce was aborted (heartbeats say it)
        self.weights: dict[int, dict[int, float]] = {}  # open round -> node -> its weight
        self._message: tuple[tuple, pb.DataRoute] | None = None  # to_pb, cached

    def note_join(self, index: int, address: str, peer: str) -> None:
        """A node joined (or reattached) announcing ``address`` ("" : star only). A bad one
        refuses the join (INVALID_ARGUMENT) before anything changed: call before the join."""
        if not address:
            return
        try:
            check_data_address(address, peer)
        except PlaneError as exc:
            raise CoordinatorError("INVALID_ARGUMENT", str(exc)) from None

    def joined(self, index: int, address: str) -> None:
        """The join succeeded: the node is reached at ``address`` from now on."""
        if address:
            self.addresses[index] = address
        else:
            self.addresses.pop(index, None)

    def note_weight(self, index: int, round_id: int, participants: int, weight: float) -> None:
        """A node's report of a global round carries the weight of its sum (0: unweighted);
        INVALID_ARGUMENT, changing nothing, when it is out of bounds."""
        if weight and not (math.isfinite(weight) and participants * MIN_WEIGHT * (1 - 1e-9)
                           <= weight <= participants * MAX_WEIGHT * (1 + 1e-9)):
            raise CoordinatorError("INVALID_ARGUMENT", f"the weight of {participants} "
                                   f"participants must be in [{participants * MIN_WEIGHT:g}, "
                                   f"{participants * MAX_WEIGHT:g}], got {weight}")
        for old in [r for r in self.weights if r < round_id]:  # only the open round's are kept
            del self.weights[old]
        self.weights.setdefault(round_id, {})[index] = weight

    def plan_sums(self, round_id: int, reports: dict[int, int]) -> RouteInfo | None:
        """The reduce route of round ``round_id``'s sums (``reports``: node -> participants),
        or None (every node uploads its own sum, the star)."""
        weights = self.weights.pop(round_id, {})
        self.current = sum_route(round_id, {n: (p, weights.get(n, 0.0)) for n, p in reports.items()},
                                 self.addresses, self.count)
        self.center = None if self.current is None else center_route(self.current)
        return self.current

    def plan(self, round_id: int, members: list[int], leader_node: int | None) -> RouteInfo | None:
        """The route of round ``round_id``'s leader among ``members`` (the nodes that reported
        in time), or None (the star serves alone)."""
        self.current = self.center = None
        if leader_node is None:
            return None
        self.current = leader_route(round_id, sorted(members), leader_node, self.addresses,
                                    self.fanout, self.count)
        return self.current

    def for_node(self, index: int, round_id: int) -> RouteInfo | None:
        """The route to tell ``index`` in its answer for ``round_id`` (None: not on one)."""
        r = self.current
        if r is None or r.round_id != round_id or index not in r.addresses:
            return None
        return r

    def message(self, info: RouteInfo) -> pb.DataRoute:
        """``info`` as sent, built once per round and epoch (every member gets the same)."""
        key = (info.round_id, info.route.epoch, info.reduce)
        if self._message is None or self._message[0] != key:
            self._message = (key, to_pb(info))
        return self._message[1]

    def bypass(self, index: int, round_id: int, epoch: int, stalled: int, why: str,
               reduce: bool = False) -> RouteInfo:
        """Member ``index`` could not send to ``stalled``: the route without it (a new epoch).
        If ``stalled`` was to feed the server, ``index`` does instead (it holds the whole
        vector once its sends are done; the caller moves the server's expectation). Raises
        CoordinatorError (FAILED_PRECONDITION) when that is not this route's shape."""
        r = self.current
        if r is None or r.round_id != round_id:
            raise CoordinatorError("FAILED_PRECONDITION", f"no route of round {round_id} is "
                                   "current (the round is over)")
        if index not in r.addresses:
            raise CoordinatorError("FAILED_PRECONDITION", f"node {index} is not on the route "
                                   f"of round {round_id}")
        if reduce != r.reduce and not (r.reduce and self.center is not None):
            raise CoordinatorError("INVALID_ARGUMENT", f"round {round_id} has no "
                                   f"{'reduce' if reduce else 'broadcast'}")
        if reduce:  # nothing to bypass: the partial sums in flight hold the member's sum
            self.aborts += 1
            self.aborted_round = max(self.aborted_round, round_id)
            log.warning("round %d: the reduce of the sums is aborted: node %d could not go on "
                        "with node %d (%s)", round_id, index, stalled,
                        why.encode("ascii", "replace").decode()[:MAX_WHY])
            self.current = self.center = None
            raise CoordinatorError("ABORTED", f"the reduce of round {round_id} is aborted; its "
                                   "exchange is skipped")
        if r.reduce:  # the broadcast of that round is the new center's
            r = self.center
        if epoch > r.route.epoch:
            raise CoordinatorError("INVALID_ARGUMENT", f"route epoch {epoch} was never issued "
                                   f"(newest {r.route.epoch})")
        if len(why) > MAX_WHY:
            raise CoordinatorError("INVALID_ARGUMENT", f"why is longer than {MAX_WHY} characters")
        if stalled in r.route.left:  # a retry of a bypass already granted
            return r
        try:
            route = bypass(r.route, index, stalled)
        except RouteError as exc:
            raise CoordinatorError("FAILED_PRECONDITION", str(exc)) from None
        new = RouteInfo(r.round_id, route, r.addresses,
                        index if stalled == r.feeds_server else r.feeds_server, r.chunk)
        if self.current is not None and self.current.reduce:
            self.center = new
        else:
            self.current = new
        self.bypasses += 1
        log.warning("round %d: node %d could not send to node %d (%s); node %d "
                    "bypassed, route epoch %d", round_id, index, stalled,
                    why.encode("ascii", "replace").decode(), stalled, route.epoch)
        return new
