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

import logging
import signal

import grpc

from .. import exitcodes
from ..rules.base import Exchange
from .global_client import GlobalUnreachable, stop_reason_of
from .state import JoinedTooLate, JoinRefused, NodeError, Report
from .store import SharedMemoryTooSmall

log = logging.getLogger("lsgd.local_server.server")

STOP_CALL_TIMEOUT = 2.0  # seconds for telling the global server that the job stops (best effort)
LEAVE_TIMEOUT = 1.0  # seconds for a stopped node's last report (the server may be gone)


class JobStopped(NodeError):
    """Node 0 stopped the job; the message is the reason the global server gave."""


class EndingMixin:
    """Exit code, stop reason and job stop (methods of ``LocalServer``)."""

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
