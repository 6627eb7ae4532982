"""The local server: one per node.

It owns the node's shared memory and worker processes, answers workers' credit requests from
the node's pool of credits (asking the global server only when the pool is empty), and runs
rounds (``round_runner.py``): collect the workers' published parameters, elect the node's best,
exchange leader or center parameters with the global server, tell every participant what to
pull.

Every wait is bounded: a worker that misses a round's deadline is left out of it (and logged);
a worker holding credits silently for ``round_timeout`` has them released so the job's rounds
still happen; a dead worker is noticed within ``POLL`` seconds, however busy the inbox.

With ``eval_every``, node 0 also runs an *evaluator*: one more process that builds the user's
model but never trains. At an evaluation round it copies the leader, average and center buffers
(the node waits only for that copy) and evaluates them while the workers train on.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import queue
import time
from collections import deque
from pathlib import Path
from typing import Callable

import grpc

from .. import exitcodes
from ..config import JobConfig
from ..files import private_dir
from ..lograte import RepeatedLog
from ..security import Security
from . import messages as m
from . import tensorboard
from .async_node import AsyncNode
from .async_rounds import AsyncMixin
from .chain import ChainMixin
from .ending import EndingMixin
from .evaluation import EvaluationMixin, Evaluator
from .global_client import CreditAnswer, GlobalClient, GlobalUnreachable
from .heartbeat import Heartbeat
from .inbox import Inbox
from .liveness import LoopBeat
from .metrics import MetricsWriter
from .procs import end_group
from .progress import Progress
from .recovery import RecoveryMixin
from .round_runner import RECOVERABLE, RoundMixin
from .startup import StartupMixin
from .state import NodeError, Report, WorkerState
from .store import NodeStore
from .view import NodeView

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between liveness checks while waiting for messages
VIEW_EVERY = 0.25  # seconds between updates of the view with the workers' step counts
IDLE_POLL = 0.5  # seconds between report-only credit calls while no worker is waiting
WANT = 1 << 20  # credits asked for at once; the global server grants half a fair share


class LocalServer(StartupMixin, RoundMixin, ChainMixin, AsyncMixin, EvaluationMixin,
                  RecoveryMixin, EndingMixin):
    """Runs one node of a job. ``run()`` returns the process exit code."""

    def __init__(self, config: JobConfig, address: str, log_level: int = logging.INFO,
                 security: Security | None = None) -> None:
        self.cfg = config
        self.rule = config.make_rule()
        self.address = address
        self.log_level = log_level
        self.multi_node = config.num_groups > 1
        self.mp = mp.get_context("spawn")
        self.inbox = Inbox(self.mp)  # one pipe per worker process (inbox.py)
        self.beat = self.mp.Value("d", time.monotonic(), lock=False)  # workers watch our loop run
        self.liveness = LoopBeat(self.beat)  # ... also while it blocks in a bounded call
        self.stopping = False  # the job is over: workers leaving is expected
        self.round_due: CreditAnswer | None = None
        self.last_acquire = time.monotonic()
        self.workers: list[WorkerState] = []
        self.store: NodeStore | None = None
        self.security = security
        self.client = GlobalClient(address, config.job_id, config.node_index, config.round_timeout,
                                   security)
        self.client.transfers.use_bulk = config.bulk_port != 0  # this node's BULK_PORT=0: gRPC
        self.heartbeat: Heartbeat | None = None
        self.pool = 0
        self.used_since = time.monotonic()  # the steps reported next were taken since then
        self.share = 1  # credits handed to a worker per request
        self.report = Report()
        self.pending: deque[int] = deque()
        self.last_round_seen = 0
        self.rounds = 0
        self.pulled_round = 0  # newest round whose pulls went out (never pulled twice)
        self.t0 = time.monotonic()
        self.dir = Path(config.run_dir) / f"node{config.node_index}"
        private_dir(self.dir)
        self.previous_rows = MetricsWriter.read(self.dir / "metrics.csv") if config.resume else []
        self.replaces = self._previous_session()  # this node restarted after a crash
        self.metrics = MetricsWriter(self.dir / "metrics.csv", staged=config.resume,
                                     keep=bool(self.replaces))
        self.view = NodeView(config)  # what this node knows of the job (view.py)
        self.metrics.add_sink(self.view.on_rows)
        self.progress = Progress(self.view, config)  # the live line or progress lines
        self.view_due = 0.0  # when _recv next gives the view the workers' step counts
        self.check_due = 0.0  # when _recv next checks the workers' processes (every POLL s)
        self.summary: dict = {}
        self.layout_name: str | None = None
        self.detached_since: float | None = None  # global server out of reach since then
        self.unanswered: tuple[int, int] = (0, 0)  # (seq, steps) of a credit request in doubt
        self.next_reattach = 0.0
        self.reattach_delay = 0.2
        self.own_credits = 0  # steps it may still hand out while detached (recovery._detach)
        self.global_fate: Callable[[], str | None] = lambda: None  # node 0: why its server is gone
        self.param_count = 0
        self.training = False  # the handshake is over
        self.stats_count = 0  # trailing statistics entries, never pulled
        self.average_stats = False  # ... and averaged over each round's participants
        self.eval_leader: dict[int, int | None] = {}  # round -> leader id being evaluated
        self.resets: dict[int, int] = {}  # worker id -> resets after non-finite values
        self.evaluator: Evaluator | None = None
        self.gpus: list[str] | None = None  # each worker's GPU (gpus.py), set at start
        self.repeats = RepeatedLog(log)  # warnings that may come every round: once, then counted
        self.ending = {"rounds": 0, "healthy": 0, "elected": 0}  # rounds seen here (ending.py)
        self.stop_sent_at: float | None = None  # when the workers were told to stop
        self.closing = False  # shutting down: a second Ctrl-C must not interrupt it
        self.board = tensorboard.attach(config, self.metrics)  # TENSORBOARD=1: a metrics sink
        self.async_node: AsyncNode | None = None  # an asynchronous rule's side (async_node.py)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Run the node until the job ends; returns the exit code (``lsgd.exitcodes``).

        ``summary["stop_reason"]`` says why it ended, on every path (``ending.py``).
        """
        ended: BaseException | None = None
        try:
            self.progress.start()
            self._wait_for_global()
            self._start_workers()
            self._handshake()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every end is classified and summarized
            ended = exc
        finally:
            self.closing = True  # from here a Ctrl-C cannot cut the shutdown short (cli.py)
        code, reason = self._ended(ended)
        if code == exitcodes.CONFIG:
            log.error("node %d: %s", self.cfg.node_index, reason)
            self.summary["error"] = reason
        elif code == exitcodes.FAILED:
            if isinstance(ended, (NodeError, GlobalUnreachable, grpc.RpcError)):
                log.error("node %d: %s", self.cfg.node_index, reason)
            else:
                log.error("node %d: %s", self.cfg.node_index, reason, exc_info=ended)
            self.summary["error"] = reason
        elif code in (exitcodes.INTERRUPTED, exitcodes.TERMINATED):
            log.warning("node %d %s; stopping workers", self.cfg.node_index, reason)
            self.summary["error"] = reason
        self._shutdown(code, reason)
        return code

    # ------------------------------------------------------------------ messaging
    def _send(self, w: WorkerState | Evaluator, msg: object) -> None:
        if getattr(w, "starting", False) and not isinstance(msg, (m.Setup, m.Stop)):
            log.debug("worker %d: not sent before its Setup: %r", w.worker_id, msg)
            return  # meant for its dead predecessor (see _respawn)
        try:
            w.replies.put(msg)
        except (ValueError, OSError):  # queue closed during shutdown
            pass

    def _live(self) -> list[WorkerState]:
        return [w for w in self.workers if not w.gone]

    def _gone(self, w: WorkerState, why: str, logged: bool = False) -> None:
        if w.gone:
            return
        w.gone = True
        if w.outstanding and not w.released:
            self.report.released += w.outstanding
        w.outstanding = 0
        if self.stopping:
            return
        w.error = why
        if not logged:
            log.warning("worker %d left the job: %s", w.worker_id, why)

    def _check_workers(self) -> None:
        now = time.monotonic()
        self.check_due = now + POLL
        for w in self._live():
            if w.proc.exitcode is not None:
                end_group(w.proc.pid)  # what it started goes with it
                error, ended = self._last_words(w)
                if error is None and ended:  # its Bye, read only now: as if read in time
                    error = "the job is over" if self.stopping else "its training loop ended"
                    if w.proc.exitcode:
                        error += f", then its process exited with code {w.proc.exitcode}"
                self._gone(w, error or f"process exited with code {w.proc.exitcode}",
                           logged=w.reported)
                if not w.reported and not ended and not self.stopping and self.store is not None:
                    self._respawn(w)
            elif (w.outstanding and not w.released and w.local not in self.pending
                  and now - w.last_contact > self.cfg.round_timeout):
                log.warning("worker %d silent for %.0f s holding %d credits; releasing them",
                            w.worker_id, now - w.last_contact, w.outstanding)
                self.report.released += w.outstanding
                w.outstanding = 0
                w.released = True
        if self.async_node is not None and not self.stopping:
            for w in self.workers:  # gone for good (not restarted): its rule hands on its part
                if w.gone and w.local not in self.async_node.retired:
                    self.async_node.retire_worker(w.local)
        ev = self.evaluator
        if ev is not None and not ev.gone and ev.proc.exitcode is not None:
            end_group(ev.proc.pid)
            for msg in self.inbox.drain(ev.proc.pid):
                self._from_evaluator(msg)
            self._evaluator_gone(f"process exited with code {ev.proc.exitcode}")
        if not self._live() and not self.stopping:
            errors = [w.error for w in self.workers if w.error]
            raise NodeError(f"no worker left on this node; first error: {errors[0] if errors else '?'}")
        if self.heartbeat is not None and self.heartbeat.trouble and self.detached_since is None:
            self._detach(self.heartbeat.trouble)

    def _recv(self, timeout: float = POLL) -> object | None:
        self.beat.value = time.monotonic()
        if time.monotonic() >= self.view_due:
            self._tell_view()
        self._check_stopped()
        # Liveness on a fixed cadence, busy inbox or not: workers of an asynchronous rule send
        # a message every few steps, and a dead one must not wait for a quiet moment.
        if time.monotonic() >= self.check_due:
            self._check_workers()
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            self._check_workers()
            return None
        if msg.local == m.EVALUATOR:
            self._from_evaluator(msg)
            return None
        w = self.workers[msg.local]
        if getattr(msg, "life", 0) != w.life:  # sent by a process of this worker that died since
            self._from_the_dead(w, msg)
            return None
        w.last_contact = time.monotonic()
        if w.absent and not isinstance(msg, m.Hello):  # a respawned one is back once set up
            w.absent = False
            log.info("worker %d is back", w.worker_id)
        if isinstance(msg, m.Hello) and self.store is not None:
            self._setup_respawned(w, msg)
            return None
        if isinstance(msg, m.Failed):
            w.reported = True
            if msg.trace:
                log.error("worker %d failed: %s\n%s", w.worker_id, msg.error, msg.trace.rstrip())
            else:
                log.error("worker %d failed: %s", w.worker_id, msg.error)
            self._gone(w, msg.error, logged=True)
            self._check_workers()
            return None
        if isinstance(msg, m.Done):
            w.reading = frozenset()  # its pulls are over: the node may change those buffers
        if isinstance(msg, m.Progress):
            self._account(w, msg.consumed)
            return None
        if isinstance(msg, m.Exchange):
            self._account(w, msg.consumed)
            self._exchange(w, msg)
            return None
        if isinstance(msg, m.Bye):
            self._account(w, msg.consumed)
            self._gone(w, "the job is over" if self.stopping else "its training loop ended")
            self._check_workers()
            return None
        return msg

    def _tell_view(self) -> None:
        """Give the view the workers' step counts and states (a few times a second)."""
        self.view_due = time.monotonic() + VIEW_EVERY
        self.view.set_workers((w.worker_id, w.iterations, not (w.gone or w.absent or w.starting),
                               len(w.respawns)) for w in self.workers)

    def _account(self, w: WorkerState, consumed: int) -> None:
        w.iterations += consumed
        if w.released:
            self.report.late += consumed
            w.released = False
            return
        take = min(consumed, w.outstanding)
        w.outstanding -= take
        self.report.consumed += take
        self.report.late += consumed - take

    # ------------------------------------------------------------------ start
    # ------------------------------------------------------------------ credits
    def _loop(self) -> None:
        while True:
            answer = self._serve_pending()
            if answer is not None:
                if self._run_round(answer):
                    return
                self._take(answer.grant)  # the credits the round's answer carried, for after it
                continue  # the round's participants now wait for credits: serve them first
            msg = self._recv()
            if msg is not None:
                self._dispatch(msg)
            elif self.detached_since is not None:
                self._reattach()
            elif not self.pending and (self.report.released or self.report.late
                                       or time.monotonic() - self.last_acquire > IDLE_POLL):
                # Nobody waits here (busy or stuck workers), but the job may be waiting for our
                # released credits or for this node to take part in a round.
                answer = self._acquire(want=0)
                if answer.round_id > self.last_round_seen:
                    self.round_due = answer

    def _dispatch(self, msg: object) -> None:
        w = self.workers[msg.local]
        if isinstance(msg, m.Ask):
            self._account(w, msg.consumed)
            self.pending.append(w.local)
        elif isinstance(msg, m.Done):
            self.pending.append(w.local)  # a late Done: the worker now waits for credits
        elif isinstance(msg, m.Join):  # joined a round that already ended here
            self._account(w, msg.consumed)
            self._send(w, m.Pull(msg.round_id, (), False))
        else:
            log.debug("ignoring %r", msg)

    def _serve_pending(self) -> CreditAnswer | None:
        """Give credits to waiting workers; returns a round to run, if the server announced one."""
        if self.detached_since is not None and not self._reattach():
            # Train on without the server: credits of the node's own, counted as late steps
            # when it is back (they are not in any worker's outstanding credits), at most
            # ``own_credits`` per detachment, a rule the server checks (claims.py).
            while self.pending and self.own_credits > 0:
                w = self.workers[self.pending.popleft()]
                if not w.gone:
                    n = min(max(1, self.share), self.own_credits)
                    self.own_credits -= n
                    self._send(w, m.Credits(n))
            return None
        if self.round_due is not None:
            answer, self.round_due = self.round_due, None
            return answer
        while self.pending:
            w = self.workers[self.pending[0]]
            if w.gone:
                self.pending.popleft()
                continue
            if self.pool > 0:
                n = min(self.pool, self.share)
                self.pool -= n
                w.outstanding += n
                self.pending.popleft()
                self._send(w, m.Credits(n))
                continue
            answer = self._acquire(want=WANT)
            if answer.round_id > self.last_round_seen:
                return answer
            if answer.grant == 0:
                return None
            self._take(answer.grant)
        return None

    def _take(self, grant: int) -> None:
        """Add granted credits to the pool. Each worker takes an equal share of the grant; a
        faster one comes back for more. The steps reported next are timed from here, unless
        workers still step on earlier credits (their time already runs)."""
        if not any(w.outstanding for w in self._live()):
            self.used_since = time.monotonic()
        if grant:
            self.pool += grant
            self.share = math.ceil(self.pool / max(1, len(self._live())))

    def _acquire(self, want: int) -> CreditAnswer:
        r, self.report = self.report, Report()
        self.last_acquire = time.monotonic()
        try:
            # Long-poll only when no worker here holds credits: then only other nodes can
            # move the job forward. Otherwise our own workers' next reports will.
            busy = any(w.outstanding for w in self._live())
            answer = self.client.acquire(consumed=r.consumed, late=r.late, released=r.released,
                                         want=want, last_round_seen=self.last_round_seen,
                                         max_wait=0.0 if busy else 0.5,
                                         used=time.monotonic() - self.used_since)
            if r.consumed:  # a call without steps leaves the window open (an idle poll)
                self.used_since = time.monotonic()
            self.view.on_counter(answer.counter)
            return answer
        except grpc.RpcError as exc:
            if exc.code() not in RECOVERABLE:
                self.report = r
                raise
            # Applied or not, nobody knows: reattaching tells the server this request's number
            # and steps, and it counts them only if the request never arrived.
            self.unanswered = (self.client.last_seq, r.consumed + r.late)
            self._detach(f"{exc.code().name}: {exc.details()}")
            return CreditAnswer(0, 0, 0, 0, 0)
