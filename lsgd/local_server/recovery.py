"""What a node does when something fails: a diverged worker, a dead worker, a lost global
server, a restart in the middle of a job.

- A worker whose losses or parameters are not finite is reset to a leader or the center.
- A worker process that dies without reporting an error is started again (``respawn`` times)
  from the center or the newest leader.
- When the global server is out of reach the node *detaches*: its workers train on with credits
  of the node's own, and it reattaches with its session, the credits it holds and the steps the
  server has not counted (``reconnect_timeout`` bounds the wait).
- A node joining a running job starts from the center or newest leader; ``RESUME=1`` starts it
  from its checkpoint. A node restarted after a crash (by hand or by a supervisor) sends the
  session of its earlier run, kept in ``RUN_DIR/node<i>/session``, so that the server drops
  that run at once instead of refusing the index as taken; it appends to its ``metrics.csv``.

A mixin of ``LocalServer`` (``server.py``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections import deque

import grpc

from ..files import write_atomic
from ..rules import ops
from ..rules.base import CENTER, GLOBAL_LEADER, LOCAL_LEADER, Exchange, RoundKind
from . import checkpoint
from . import messages as m
from .ending import JobStopped
from .global_client import GlobalUnreachable, stop_reason_of
from .state import NodeError, Report, WorkerState

log = logging.getLogger("lsgd.local_server.server")


class RecoveryMixin:
    """Reset, respawn, detach/reattach, rejoin and resume (methods of ``LocalServer``)."""

    def _restart_point(self) -> str:
        """The node buffer a fresh worker starts from: the center, else the newest leader."""
        return CENTER if self.rule.exchange == Exchange.CENTER else GLOBAL_LEADER

    def _respawn(self, w: WorkerState) -> None:
        """Policy: a worker that died without reporting an error (killed, crashed) is started
        again, at most ``respawn`` times, from the leader or the center; a Python error in the
        user's code is not retried (it would fail the same way)."""
        if len(w.respawns) >= self.cfg.respawn:
            if self.cfg.respawn:
                log.warning("worker %d died %d times; the node goes on without it", w.worker_id,
                            len(w.respawns) + 1)
            return
        old = w.replies
        w.proc, w.replies = self._spawn(w.local, evaluator=False, name=f"worker-{w.worker_id}",
                                        restarts=len(w.respawns) + 1)
        old.cancel_join_thread()
        old.close()
        w.respawns.append(time.time())
        w.gone, w.error, w.released, w.outstanding = False, None, False, 0
        w.reading = frozenset()  # the new process never got the dead one's Pull
        w.absent = True  # rounds do not wait for it while it builds its model
        # Nothing may reach the new process before its Setup (``_send`` holds back all else):
        # forget what the dead one awaited. What it sent was read at its death (_last_words);
        # the life every message carries tells apart anything of it read later.
        w.starting = True
        self.pending = deque(i for i in self.pending if i != w.local)
        w.last_contact = time.monotonic()
        # a gossip rule has no center: its worker starts again from its slot (async_node.py)
        point = ("its own last exchange" if getattr(self.rule, "gossip", False)
                 else "the " + self._restart_point().replace("_", " "))
        log.warning("worker %d: started again (%d of at most %d), from %s", w.worker_id,
                    len(w.respawns), self.cfg.respawn, point)

    def _setup_respawned(self, w: WorkerState, hello: m.Hello) -> None:
        assert self.store is not None
        w.starting = False
        if (misfit := self._misfit(hello)) is not None:
            w.reported = True
            self._send(w, m.Stop("model size changed"))
            self._gone(w, misfit)
            return
        if not self.training:  # still in the handshake: the node's buffers are not set yet
            self._send(w, m.Setup(self.store.layout))
            return
        if self.async_node is not None:  # the node's copy of the center, which moves
            self.async_node.restart_worker(w.local)
        else:
            ops.copy_(self.store.slot(w.local), self.store.buffer(self._restart_point()))
        w.set_up_at = w.iterations
        self._send(w, m.Setup(self.store.layout, from_slot=True, iterations=w.iterations))

    def _last_words(self, w: WorkerState) -> tuple[str | None, bool]:
        """Read what the process of ``w`` that just exited sent and the node has not read yet
        (then its pipe is closed): its steps count. Returns (the error it reported, whether its
        loop ended on its own: a Bye). Neither is respawned: the error would come back, and a
        loop that ended would run again from its first step."""
        error, ended = None, False
        for msg in self.inbox.drain(w.proc.pid):
            if isinstance(msg, m.Failed):
                w.reported, error = True, msg.error
                log.error("worker %d failed: %s%s", w.worker_id, msg.error,
                          "\n" + msg.trace.rstrip() if msg.trace else "")
            elif getattr(msg, "consumed", 0):
                self._account(w, msg.consumed)
            ended = ended or isinstance(msg, m.Bye)
        return error, ended

    def _from_the_dead(self, w: WorkerState, msg: object) -> None:
        """A message that a process of ``w`` sent before it died, read after its death was seen:
        nothing is answered (the answer would reach its successor). Its steps count, as late
        steps: the credits they used were released when it died."""
        consumed = getattr(msg, "consumed", 0)
        w.iterations += consumed
        self.report.late += consumed
        log.debug("worker %d: ignoring %r of its dead process", w.worker_id, msg)

    def _detach(self, why: str) -> None:
        """The global server is out of reach: the workers train on; reattach when it is back."""
        if self.detached_since is None:
            self.detached_since = time.monotonic()
            self.next_reattach, self.reattach_delay = 0.0, 0.2
            # Steps on credits of its own until it is back: one global period of the job (the
            # bound the server allows, Schedule.detached_steps); then its workers wait.
            cfg = self.cfg
            self.own_credits = cfg.num_groups * cfg.workers * cfg.g_comm
            log.warning("node %d: lost the global server (%s); training on by itself and "
                        "reattaching (RECONNECT_TIMEOUT %g s)", self.cfg.node_index, why,
                        self.cfg.reconnect_timeout)
            self.view.wait("detached from the global server, reattaching", "RECONNECT_TIMEOUT",
                           cfg.reconnect_timeout)

    def _reattach(self) -> bool:
        """Try to reattach (rate-limited, with backoff); True once attached again."""
        now = time.monotonic()
        if self.detached_since is None:
            return True
        if now < self.next_reattach:
            return False
        if (fate := self.global_fate()) is not None:  # node 0's own server is gone for good
            raise NodeError(fate)
        if now - self.detached_since > self.cfg.reconnect_timeout:
            raise NodeError(f"global server out of reach for {now - self.detached_since:.0f} s "
                            f"(RECONNECT_TIMEOUT); giving up")
        held = self.pool + sum(w.outstanding for w in self._live())
        r = self.report
        old_session, old_epoch = self.client.session, self.client.epoch
        try:
            resp = self.client.join(workers=self.cfg.workers, param_count=self.param_count,
                                    algorithm=self.cfg.rule_spec, num_groups=self.cfg.num_groups,
                                    connect_timeout=0.5, resume=True, held=held,
                                    unreported=r.consumed + r.late, unanswered=self.unanswered)
        except GlobalUnreachable:
            self.next_reattach = now + self.reattach_delay
            self.reattach_delay = min(2 * self.reattach_delay, 2.0)
            return False
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.next_reattach = now + self.reattach_delay
                return False
            if (why := stop_reason_of(exc)) is not None:  # the job was stopped meanwhile
                raise JobStopped(why) from None
            # e.g. the server no longer knows this node's session: one line, no retry loop
            raise NodeError(f"reattaching: {exc.details()} ({exc.code().name})") from None
        if resp.session != old_session:  # the server refuses unknown sessions; never expected
            raise NodeError("the global server gave this node a new session on reattaching")
        self.report = Report()  # the server counted them and took over the held credits
        self.used_since = time.monotonic()  # steps detached were counted apart: not timed
        self.unanswered = (0, 0)
        self.last_round_seen = resp.round_id
        self.round_due = None
        if self.heartbeat is not None:
            self.heartbeat.trouble = None
        log.warning("node %d: reattached after %.1f s (%s); counter %d", self.cfg.node_index,
                    now - self.detached_since,
                    "the global server had restarted" if resp.epoch != old_epoch else "same server",
                    resp.counter)
        self.detached_since = None
        self.view.reattached()
        return True

    def _previous_session(self) -> int:
        """The session of this node's earlier run of the same job, which never left it (it
        crashed or was killed); 0 if there is none.

        The node holds an exclusive lock on ``RUN_DIR/node<i>/lock`` while it runs (the kernel
        drops it with the process, however it dies): if another run holds it, that run is
        alive and this one must not replace it (the server refuses a duplicate index).
        """
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            log.warning("node %d: another run of this node holds %s", self.cfg.node_index,
                        self.dir / "lock")
            return 0
        self._lock_fd = fd  # held until the process exits
        try:
            saved = json.loads((self.dir / "session").read_text())
            if saved.get("job_id") == self.cfg.job_id:
                return int(saved["session"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return 0

    def _joined(self, session: int, counter: int) -> None:
        """After a join: keep the session for a restart of this node; a node that replaced an
        earlier run of a running job keeps its metrics rows, in a new job they start afresh."""
        if self.replaces and counter == 0:
            self.metrics.restart()
        self._keep_session(session)

    def _keep_session(self, session: int) -> None:
        write_atomic(self.dir / "session",
                     json.dumps({"job_id": self.cfg.job_id, "session": session}))

    def _forget_session(self) -> None:
        """The node left the job: a later start of it is a new member."""
        (self.dir / "session").unlink(missing_ok=True)
    def _report_again(self, rid: int) -> bool:
        """A round handed to the node again: its report failed after the pulls went out, and
        the node reattached while the round still waited for it. Report it (so that it does not
        wait for this node, and the final round is never skipped) but run nothing twice: no
        collection, no pull, no part in the exchange (no candidate, no participants), as for a
        node whose workers all missed the round. Returns False (the job goes on)."""
        self.last_round_seen = rid
        log.warning("round %d: handed again after reattaching; its pulls were applied already, "
                    "reporting it without an exchange", rid)
        self._report(rid, None, 0)
        return False

    def _rejoin_point(self) -> str | None:
        """Joining a running job (a restarted node): download the center or the newest leader
        for the workers to start from; None (start from the model's own init) if there is none."""
        start = self._restart_point()
        if self._pull(start, start, 0):
            log.info("node %d joins a running job; its workers start from the %s",
                     self.cfg.node_index, start.replace("_", " "))
            return start
        log.warning("node %d joins a running job without a %s to start from", self.cfg.node_index,
                    start.replace("_", " "))
        return None

    def _resume(self) -> dict:
        """RESUME=1: slots, node buffers, step counts and metrics rows of the last checkpoint."""
        assert self.store is not None
        try:
            meta = checkpoint.load(self.dir, self.store)
        except checkpoint.CheckpointError as exc:
            raise NodeError(str(exc)) from None
        for w in self.workers:
            w.iterations = int(meta["worker_iterations"].get(str(w.worker_id), 0))
        self.metrics.resume(self.previous_rows, meta["round"])
        log.info("node %d resumes from its checkpoint of round %d (iteration %d)",
                 self.cfg.node_index, meta["round"], meta["iteration"])
        return meta

    def _reset_sick(self, rid: int, kind: RoundKind, sick: dict[int, m.Join],
                    new_local_leader: bool) -> dict[int, str]:
        """Tell each non-finite worker to copy a good model: the center (EASGD), else this
        round's local leader, else the newest global leader (every node buffer only ever holds
        the finite parameters of a healthy worker, or the initial ones)."""
        if not sick:
            return {}
        if self.rule.exchange == Exchange.CENTER:
            target = CENTER
        elif new_local_leader and kind == RoundKind.LOCAL and LOCAL_LEADER in self.store.layout.buffers:
            target = LOCAL_LEADER
        else:
            target = GLOBAL_LEADER
        for i in sick:
            w = self.workers[i]
            self.repeats.warning(f"worker {w.worker_id} reset",
                                 "round %d: worker %d has non-finite losses or parameters; "
                                 "resetting it to the %s", rid, w.worker_id,
                                 target.replace("_", " "))
            self.resets[w.worker_id] = self.resets.get(w.worker_id, 0) + 1
            w.reading = frozenset({target})
            self._send(w, m.Pull(rid, ((target, 1.0),), True, reset=True))
        return {i: target for i in sick}
