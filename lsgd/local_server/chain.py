"""PLANE=chain on a node: its data listener, and its part of each global round's leader route
(docs/design-scale.md). The round itself (``round_runner.py``) does not change shape: where the
round's answer carries a route that names this node, the leader comes from (or goes down) the
route instead of from (or to) the global server.

A mixin of ``LocalServer`` (``server.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np

from ..global_server.digests import sha256_of
from ..plane.messages import PlaneError, center_route, from_pb
from ..plane.node import DataPlane, RouteInfo
from ..rules import ops
from ..rules.base import CENTER, GLOBAL_LEADER, LOCAL_LEADER, SUM, Exchange, RoundKind
from .global_client import RPC_TIMEOUT, RoundAnswer
from .state import DataPortError

log = logging.getLogger("lsgd.local_server.server")
REGISTER_TRIES = 3  # the source's registration of the leader's digest (UNAVAILABLE: again)


@dataclass
class LeaderPart:
    """How a global round's leader moves in or out of this node (round_runner.py)."""

    route: RouteInfo | None = None  # PLANE=chain: the round's route, when this node is on it
    # (the leader's broadcast, or a center rule's reduce: see ``leader_route``)
    source: str | None = None  # the node buffer holding the leader it uploads (its own leader)
    staged: np.ndarray | None = None  # ... or the vector the route carried, whole
    upload: bool = False  # this node uploads the leader to the server
    uploaded: bool = False
    have: bool = False  # GLOBAL_LEADER holds this round's leader
    leader: int | None = None  # the global leader the workers pull toward (None: none)


class ChainMixin:
    """The node's side of the parameter plane (methods of ``LocalServer``)."""

    plane: DataPlane | None = None

    def _start_plane(self, param_count: int) -> None:
        """PLANE=chain: listen for transfers from the other nodes, and say where at Join."""
        if self.cfg.plane != "chain":
            return
        secret = self.security.secret if self.security is not None else None
        host = self.cfg.data_listen_host()
        try:
            self.plane = DataPlane(job_id=self.cfg.job_id, index=self.cfg.node_index,
                                   count=param_count, secret=secret, host=host,
                                   timeout=self.cfg.round_timeout + RPC_TIMEOUT,
                                   bypass=self._bypass, port=self.cfg.data_port)
        except OSError as exc:
            raise DataPortError(f"PLANE=chain: cannot listen on {host}:{self.cfg.data_port} "
                                f"({exc.strerror or exc}); set DATA_PORT to a free port (0: any) "
                                "or DATA_HOST to an address of this machine") from None
        self.client.data_address = self.plane.address
        plane = self.plane
        self.client.on_stopped = lambda why: plane.stop(f"the job stopped ({why})")
        self.client.on_aborted = plane.reduce_aborted
        log.info("data listener at %s (PLANE=chain)", self.plane.address)

    def _stop_plane(self) -> None:
        if self.plane is not None:
            self.summary["plane"] = dict(self.plane.stats)
            self.plane.close()
            self.plane = None

    def _bypass(self, round_id: int, epoch: int, stalled: int, why: str,
                reduce: bool) -> RouteInfo:
        info = from_pb(self.client.bypass(round_id, epoch, stalled, why, reduce),
                       self.cfg.num_groups)
        if info is None:
            raise PlaneError("the global server answered an empty route")
        return info

    def _route(self, rid: int, answer: RoundAnswer | None) -> RouteInfo | None:
        """The round's leader route if this node is on it (then registered with the plane, so
        that its predecessor's transfer is taken at once); None: the star."""
        if self.plane is None or answer is None or answer.route is None or answer.missed:
            return None
        try:
            info = from_pb(answer.route, self.cfg.num_groups)
        except PlaneError as exc:
            log.warning("round %d: the global server sent an unusable route (%s); the leader "
                        "comes through the server", rid, exc)
            return None
        if info is None or info.round_id != rid or self.cfg.node_index not in info.addresses:
            return None
        with self.liveness.blocking(self.plane.timeout + 5):  # the last round's sends end
            self.plane.begin(info, own=self.store.buffer(SUM) if info.reduce else None)
        return info

    def _center_in(self, rid: int, route: RouteInfo | None) -> bool:
        """The round's new center into CENTER (where no worker still reads it). On the star,
        from the server. After a reduce (PLANE=chain), down the same chain from node 0, which
        downloads it from the server beside it: every member forwards it, whether or not it
        can apply it. True when CENTER now holds it."""
        if route is None or not route.reduce:
            return self._free(CENTER, rid) and self._pull(CENTER, CENTER, rid)
        assert self.plane is not None and self.store is not None
        if self.plane.current is not None and self.plane.current.failed is not None:
            return False  # the reduce failed here: the round's exchange is skipped
        info = center_route(route)
        with self.liveness.blocking(self.plane.timeout + 5):
            self.plane.begin(info)
            if info.route.root == self.cfg.node_index:
                vec = None
                try:
                    with self._network_call():
                        self.client.pull(CENTER, self.plane.stage, rid, wire=self.cfg.wire)
                    vec = self.plane.stage
                except (grpc.RpcError, ValueError) as exc:
                    log.warning("round %d: download of the center failed: %s", rid,
                                exc.details() if isinstance(exc, grpc.RpcError) else exc)
                if vec is not None and not self.plane.send(vec):
                    log.warning("round %d: the center did not reach every node of its route", rid)
            else:
                vec = self.plane.receive()
                if vec is not None and not self._verified(rid, vec, center=True):
                    vec = None  # (forwarded already: each member below checks for itself)
        if vec is not None and not ops.all_finite(vec):
            log.warning("round %d: the center that came down the route is not finite; "
                        "downloading it from the server", rid)
            vec = None
        if vec is None:  # the route failed here (or was slow): the server has the center
            return (self.cfg.node_index != info.route.root and self._free(CENTER, rid)
                    and self._pull(CENTER, CENTER, rid))
        if not self._free(CENTER, rid):
            return False
        ops.copy_(self.store.buffer(CENTER), vec)
        return True

    def _push_sum(self, rid: int, route: RouteInfo | None, summands: int, weight: float) -> bool:
        """The node's sum to the server: on the star, or into the round's reduce (PLANE=chain),
        whose end uploads the total. True when this node's part went through."""
        if route is None or not route.reduce:
            return self._push(SUM, SUM, rid, summands=summands, weight=weight)
        assert self.plane is not None
        with self.liveness.blocking(self.plane.timeout + 5):
            total = self.plane.reduce()
        if total is None:
            return False
        if route.feeds_server != self.cfg.node_index:
            return True
        return self._push(None, SUM, rid, summands=route.total_summands,
                          weight=route.total_weight, vec=total)

    def _send_down_route(self, rid: int, slot: np.ndarray) -> np.ndarray:
        """The source: the leader (``slot``) is staged (its worker trains on meanwhile), and its
        digest registered with the server before anything is sent (``global_server/digests.py``):
        the members and the server keep only that vector. Returns the staged copy."""
        assert self.plane is not None
        ops.copy_(self.plane.stage, slot)
        digest = sha256_of(self.plane.stage)
        for attempt in range(REGISTER_TRIES):
            try:
                with self._network_call():
                    self.client.digest(rid, digest)
                break
            except grpc.RpcError as exc:
                if attempt + 1 == REGISTER_TRIES or exc.code() in (
                        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("round %d: the leader's digest could not be registered (%s); the "
                                "route's members and the server will refuse this round's leader",
                                rid, exc.details())
                    break
                time.sleep(0.2 * (attempt + 1))
        return self.plane.stage

    def _verified(self, rid: int, vec: np.ndarray, center: bool = False) -> bool:
        """Whether ``vec``, whole from the route, is the leader its source registered (or the
        center the server made)."""
        what = "center" if center else "leader"
        try:
            with self._network_call():
                want = self.client.digest(rid, center=center)
        except grpc.RpcError as exc:
            want, why = b"", f"its digest could not be had ({exc.details()})"
        else:
            why = "the server has no digest of it"
        if want and sha256_of(vec) == want:
            return True
        if want:
            why = f"it is not the {what} the server vouches for (SHA-256 differs)"
        log.warning("round %d: the %s that came down the route is refused: %s; taking the "
                    "server's", rid, what, why)
        return False

    def _finish_send(self, rid: int) -> None:
        assert self.plane is not None
        with self.liveness.blocking(self.plane.timeout + 5):
            if not self.plane.send(self.plane.stage):
                log.warning("round %d: the leader did not reach every node of its route", rid)

    def _leader_from_route(self, rid: int) -> tuple[bool, np.ndarray | None]:
        """A member: wait for the whole leader. Returns (whether GLOBAL_LEADER now holds it,
        the staged vector or None)."""
        assert self.plane is not None and self.store is not None
        with self.liveness.blocking(self.plane.timeout + 5):
            vec = self.plane.receive()
        if vec is not None and not ops.all_finite(vec):
            log.warning("round %d: the leader that came down the route is not finite; "
                        "skipping it", rid)
            return False, None
        if vec is None or not self._verified(rid, vec):
            return False, None
        if not self._free(GLOBAL_LEADER, rid):
            return False, vec
        ops.copy_(self.store.buffer(GLOBAL_LEADER), vec)
        return True, vec

    def _leader_exchange(self, rid: int, kind: RoundKind, answer, evaluate: bool,
                         local_of: dict[int, int], local_lead: int | None) -> LeaderPart:
        """The global leader's way in or out of this node this round: on the star, or on the
        round's route (PLANE=chain, chain.py). The leader's node stages what it sends and
        uploads; every other node gets the leader into GLOBAL_LEADER (where free)."""
        assert self.store is not None
        lx = LeaderPart(route=self._route(rid, answer))
        if not (kind == RoundKind.GLOBAL and answer and answer.leader and (
                self.rule.exchange == Exchange.LEADER or evaluate)):
            return lx
        me, lead = self.cfg.node_index, answer.leader.worker_id
        # The leader rides the round's route only when that route is the leader's: a center
        # rule's evaluation round sends its leader through the server (its route is the reduce).
        route = lx.route if lx.route is not None and not lx.route.reduce else None
        pulls_leader = self.rule.exchange == Exchange.LEADER
        if answer.leader_node == me:
            if self._free(GLOBAL_LEADER, rid):
                ops.copy_(self.store.buffer(GLOBAL_LEADER), self.store.slot(local_of[lead]))
                lx.source, lx.have = GLOBAL_LEADER, True
            else:  # the same vector, copied from the same slot this round, if it was
                lx.source = LOCAL_LEADER if local_lead == lead else None
            # see ParamStore.begin: which leader uploads the server expects
            lx.upload = (evaluate or answer.node_count > 1) and lx.source is not None
            if route is not None:
                lx.staged = self._send_down_route(rid, self.store.slot(local_of[lead]))
                lx.upload = route.feeds_server == me
        elif route is not None:
            lx.have, lx.staged = self._leader_from_route(rid)
            lx.upload = route.feeds_server == me and lx.staged is not None
            if lx.staged is None and route.feeds_server != me and pulls_leader and self._free(
                    GLOBAL_LEADER, rid):  # the route failed here: the server's copy, if it has one
                lx.have = self._pull(GLOBAL_LEADER, GLOBAL_LEADER, rid)
        elif pulls_leader and self._free(GLOBAL_LEADER, rid):
            lx.have = self._pull(GLOBAL_LEADER, GLOBAL_LEADER, rid)
        lx.leader = lead if pulls_leader and lx.have else None
        return lx

    def _leader_send(self, rid: int, lx: LeaderPart) -> None:
        """After the pulls went out: the leader's node sends it down the route; the member that
        feeds the server uploads it (node 0 first, over loopback; a source that took over from
        a bypassed node 0, after its sends)."""
        me = self.cfg.node_index
        sends = (lx.route is not None and not lx.route.reduce and lx.staged is not None
                 and lx.route.route.root == me)
        if lx.upload and (not sends or me == 0):
            self._push(lx.source, GLOBAL_LEADER, rid, vec=lx.staged)
            lx.upload = False
            lx.uploaded = True
        if sends:
            self._finish_send(rid)
            assert self.plane is not None
            if not lx.uploaded and (lx.upload or self.plane.feeds_server == me):
                self._push(lx.source, GLOBAL_LEADER, rid, vec=lx.staged)
