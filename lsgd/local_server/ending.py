"""How a node ends: its exit code and the reason in its summary, and node 0 stopping the job.

- A job that finished exits 0 (``exitcodes.OK``), or 3 (``DEGRADED``) when its result is
  suspect: a worker of this node failed and was not restarted, every loss was non-finite, or
  (LSGD) no leader was ever elected. The problems go to ``summary.json`` and the final lines.
- Node 0 ending for any other reason (Ctrl-C, SIGTERM, no worker left, a failure) stops the
  whole job: it tells the global server (``Leave`` with ``stop_job``), which tells every other
  node in its next answer. A node told so ends with ``exitcodes.STOPPED`` (4) and one line.
- Any other node ending early (Ctrl-C, SIGTERM, a failure) leaves the job (``Leave``), so the
  others go on at once instead of waiting ``node_timeout`` for its silence.

A mixin of ``LocalServer`` (``server.py``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import grpc

from .. import exitcodes
from ..files import write_atomic
from ..rules.base import Exchange
from . import messages as m
from .global_client import GlobalUnreachable, stop_reason_of
from .procs import stop_process
from .round_runner import STOP_GRACE
from .state import JoinedTooLate, JoinRefused, NodeError, Report
from .store import SharedMemoryTooSmall
from .summary import budget_reason, where_to_look

log = logging.getLogger("lsgd.local_server.server")

STOP_CALL_TIMEOUT = 2.0  # seconds for telling the global server that the job stops (best effort)
LEAVE_TIMEOUT = 1.0  # seconds for a stopped node's last report (the server may be gone)


class JobStopped(NodeError):
    """Node 0 stopped the job; the message is the reason the global server gave."""


class EndingMixin:
    """Exit code, stop reason, job stop and the shutdown (methods of ``LocalServer``)."""

    def _shutdown(self, code: int = exitcodes.FAILED, reason: str = "") -> None:
        self.closing = True
        self.progress.close()  # the live line is erased before the last lines
        self._announce_stop(code, reason)  # node 0 ending early: first tell the other nodes
        self.liveness.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        procs = [w for w in self.workers] + ([self.evaluator] if self.evaluator else [])
        for w in procs:
            if w.proc.is_alive():
                self._send(w, m.Stop("node shutting down"))
        self._stop_plane()
        if self.async_node is not None:  # its thread uses the segment: stop it first
            self.async_node.stop()
            stats = self.async_node.stats()
            if "weights" in stats:  # gossip: by worker id
                stats["weights"] = {self.cfg.worker_id(i): w for i, w in stats["weights"].items()}
            self.summary["async"] = stats
        # Each worker gets STOP_GRACE from its first Stop to exit (it may still be tearing down
        # its interpreter after its last message), and at least a moment from now.
        now = time.monotonic()
        since = self.stop_sent_at if self.stop_sent_at is not None else now
        end = max(now + 0.5, since + STOP_GRACE)
        for w in procs:
            w.proc.join(max(0.0, end - time.monotonic()))
        for w in procs:
            if w.proc.is_alive():
                log.warning("%s did not stop in %.1f s; terminating", w.proc.name,
                            time.monotonic() - since)
            stop_process(w.proc, 2.0)  # and what it started
        for q in [self.inbox] + [w.replies for w in procs]:
            q.cancel_join_thread()
            q.close()
        if self.store is not None:
            self.store.close(unlink=True)
            self.store = None
        self.metrics.close()
        if self.board is not None:
            self.board.close()
        self._leave_at_end(code)  # after the workers' teardown: their last steps are counted
        self.client.close()
        self.summary.setdefault("node", self.cfg.node_index)
        self.summary["stop_reason"] = reason or "unknown"
        self.summary["exit_code"] = code
        self.summary["workers"] = {w.worker_id: w.iterations for w in self.workers}
        self.summary["pids"] = [os.getpid()] + [w.proc.pid for w in procs]
        if self.evaluator is not None:
            self.summary["evaluator"] = {"evaluations": self.evaluator.done,
                                         "skipped": self.evaluator.skipped,
                                         "exit_code": self.evaluator.proc.exitcode}
        self.summary["resets"] = self.resets
        # parameter transfers with the global server: on its bulk port, or as gRPC streams
        self.summary["transfers"] = dict(self.client.transfers.moved)
        self.summary["repeated_warnings"] = self.repeats.flush()
        self.summary["respawns"] = {w.worker_id: w.respawns for w in self.workers if w.respawns}
        self.summary["worker_exit_codes"] = {w.worker_id: w.proc.exitcode for w in self.workers}
        self.summary["shm"] = self.layout_name
        self.summary["seconds"] = round(time.monotonic() - self.t0, 3)
        started = time.time() - (time.monotonic() - self.t0)
        self.summary.update(self.view.final(), files=where_to_look(self.cfg, since=started))
        if code in (exitcodes.OK, exitcodes.DEGRADED):
            self.summary["job_stop_reason"] = budget_reason(self.cfg, self.summary.get("counter"))
        write_atomic(self.dir / "summary.json", json.dumps(self.summary, indent=2))

    # ------------------------------------------------------------------ while running
    def _check_stopped(self) -> None:
        """Raise JobStopped once any answer of the global server said the job was stopped."""
        if self.client.stopped:
            raise JobStopped(self.client.stopped)

    def _note_election(self, healthy: int, best: object) -> None:
        """Record a round's outcome on this node: how many workers had finite losses, and
        whether a leader was elected."""
        self.ending["rounds"] += 1
        self.ending["healthy"] += healthy
        self.ending["elected"] += best is not None

    # ------------------------------------------------------------------ the end
    def _ended(self, exc: BaseException | None) -> tuple[int, str]:
        """The exit code and the reason of this node's end; ``exc`` is what ended the run (None:
        the job finished)."""
        if exc is None:
            problems = self._problems()
            if problems:
                self.summary["problems"] = problems
                return exitcodes.DEGRADED, "job finished with problems: " + "; ".join(problems)
            return exitcodes.OK, "job finished"
        if isinstance(exc, JobStopped):
            return exitcodes.STOPPED, str(exc)
        if isinstance(exc, KeyboardInterrupt):  # cli raises it with the signal number
            if exc.args and exc.args[0] == signal.SIGTERM:
                return exitcodes.TERMINATED, "terminated"
            return exitcodes.INTERRUPTED, "interrupted"
        if isinstance(exc, grpc.RpcError):
            stopped = stop_reason_of(exc)
            if stopped:
                return exitcodes.STOPPED, stopped
            return exitcodes.FAILED, f"global server: {exc.details()} ({exc.code().name})"
        if isinstance(exc, SharedMemoryTooSmall):
            return exitcodes.CONFIG, str(exc)
        if isinstance(exc, GlobalUnreachable):
            # node 0: the server it started died, which is not a matter of IP_ADDR/PORT
            return exitcodes.FAILED, self.global_fate() or str(exc)
        if isinstance(exc, JoinRefused):
            return exitcodes.CONFIG, str(exc)
        if isinstance(exc, JoinedTooLate):  # the job did finish: nothing failed
            return exitcodes.OK, str(exc)
        if isinstance(exc, NodeError):
            return exitcodes.FAILED, str(exc)
        return exitcodes.FAILED, f"internal error: {type(exc).__name__}: {exc}"

    def _problems(self) -> list[str]:
        """What makes a finished job's result suspect (empty: nothing)."""
        out = []
        for w in self.workers:
            exit_code = w.proc.exitcode or 0
            if w.error is not None and (w.reported or exit_code != 0):
                out.append(f"worker {w.worker_id} failed ({w.error}) and was not restarted")
        seen = self.ending
        if seen["rounds"] and not seen["healthy"]:
            out.append("every loss was non-finite (NaN or inf) in every round")
        elif seen["rounds"] and not seen["elected"] and self.rule.exchange == Exchange.LEADER:
            out.append("no leader was ever elected (no worker had a full window of finite "
                       "losses at a round; see AVG_SIZE)")
        node = getattr(self, "async_node", None)
        stats = node.stats() if node is not None else {}
        if stats.get("rule_failures"):
            out.append(f"the rule failed in {stats['rule_failures']} exchange(s), each worker "
                       "reset (the first error is in the log)")
        if stats.get("deltas_refused"):
            out.append(f"the global server refused {stats['deltas_refused']} center delta(s) of "
                       "this node, which were dropped (the reason is in the log)")
        if self.summary.get("deltas_lost"):
            out.append("this node's last center deltas or mail did not reach the global server "
                       f"within ROUND_TIMEOUT ({self.cfg.round_timeout:g} s): the final "
                       "center lacks them")
        return out

    def _announce_stop(self, code: int, reason: str) -> None:
        """Node 0, ending before the job did: stop the whole job (best effort, bounded)."""
        if (self.cfg.node_index != 0 or code in (exitcodes.OK, exitcodes.DEGRADED)
                or not self.client.session or self.client.stopped):
            return
        r, self.report = self.report, Report()
        why = reason.replace("this node", "node 0")
        try:  # its last steps count as a normal Leave's would
            self.client.leave(r.consumed, r.late, stop_job=why, timeout=STOP_CALL_TIMEOUT)
            self.summary["stopped_job"] = True
            log.info("node 0: stopped the job on every node (%s)", why)
        except grpc.RpcError as exc:
            log.warning("node 0: could not tell the global server to stop the job (%s)",
                        exc.details())

    def _leave_at_end(self, code: int) -> None:
        """A node ending before the job did (stopped, interrupted, terminated, failed) leaves
        it with its last steps, if the server still listens: the server stops waiting for it
        at once rather than after ``node_timeout`` of silence. A node that finished left in the
        final round; node 0 ending early left when it stopped the job (``_announce_stop``)."""
        if (code in (exitcodes.OK, exitcodes.DEGRADED) or not self.client.session
                or (self.cfg.node_index == 0 and code != exitcodes.STOPPED)):
            return
        r, self.report = self.report, Report()
        try:
            self.summary["counter"] = self.client.leave(r.consumed, r.late, timeout=LEAVE_TIMEOUT)
        except grpc.RpcError:
            pass  # the server has stopped already: nothing is lost but these counts
