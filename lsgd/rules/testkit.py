"""A test kit for rule authors: run a rule on in-memory arrays, with no processes.

``RoundDriver`` plays the local servers and the global server of ``docs/architecture.md`` for
one round at a time, in the same order (elect, sum, update, pull), on plain float32 vectors::

    from lsgd.rules.testkit import RoundDriver
    d = RoundDriver(MyRule(), [[w0, w1], [w2, w3]])   # 2 nodes x 2 workers, flat float32
    d.global_round(losses=[0.3, 0.1, 0.2, 0.4])      # in place on w0..w3
    d.center                                          # the center (CENTER rules)

``run`` steps every worker ``steps_per_round`` times with your step function between rounds,
as ``G_COMM`` does in a job where every worker runs at the same speed. What the driver leaves
out is transport: faults, deadlines, late workers and nodes (the end-to-end tests cover those).

``AsyncDriver`` does the same for an asynchronous rule (``AsyncRule``), on the real node side
and the global server's objects, with the nodes' syncs in the test's hands.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..leader import Candidate, elect
from . import ops
from .base import (CENTER, GLOBAL_LEADER, LOCAL_LEADER, Contribution, Exchange, RoundKind,
                   RoundRoles, Rule, node_weights)


class RoundDriver:
    """A job's rounds of ``rule`` over ``nodes`` (a list per node of flat float32 vectors)."""

    def __init__(self, rule: Rule, nodes: Sequence[Sequence[np.ndarray]]) -> None:
        self.rule = rule
        self.nodes = [list(ws) for ws in nodes]
        self.workers = [w for ws in self.nodes for w in ws]
        for w in self.workers:
            if w.dtype != np.float32 or w.ndim != 1 or w.size != self.workers[0].size:
                raise ValueError("the driver takes flat float32 vectors of one length")
        self.node_of = [n for n, ws in enumerate(self.nodes) for _ in ws]
        size = self.workers[0].size
        self.center = self.workers[0].copy()  # seeded with node 0's first worker, as a job is
        self.state = {name: np.zeros(size, np.float32) for name in rule.server_state}
        self.buffers: dict[str, np.ndarray] = {}  # the node buffers of the last round
        self.rounds: list[dict] = []  # what each round decided (leaders, weights)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    def local_round(self, losses: Sequence[float]) -> None:
        """Within each node: elect its leader, pull toward it (LSGD's local rounds)."""
        for n, ws in enumerate(self.nodes):
            ids = [i for i, k in enumerate(self.node_of) if k == n]
            best = elect(Candidate(i, losses[i]) for i in ids)
            leader = best.worker_id if best else None
            target = self.workers[leader].copy() if best else None
            for i in ids:
                roles = RoundRoles(i, leader, None, self.multi_node)
                self._pull(i, RoundKind.LOCAL, roles, {LOCAL_LEADER: target})
        self.rounds.append({"kind": "local"})

    def global_round(self, losses: Sequence[float],
                     scalars: Sequence[Mapping[str, float]] | None = None) -> None:
        """One global round over every worker, as the servers run it."""
        scalars = scalars or [{} for _ in self.workers]
        if len(losses) != len(self.workers) or len(scalars) != len(self.workers):
            raise ValueError("one loss (and one scalars mapping) per worker")
        local = {}
        for n in range(len(self.nodes)):
            ids = [i for i, k in enumerate(self.node_of) if k == n]
            best = elect(Candidate(i, losses[i]) for i in ids)
            local[n] = best.worker_id if best else None
        record: dict = {"kind": "global"}
        if self.rule.exchange == Exchange.LEADER:
            best = elect(Candidate(i, losses[i]) for i in range(len(self.workers)))
            leader = best.worker_id if best else None
            record["leader"] = leader
            glob = self.workers[leader].copy() if best else None
            locals_ = {n: self.workers[w].copy() if w is not None else None  # before any pull
                       for n, w in local.items()}
            for i in range(len(self.workers)):
                n = self.node_of[i]
                roles = RoundRoles(i, local[n], leader, self.multi_node)
                self._pull(i, RoundKind.GLOBAL, roles, {GLOBAL_LEADER: glob, LOCAL_LEADER: locals_[n]})
        else:
            weights: list[float] = []  # asked per node, as each local server does
            for n in range(len(self.nodes)):
                ids = [i for i, k in enumerate(self.node_of) if k == n]
                weights += node_weights(self.rule, [Contribution(i, losses[i], scalars[i])
                                                    for i in ids])[0]
            record["weights"] = weights
            total = np.zeros_like(self.center)
            ops.weighted_sum_into_(total, self.workers, weights)  # values before any pull
            old = self.center.copy()
            self.rule.update_(self.center, total, float(sum(weights)), len(self.workers), self.state)
            target = self.center if self.rule.pull_after_exchange else old
            for i in range(len(self.workers)):
                roles = RoundRoles(i, local[self.node_of[i]], None, self.multi_node)
                self._pull(i, RoundKind.GLOBAL, roles, {CENTER: target})
        self.rounds.append(record)

    def run(self, rounds: int, steps_per_round: int,
            step: Callable[[int, np.ndarray], float],
            scalars: Callable[[int], Mapping[str, float]] | None = None) -> list[float]:
        """``rounds`` global rounds, each after ``steps_per_round`` calls of ``step(worker id,
        its vector) -> loss`` per worker. Returns the losses of the last steps."""
        losses = [float("nan")] * len(self.workers)
        for _ in range(rounds):
            sums = [0.0] * len(self.workers)
            for i, w in enumerate(self.workers):
                for _ in range(steps_per_round):
                    sums[i] += float(step(i, w))
            losses = [s / steps_per_round for s in sums]
            self.global_round(losses, [scalars(i) for i in range(len(self.workers))]
                              if scalars else None)
        return losses

    def _pull(self, i: int, kind: RoundKind, roles: RoundRoles,
              buffers: Mapping[str, np.ndarray | None]) -> None:
        for name, strength in self.rule.pulls(kind, roles):
            target = buffers.get(name)
            if target is None:
                raise ValueError(f"rule {self.rule.name} pulls toward {name}, which this round "
                                 "does not have")
            ops.pull_toward_(self.workers[i], target, strength)


class AsyncDriver:
    """An asynchronous rule (``AsyncRule``) over ``nodes`` (a list per node of flat float32
    vectors, changed in place), on the real node side (``AsyncNode``: node memory, the lock,
    the sync) and the real global server's center and mailboxes, with no processes and no
    network::

        from lsgd.rules.testkit import AsyncDriver
        with AsyncDriver(MyRule(), [[w0, w1], [w2, w3]]) as d:
            w0 -= 0.1 * grad(w0)        # your step
            d.step(0)                   # worker 0 took a step: its exchange runs if due
            d.sync()                    # every node: send deltas (mail), fetch the center
            d.center                    # the global server's center (center rules)

    Nodes sync only when told (``sync``), so a test decides how stale each node is.
    """

    def __init__(self, rule, nodes: Sequence[Sequence[np.ndarray]], seed: int = 0) -> None:
        import random

        from ..global_server.params import ParamStore
        from ..local_server.async_node import AsyncNode, buffer_names
        from ..local_server.store import NodeStore, StoreLayout

        self.rule = rule
        self.nodes = [list(ws) for ws in nodes]
        self.workers = [w for ws in self.nodes for w in ws]
        size = self.workers[0].size
        for w in self.workers:
            if w.dtype != np.float32 or w.ndim != 1 or w.size != size:
                raise ValueError("the driver takes flat float32 vectors of one length")
        self.where = [(n, i) for n, ws in enumerate(self.nodes) for i in range(len(ws))]
        self.steps = [0] * len(self.workers)
        self.rng = random.Random(seed)
        self.server = ParamStore(rule)
        self.server.set_param_count(size)
        self.server.buffers[CENTER][:] = self.workers[0]  # seeded by node 0, as a job is
        self.server.center_ready = True
        self.stores, self.sides = [], []
        try:
            for n, ws in enumerate(self.nodes):
                store = NodeStore.create(StoreLayout.new(f"kit{id(self) % 10**8}", n, size,
                                                         len(ws), buffer_names(rule, len(ws))))
                self.stores.append(store)
                for name in store.layout.buffers:  # every buffer starts at the initial model
                    store.buffer(name)[:] = self.workers[0]
                side = AsyncNode(rule, store, _InProcess(self.server, n, len(self.nodes)),
                                 moved=size, sync_every=0.0, job_workers=len(self.workers))
                for i, w in enumerate(ws):
                    store.slot(i)[:] = w
                    side.start_worker(i)
                self.sides.append(side)
        except BaseException:
            self.close()
            raise

    def step(self, worker: int) -> int:
        """Worker ``worker`` took a step: ask the rule whether an exchange is due, and run it.
        Returns the action (0: none)."""
        self.steps[worker] += 1
        action = self.rule.due(self.steps[worker], self.rng)
        if action:
            self.exchange(worker, action)
        return action

    def exchange(self, worker: int, action: int) -> float:
        """Run one exchange of ``worker`` now (its vector in, the result back). Returns the
        distance the rule reported."""
        n, i = self.where[worker]
        slot = self.stores[n].slot(i)
        slot[:] = self.workers[worker]
        _, distance, _ = self.sides[n].exchange(i, action, True)
        self.workers[worker][:] = slot
        return distance

    def sync(self, node: int | None = None) -> None:
        """Node ``node``'s (every node's) exchange with the global server."""
        for n in range(len(self.nodes)) if node is None else (node,):
            if not self.sides[n].sync():
                raise RuntimeError(f"node {n}'s sync failed")

    @property
    def center(self) -> np.ndarray:
        """The global server's center (a copy)."""
        return self.server.buffers[CENTER].copy()

    def node_center(self, node: int) -> np.ndarray | None:
        """Node ``node``'s copy of the center (a copy; None for gossip rules)."""
        c = self.sides[node].center
        return None if c is None else c.copy()

    def scalars(self, worker: int) -> dict:
        """The node's numbers of ``worker`` (``mine.scalars``: GoSGD's weight)."""
        n, i = self.where[worker]
        return dict(self.sides[n].scalars[i])

    def close(self) -> None:
        for store in self.stores:
            store.close(unlink=True)
        self.stores = []

    def __enter__(self) -> "AsyncDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _InProcess:
    """The calls a node's sync makes, straight into the global server's objects."""

    def __init__(self, server, node: int, nodes: int) -> None:
        self.server, self.node, self.nodes = server, node, nodes
        self.f4 = np.dtype("<f4")

    def push(self, buffer: str, vec: np.ndarray, round_id: int, **_) -> None:
        chunks = [(0, vec.astype(self.f4).tobytes())]
        self.server.push_delta(self.node, 1, round_id, vec.size, chunks, self.f4)

    def pull(self, buffer: str, out: np.ndarray, round_id: int, **_) -> None:
        for offset, data in self.server.pull(0, buffer, out.size, timeout=1.0):
            out[offset : offset + len(data) // 4] = np.frombuffer(data, self.f4)

    def push_mail(self, vec: np.ndarray, number: int, weight: float) -> None:
        self.server.mail.post(self.node, 1, number, weight, range(self.nodes),
                              [(0, vec.astype(self.f4).tobytes())], self.f4)

    def pull_mail(self, number: int, out: np.ndarray) -> float:
        vec, weight = self.server.mail.take(self.node, 1, number)
        if vec is not None:
            out[:] = vec
        return weight
