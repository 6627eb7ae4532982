"""PLANE=chain on a node: its data listener, and its part of each global round's leader route
(docs/design-scale.md). The round itself (``round_runner.py``) does not change shape: where the
round's answer carries a route that names this node, the leader comes from (or goes down) the
route instead of from (or to) the global server.

A mixin of ``LocalServer`` (``server.py``).
"""

from __future__ import annotations

import logging

import numpy as np

from ..plane.messages import PlaneError, from_pb
from ..plane.node import DataPlane, RouteInfo
from ..rules import ops
from ..rules.base import GLOBAL_LEADER
from .global_client import RPC_TIMEOUT, RoundAnswer

log = logging.getLogger("lsgd.local_server.server")


class ChainMixin:
    """The node's side of the parameter plane (methods of ``LocalServer``)."""

    plane: DataPlane | None = None

    def _start_plane(self, param_count: int) -> None:
        """PLANE=chain: listen for transfers from the other nodes, and say where at Join."""
        if self.cfg.plane != "chain":
            return
        secret = self.security.secret if self.security is not None else None
        self.plane = DataPlane(job_id=self.cfg.job_id, index=self.cfg.node_index,
                               count=param_count, secret=secret,
                               host=self.cfg.data_listen_host(),
                               timeout=self.cfg.round_timeout + RPC_TIMEOUT,
                               bypass=self._bypass)
        self.client.data_address = self.plane.address
        log.info("data listener at %s (PLANE=chain)", self.plane.address)

    def _stop_plane(self) -> None:
        if self.plane is not None:
            self.summary["plane"] = dict(self.plane.stats)
            self.plane.close()
            self.plane = None

    def _bypass(self, round_id: int, epoch: int, stalled: int, why: str) -> RouteInfo:
        info = from_pb(self.client.bypass(round_id, epoch, stalled, why), self.cfg.num_groups)
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
            self.plane.begin(info)
        return info

    def _send_down_route(self, rid: int, slot: np.ndarray) -> np.ndarray:
        """The source: the leader (``slot``) is staged (its worker trains on meanwhile) and sent
        down the route. Returns the staged copy (what the server may need too)."""
        assert self.plane is not None
        ops.copy_(self.plane.stage, slot)
        return self.plane.stage

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
        if vec is None:
            return False, None
        if not self._free(GLOBAL_LEADER, rid):
            return False, vec
        ops.copy_(self.store.buffer(GLOBAL_LEADER), vec)
        return True, vec
