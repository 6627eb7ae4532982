"""A node's part of a round: collect the workers' published parameters, elect the node's best,
exchange the leader, sums or center with the global server, tell every participant what to pull,
and at the end run the final round and stop the workers.

Every wait is bounded by ``round_timeout``: a worker that misses a round is left out of it, and
a node buffer that a late worker still reads is never rewritten (``rounds.readers``).

A mixin of ``LocalServer`` (``server.py``).
"""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np

from ..leader import Candidate, elect
from ..rules import ops
from ..rules.base import (CENTER, GLOBAL_LEADER, LOCAL_LEADER, SUM, Contribution, Exchange,
                          RoundKind, RoundRoles, node_weights)
from . import checkpoint
from . import messages as m
from .global_client import RPC_TIMEOUT, CreditAnswer, RoundAnswer
from .rounds import readers
from .state import Report

log = logging.getLogger("lsgd.local_server.server")

STOP_GRACE = 5.0  # seconds workers get to exit after Stop before they are terminated
SAVE_LIMIT = 300.0  # seconds a checkpoint save may block the node loop before it counts as stuck
# Failures after which the global server may come back (restart, partition, dropped node):
# the node trains on by itself and reattaches. Any other status ends the node.
RECOVERABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED}


class RoundMixin:
    """Rounds, transfers and the final round (methods of ``LocalServer``)."""

    def _run_round(self, ans: CreditAnswer) -> bool:
        """Run one round with the node's workers. Returns True when the job is over."""
        assert self.store is not None
        rid, kind = ans.round_id, RoundKind(ans.round_kind)
        if kind != RoundKind.FINAL and rid <= self.pulled_round:
            return self._report_again(rid)  # reattached into a round whose pulls went out
        self.last_round_seen = rid
        self.rounds += 1
        if self.pool:
            self.report.released += self.pool
            self.pool = 0
        joins = self._collect_joins(rid, kind)
        # A worker whose recent losses or parameters are not finite takes no part in the round:
        # it cannot lead, is in no sum, and is reset to a leader or the center below.
        sick = {i: j for i, j in joins.items() if not j.healthy}
        joins = {i: j for i, j in joins.items() if j.healthy}
        cands = [Candidate(self.workers[i].worker_id, j.loss) for i, j in joins.items()]
        best = elect(cands)
        self._note_election(len(joins), best)
        local_of = {w.worker_id: w.local for w in self.workers}
        # A node buffer a late worker still pulls toward is not rewritten: pulls toward it are
        # left out of this round instead (rounds.py).
        local_lead = None  # the local leader whose parameters LOCAL_LEADER holds this round
        if (best is not None and LOCAL_LEADER in self.store.layout.buffers
                and self._free(LOCAL_LEADER, rid)):
            ops.copy_(self.store.buffer(LOCAL_LEADER), self.store.slot(local_of[best.worker_id]))
            local_lead = best.worker_id
        if kind == RoundKind.FINAL:
            return self._final_round(rid, ans.round_iteration, joins, best, local_of)
        center = self.rule.exchange == Exchange.CENTER and kind == RoundKind.GLOBAL
        after = center and self.rule.pull_after_exchange  # pulls toward this round's center
        weight = self._sum_slots(joins, weighted=True) if center and joins else 0.0
        if kind == RoundKind.LOCAL:  # the node's own: the global server has nothing to add
            answer = RoundAnswer(False, best, self.cfg.node_index if best else None, len(joins), 1)
        else:  # the report may carry the sum and the answer the leader: a call less for each
            answer = self._report(rid, best, len(joins), weight, then_pull=GLOBAL_LEADER if (
                self.rule.exchange == Exchange.LEADER and not readers(self.workers, GLOBAL_LEADER)
            ) else None, then_push=(SUM, len(joins), weight) if (
                center and joins and self.plane is None) else None)  # (a reduce: on its route)
        exchanged = bool(answer and not answer.missed)  # this node takes part in the exchange
        self.view.on_round(rid, kind.name.lower(), answer.leader if exchanged else None,
                           answer.leader_node if exchanged else None)
        evaluate = exchanged and answer.evaluate
        ckpt = exchanged and answer.checkpoint
        lx = self._leader_exchange(rid, kind, answer, evaluate, local_of, local_lead)
        global_leader, have_leader = lx.leader, lx.have
        if evaluate and not center and joins:  # after the leader download, which stages in SUM
            self._sum_slots(joins)
        averaged = self._average_stats(joins)
        self.pulled_round = rid
        fresh_center = False
        if after and exchanged and joins:  # the new center first: the pulls go toward it
            if lx.upload:  # an evaluation round's exchange settles only with the leader in
                self._push(lx.source, GLOBAL_LEADER, rid, vec=lx.staged)
                lx.upload = False
            if self._push_sum(rid, lx.route, len(joins), weight):
                fresh_center = self._center_in(rid, lx.route)
        for i in joins:
            roles = RoundRoles(self.workers[i].worker_id, local_lead, global_leader,
                               self.multi_node)
            pulls = tuple(self.rule.pulls(kind, roles))
            if after and not fresh_center:  # no new center this round: nothing to pull toward
                pulls = tuple(p for p in pulls if p[0] != CENTER)
            self.workers[i].reading = frozenset(name for name, _ in pulls)
            self._send(self.workers[i], m.Pull(rid, pulls, True, averaged, checkpoint=ckpt))
        resets = self._reset_sick(rid, kind, sick, local_lead is not None)
        self._leader_send(rid, lx)  # uploads, and down the route, while the workers pull
        if (center or evaluate) and not after and joins and exchanged:
            self._push_sum(rid, lx.route, len(joins), weight)
        dones = self._collect_dones(rid, set(joins) | set(sick))
        if center and not after and exchanged:  # after the pulls toward the old one (EASGD)
            fresh_center = self._center_in(rid, lx.route)
        if ckpt:
            with self.liveness.blocking(SAVE_LIMIT):
                checkpoint.save(self.dir, self.store, rid, ans.round_iteration,
                                {w.worker_id: w.iterations for w in self.workers})
        if evaluate and self.cfg.node_index == 0:
            if answer.leader and not have_leader and self._free(GLOBAL_LEADER, rid):
                have_leader = self._pull(GLOBAL_LEADER, GLOBAL_LEADER, rid)  # from another node
            self._periodic_evaluation(rid, ans.round_iteration, fresh_center,
                                      answer.leader.worker_id if have_leader else None)
        now = round(time.monotonic() - self.t0, 4)
        self.metrics.rows([{
            "round": rid, "kind": kind.name.lower(), "iteration": ans.round_iteration, "time_s": now,
            "worker_id": self.workers[i].worker_id, "worker_iterations": j.iterations,
            "loss": j.loss, "local_leader": best.worker_id if best else None,
            "global_leader": global_leader,
            "pull_local": dones.get(i, {}).get(LOCAL_LEADER),
            "pull_global": dones.get(i, {}).get(GLOBAL_LEADER),
            "pull_center": dones.get(i, {}).get(CENTER), "reset": resets.get(i)}
            for i, j in (joins | sick).items()])
        return False

    def _free(self, buffer: str, rid: int) -> bool:
        """Whether the node may rewrite ``buffer``: no worker may still pull toward it."""
        late = readers(self.workers, buffer)
        if late:
            log.warning("round %d: keeping the old %s until worker(s) %s finish their pulls",
                        rid, buffer.replace("_", " "), late)
        return not late

    def _misfit(self, hello: m.Hello) -> str | None:
        """Why a process that said Hello after the handshake (a respawned worker, the
        evaluator) does not fit the node's model; None when it fits."""
        assert self.store is not None
        if (hello.param_count, hello.stats_count) == (self.store.layout.param_count, self.stats_count):
            return None
        return (f"built a model of {hello.param_count} values ({hello.stats_count} statistics); "
                f"the node's has {self.store.layout.param_count} ({self.stats_count})")

    def _sum_slots(self, joins: dict[int, m.Join], weighted: bool = False) -> float:
        """The node's sum buffer := the sum of the participants' slots, each times its
        weight (``Rule.weights``) when ``weighted``. Returns the sum of the weights."""
        assert self.store is not None
        weights = self._weights(joins) if weighted else [1.0] * len(joins)
        ops.weighted_sum_into_(self.store.buffer(SUM), [self.store.slot(i) for i in joins], weights)
        return float(sum(weights))

    def _weights(self, joins: dict[int, m.Join]) -> list[float]:
        """The participants' weights, as the rule says, asked once for the node's participants
        together; a weight out of [1e-6, 1e6] is clipped (logged once)."""
        cs = [Contribution(self.workers[i].worker_id, j.loss, dict(j.scalars))
              for i, j in joins.items()]
        # a worker called into a round before its first step has no value to give yet
        self._tell_missing_scalars([c for c, (i, j) in zip(cs, joins.items())
                                    if j.iterations > self.workers[i].set_up_at])
        weights, clipped = node_weights(self.rule, cs)
        for pos, w in clipped:
            self.repeats.warning("weight", "rule %s gave worker %d the weight %r, outside "
                                 "[1e-6, 1e6]; clipped", self.rule.name, cs[pos].worker_id, w)
        return weights

    def _average_stats(self, joins: dict[int, m.Join]) -> bool:
        """Set every participant's statistics (the slot's tail) to their mean over ``joins``."""
        assert self.store is not None
        if not self.average_stats or not joins:
            return False
        tails = [self.store.slot(i)[-self.stats_count:] for i in joins]
        mean = np.mean(tails, axis=0, dtype=np.float64).astype(np.float32)
        for tail in tails:
            tail[:] = mean
        return True

    def _collect_joins(self, rid: int, kind: RoundKind) -> dict[int, m.Join]:
        for i in self.pending:
            if not self.workers[i].gone:
                self._send(self.workers[i], m.RoundCall(rid, int(kind)))
        self.pending.clear()
        joins: dict[int, m.Join] = {}
        end = time.monotonic() + self.cfg.round_timeout
        while time.monotonic() < end and any(w.local not in joins and not w.absent
                                              for w in self._live()):
            msg = self._recv()
            if msg is None:
                continue
            w = self.workers[msg.local]
            if isinstance(msg, (m.Ask, m.Done)):
                if isinstance(msg, m.Ask):
                    self._account(w, msg.consumed)
                self._send(w, m.RoundCall(rid, int(kind)))
            elif isinstance(msg, m.Join):
                self._account(w, msg.consumed)
                if msg.round_id == rid:
                    joins[msg.local] = msg  # dropped below if this process dies meanwhile
                else:
                    self._send(w, m.Pull(msg.round_id, (), False))
        missing = [w for w in self._live() if w.local not in joins and not w.absent]
        if missing:
            log.warning("round %d: worker(s) %s missed it (round_timeout %g s); later rounds "
                        "go on without waiting for them until they are heard from", rid,
                        [w.worker_id for w in missing], self.cfg.round_timeout)
            for w in missing:
                w.absent = True
        # A participant that died (even if already started again) is out of the round at once.
        return {i: j for i, j in joins.items()
                if not self.workers[i].gone and self.workers[i].life == j.life}

    def _collect_dones(self, rid: int, expected: set[int]) -> dict[int, dict[str, float]]:
        dones: dict[int, dict[str, float]] = {}
        lives = {i: self.workers[i].life for i in expected}  # the processes that joined

        def waited(i: int) -> bool:  # a dead participant is not waited for, nor its successor
            w = self.workers[i]
            return i not in dones and not w.gone and w.life == lives[i]

        end = time.monotonic() + self.cfg.round_timeout
        while time.monotonic() < end and any(waited(i) for i in expected):
            msg = self._recv()
            if msg is None:
                continue
            if isinstance(msg, m.Done) and msg.round_id == rid and lives.get(msg.local) == msg.life:
                dones[msg.local] = msg.distances
                self.pending.append(msg.local)
            else:
                self._dispatch(msg)
        late = [self.workers[i].worker_id for i in expected if waited(i)]
        if late:
            log.warning("round %d: worker(s) %s did not finish their pulls in time", rid, late)
        return dones

    def _report(self, rid: int, best: Candidate | None, participants: int, weight: float = 0.0,
                then_pull: str | None = None,
                then_push: tuple[str, int, float] | None = None):
        """Report round ``rid``: the answer, or None. ``then_pull`` names the download, and
        ``then_push`` (buffer, summands, weight) the upload of the node's sum, that follow the
        answer (``GlobalClient.report_round``: small ones travel with it)."""
        push = None
        if then_push is not None:
            assert self.store is not None
            name, summands, push_weight = then_push
            push = (self.store.buffer(name), summands, push_weight)
        try:  # a global round's barrier: up to round_timeout (then the leader's, as much)
            with self._network_call(2 if then_pull else 1):
                answer = self.client.report_round(rid, best, participants, weight,
                                                  then_pull=then_pull, wire=self.cfg.wire,
                                                  then_push=push)
        except grpc.RpcError as exc:
            if exc.code() in RECOVERABLE - {grpc.StatusCode.DEADLINE_EXCEEDED}:
                self._detach(f"{exc.code().name}: {exc.details()}")
            log.warning("round %d: report failed (%s); skipping its exchange", rid, exc.details())
            return None
        self._check_stopped()  # a round closed by a job stop: no exchange
        if answer.missed:
            self.repeats.warning("reported too late",
                                 "round %d: this node reported too late; skipping its exchange", rid)
        return answer

    def _push(self, name: str | None, kind: str, rid: int, summands: int = 0,
              weight: float = 0.0, vec: np.ndarray | None = None) -> bool:
        """Upload buffer ``name`` (or ``vec`` when given) as ``kind``."""
        assert self.store is not None
        try:
            with self._network_call():
                self.client.push(kind, self.store.buffer(name) if vec is None else vec, rid,
                                 summands, wire=self.cfg.wire, weight=weight)
            return True
        except grpc.RpcError as exc:
            log.warning("round %d: upload of %s failed: %s", rid, kind, exc.details())
            return False

    def _tell_missing_scalars(self, cs: list[Contribution]) -> None:
        """Once per node: a per-step scalar the rule uses that a worker does not give."""
        for c in cs:
            missing = [name for name in self.rule.scalars if name not in c.scalars]
            if missing and not getattr(self, "_told_missing", False):
                self._told_missing = True
                log.warning("rule %s uses the per-step scalar '%s', which worker %d does not "
                            "give (or only non-finite values): pass it to step(), e.g. "
                            "worker.step(loss, %s=...) (PyTorch: register(model) reads grad_norm "
                            "from .grad); until it does the rule falls back to its default "
                            "(GRAWA: weight 1, plain averaging)", self.rule.name,
                            "/".join(missing), c.worker_id, missing[0])

    def _network_call(self, rounds: int = 1):
        """Beat for the loop during one round-scale call to the global server (its deadline is
        ``rounds * round_timeout + RPC_TIMEOUT``), so that the workers do not take the wait
        for death."""
        return self.liveness.blocking(rounds * self.cfg.round_timeout + RPC_TIMEOUT + 5)

    def _pull(self, name: str, kind: str, rid: int) -> bool:
        """Download ``kind`` into buffer ``name``; a broken download leaves ``name`` untouched.

        Round 0 (outside any round: the newest center or leader) tries again when the server's
        buffer changed during the download.
        """
        assert self.store is not None
        for attempt in range(1 if rid else 3):
            try:
                # Stage in the sum buffer (free at this point of every round), copy when complete.
                with self._network_call():
                    self.client.pull(kind, self.store.buffer(SUM), rid, wire=self.cfg.wire)
                if name != SUM:
                    ops.copy_(self.store.buffer(name), self.store.buffer(SUM))
                return True
            except (grpc.RpcError, ValueError) as exc:
                details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.ABORTED and attempt < 2:
                    continue
                log.warning("round %d: download of %s failed: %s", rid, kind, details)
        return False

    def _final_round(self, rid: int, iteration: int, joins: dict[int, m.Join], best: Candidate | None,
                     local_of: dict[int, int]) -> bool:
        assert self.store is not None
        self._flush_async()  # an asynchronous rule's last deltas reach the center first
        self.view.wait(f"final round {rid}: electing the final leader", key="final")
        if joins:
            self._sum_slots(joins)
        answer = self._report(rid, best, len(joins),
                              then_push=(SUM, len(joins), 0.0) if joins and self.plane is None
                              else None)
        if answer and not answer.missed:
            self.view.on_round(rid, "final", answer.leader, answer.leader_node)
            if answer.leader and answer.leader_node == self.cfg.node_index:
                ops.copy_(self.store.buffer(GLOBAL_LEADER), self.store.slot(local_of[answer.leader.worker_id]))
                self._push(GLOBAL_LEADER, GLOBAL_LEADER, rid)
            if joins:
                self._push(SUM, SUM, rid, summands=len(joins))
        self.summary.update(round_id=rid, node=self.cfg.node_index)
        if answer and answer.leader:
            self.summary["final_leader"] = {"worker_id": answer.leader.worker_id,
                                            "loss": answer.leader.loss}
            self.summary["participants"] = answer.participants
        if self.cfg.node_index == 0 and answer and not answer.missed and joins:
            evaluate: list[str] = []
            # Downloads stage in the sum buffer, so the average (which lands there) comes last.
            if answer.leader and self._pull(GLOBAL_LEADER, GLOBAL_LEADER, rid):
                evaluate.append(GLOBAL_LEADER)
            if self.rule.exchange == Exchange.CENTER and self._pull(CENTER, CENTER, 0):
                evaluate.append(CENTER)
            if self._pull(SUM, "average", rid):
                evaluate.append(SUM)
            self.view.wait(f"final round {rid}: evaluating", key="final")
            self.summary["evaluation"] = self._evaluate(min(joins), tuple(evaluate), rid,
                                                        iteration,
                                                        answer.leader.worker_id if answer.leader else None)
        self._finish_evaluator()
        self._stop_workers()
        r, self.report = self.report, Report()
        self.summary["counter"] = self.client.leave(r.consumed, r.late)
        self._forget_session()
        return True

    def _stop_workers(self) -> None:
        """Send Stop and collect the last reports (steps of late workers count too)."""
        self.stopping = True
        self.stop_sent_at = time.monotonic()
        self.view.wait("stopping the workers")
        for w in self._live():
            self._send(w, m.Stop("job finished"))
        end = time.monotonic() + STOP_GRACE
        while time.monotonic() < end and any(w.proc.is_alive() for w in self._live()):
            msg = self._recv()
            if isinstance(msg, (m.Ask, m.Join)):
                self._account(self.workers[msg.local], msg.consumed)
                self._send(self.workers[msg.local], m.Stop("job finished"))
        for _ in range(10 * len(self.workers) + 10):  # what is still queued
            msg = self._recv(timeout=0.01)
            if isinstance(msg, (m.Ask, m.Join)):
                self._account(self.workers[msg.local], msg.consumed)
            elif msg is None and self.inbox.empty():
                break
