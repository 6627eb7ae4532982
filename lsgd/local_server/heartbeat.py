"""The node's heartbeat thread, and the status report each beat carries.

The beat keeps the node a member of the job between the node loop's own calls, tells the loop
when the server no longer counts it a member (or cannot be reached), and carries what the
status page shows of this node (``node_report``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import grpc

from ..leader import Candidate
from ..proto import lsgd_pb2 as pb
from .global_client import RPC_TIMEOUT, GlobalClient
from .view import Evaluation, NodeView, Snapshot

log = logging.getLogger(__name__)

REPORT_EVERY = 3  # intervals between beats at most, while the node loop's calls keep it alive
MAX_EVALUATIONS = 64  # evaluations per heartbeat (the server's bound)
MAX_METRIC = 64  # characters of an evaluation's metric name (the server's bound)


class Heartbeat:
    """Background thread that keeps the node alive on the global server between calls.

    ``trouble`` becomes a message when the server says this node is no longer a member, or has
    been unreachable for ``give_up`` seconds; the node loop then trains on without the server
    and reattaches (clearing ``trouble``). The thread goes on beating with the newest session.

    The thread beats for the node loop, not for the process: while ``loop_silent()`` (seconds
    since the loop's liveness beat, ``liveness.py``) exceeds ``stale_after``, it skips its
    beats, so the server drops a node whose loop is stuck, as it drops a dead one.

    A beat is also skipped while the node loop's own calls keep the node alive on the server
    (one answered within ``interval``), down to one beat every ``REPORT_EVERY`` intervals, which
    carries the status report: at 512 nodes, beats of busy nodes were a sixth of the server's
    calls (issue 15). Not while the job waits for nodes to join: the beats' answers say who is
    missing, and when the job starts.
    """

    def __init__(self, client: GlobalClient, interval: float, give_up: float,
                 view: NodeView | None = None, loop_silent: Callable[[], float] | None = None,
                 stale_after: float = math.inf) -> None:
        self.client, self.interval, self.give_up = client, interval, give_up
        self.loop_silent, self.stale_after = loop_silent, stale_after
        self.loop_stuck = False  # the beats are skipped: the node loop is stuck
        self.view = view  # reported with each beat, and told the answer
        self.evaluations_held = 0  # the server holds the node's evaluations up to this index
        self._reporting = True  # False once the server refused a report
        self.trouble: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lsgd-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RPC_TIMEOUT + 1)

    def _run(self) -> None:
        last_ok = time.monotonic()
        beaten = -math.inf
        while not self._stop.wait(self.interval):
            if self._loop_stuck():
                last_ok = time.monotonic()  # silence we chose is not the server's
                continue
            now = time.monotonic()
            if (now - self.client.answered_at < self.interval
                    and now - beaten < REPORT_EVERY * self.interval
                    and not self._waiting_for_nodes()):
                last_ok = now  # the server answered the node loop meanwhile
                continue
            beaten = now
            session = self.client.session
            try:
                resp = self.client.beat(self._watched(self._report) if self._reporting else None)
                last_ok = time.monotonic()
                self._watched(self._heard, resp)
            except grpc.RpcError as exc:
                if self.client.session != session:  # the node reattached meanwhile: stale
                    continue
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and self._reporting:
                    # Only the status report can be wrong: the beat goes on without reports.
                    log.warning("the global server refused this node's status report (%s); "
                                "status reports stop, training goes on", exc.details())
                    self._reporting = False
                    continue
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    self.trouble = f"global server refused this node: {exc.details()}"
                elif time.monotonic() - last_ok > self.give_up:
                    self.trouble = (f"global server at {self.client.address} unreachable for "
                                    f"{self.give_up:g} s ({exc.code().name})")

    def _waiting_for_nodes(self) -> bool:
        """The job has not started (or no beat has said yet): every beat, so that the node says
        who it waits for, and sees the start, within an interval. (Its loop's long-polls are
        answered meanwhile, which would thin the beats out.)"""
        return self.view is not None and self.view.waiting_for_nodes()

    def _loop_stuck(self) -> bool:
        silent = 0.0 if self.loop_silent is None else self.loop_silent()
        stuck = silent > self.stale_after
        if stuck != self.loop_stuck:
            self.loop_stuck = stuck
            if stuck:
                log.error("the node loop has not run for %.0f s: heartbeats stop, so the global "
                          "server drops this node", silent)
            else:
                log.warning("the node loop runs again: heartbeats go on")
        return stuck

    def _watched(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a part of watching the job; one that fails stops the reports, never the beat."""
        if self.view is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the beat keeps the node in the job
            log.warning("node status reports stopped: %s: %s", type(exc).__name__, exc)
            self.view = None
            return None

    def _report(self) -> pb.NodeReport:
        assert self.view is not None
        start, evaluations = self.view.evaluations_since(self.evaluations_held, MAX_EVALUATIONS)
        return node_report(self.view.snapshot(), start, evaluations)

    def _heard(self, resp: pb.HeartbeatResponse) -> None:
        assert self.view is not None
        self.evaluations_held = resp.evaluations_held
        leader = Candidate(resp.leader.worker_id, resp.leader.loss) if resp.has_leader else None
        self.view.on_heartbeat(counter=resp.counter, nodes_alive=resp.nodes_alive,
                               nodes_missing=resp.nodes_missing, job_started=resp.job_started,
                               leader=leader, leader_node=resp.leader_node, rounds=resp.rounds)


def _printable(text: str) -> str:
    """A metric name as the server accepts it: unprintable characters become '?'."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def node_report(s: Snapshot, evaluations_from: int, evaluations: list[Evaluation]) -> pb.NodeReport:
    """The ``NodeReport`` of a heartbeat: this node's workers only, at most
    ``MAX_EVALUATIONS`` evaluations, metric names cut to ``MAX_METRIC`` characters."""
    report = pb.NodeReport(steps=s.steps, rate=max(0.0, s.node_rate or 0.0),
                           workers_training=s.workers_training, reattaches=s.reattaches,
                           evaluations_from=evaluations_from)
    for w in s.workers:
        report.workers.add(worker_id=w.worker_id, iterations=w.iterations, loss=w.loss,
                           distance=w.distance, distance_to=w.distance_to, resets=w.resets,
                           respawns=w.respawns, training=w.training, round_id=w.round_id)
    if s.local_leader is not None:
        report.has_local_leader = True
        report.local_leader.worker_id = s.local_leader.worker_id
        report.local_leader.loss = s.local_leader.loss
    for e in evaluations[:MAX_EVALUATIONS]:
        report.evaluations.add(round_id=e.round_id, iteration=e.iteration, target=e.target,
                               metric=_printable(e.metric)[:MAX_METRIC], value=e.value,
                               worker_id=e.worker_id if e.worker_id is not None else 0)
    return report
