"""Evaluation on node 0: periodic (by the evaluator process, beside training) and final.

With ``eval_every``, node 0 runs an *evaluator*: one more process that builds the user's model
but never trains. At an evaluation round it copies the leader, average and center buffers (the
node waits only for that copy) and evaluates them while the workers train on. The final
evaluation is done by a worker, once training is over. Results become ``eval`` rows of
``metrics.csv`` (and, for the final one, ``summary.json``).

A mixin of ``LocalServer`` (``server.py``): it uses the node's store, queues and metrics.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import dataclass

from ..rules.base import CENTER, GLOBAL_LEADER, SUM
from . import messages as m

log = logging.getLogger("lsgd.local_server.server")

EVAL_NAMES = {GLOBAL_LEADER: "leader", SUM: "average", CENTER: "center"}  # in metrics and summary


@dataclass
class Evaluator:
    """Node 0's evaluator process."""

    proc: mp.process.BaseProcess
    replies: object
    hello: m.Hello | None = None  # its Hello, until the node's store exists
    ready: bool = False  # attached to the store, waiting for work
    busy: int = 0  # round being evaluated (0: idle)
    loading: int = 0  # round whose buffers it is copying (0: none)
    gone: bool = False
    done: int = 0  # evaluations finished
    skipped: int = 0  # evaluation rounds skipped because it was still busy


class EvaluationMixin:
    """Periodic and final evaluation (methods of ``LocalServer``)."""

    def _periodic_evaluation(self, rid: int, iteration: int, center: bool, leader: int | None) -> None:
        """Hand this round's leader / average / center to the evaluator; wait for its copy only."""
        ev = self.evaluator
        if ev is None or ev.gone or not ev.ready:
            return
        if ev.busy:
            ev.skipped += 1
            log.info("round %d: evaluator still busy with round %d; skipping this evaluation",
                     rid, ev.busy)
            return
        names = [GLOBAL_LEADER] if leader is not None else []
        if center:  # downloaded in this round (an old center would be mislabelled)
            names.append(CENTER)
        if self._pull(SUM, "average", rid):  # last: downloads stage in SUM
            names.append(SUM)
        if not names:
            return
        ev.busy = ev.loading = rid
        self.eval_leader[rid] = leader
        self._send(ev, m.Evaluate(tuple(names), rid, iteration))
        end = time.monotonic() + self.cfg.round_timeout
        while ev.loading and not ev.gone and time.monotonic() < end:
            msg = self._recv()
            if msg is not None:
                self._dispatch(msg)
        if ev.loading:
            self._evaluator_gone(f"did not copy the buffers of round {rid} in "
                                 f"{self.cfg.round_timeout:g} s")

    def _from_evaluator(self, msg: object) -> None:
        ev = self.evaluator
        if ev is None or ev.gone:
            return
        if isinstance(msg, m.Hello):
            if self.store is None:
                ev.hello = msg  # answered once the workers have fixed the model size
            elif (misfit := self._misfit(msg)) is not None:
                self._evaluator_gone(misfit)
            else:
                self._send(ev, m.Setup(self.store.layout))
                ev.ready = True
        elif isinstance(msg, m.Loaded):
            ev.loading = 0
        elif isinstance(msg, m.EvalResult):
            ev.busy = 0
            ev.done += 1
            self._eval_rows(msg.round_id, msg.iteration, msg.metrics,
                            self.eval_leader.pop(msg.round_id, None))
        elif isinstance(msg, m.Failed):
            if msg.trace:
                log.error("evaluator failed: %s\n%s", msg.error, msg.trace.rstrip())
            self._evaluator_gone(msg.error)

    def _evaluator_gone(self, why: str) -> None:
        ev = self.evaluator
        if ev is None or ev.gone:
            return
        ev.gone = True
        if ev.proc.is_alive():
            self._send(ev, m.Stop("evaluator dropped"))
        if not self.stopping:
            log.error("evaluator: %s; periodic evaluation is off for the rest of the job", why)

    def _eval_rows(self, rid: int, iteration: int, metrics: dict, leader: int | None) -> None:
        now = round(time.monotonic() - self.t0, 4)
        self.metrics.rows([{"round": rid, "kind": "eval", "iteration": iteration, "time_s": now,
                            "worker_id": leader if name == GLOBAL_LEADER else None,
                            "target": EVAL_NAMES[name], "metric": key, "value": value}
                           for name, values in metrics.items() for key, value in values.items()])

    def _finish_evaluator(self) -> None:
        """Wait (bounded) for an evaluation in progress, then stop the evaluator."""
        ev = self.evaluator
        if ev is None or ev.gone:
            return
        end = time.monotonic() + max(60.0, 2 * self.cfg.round_timeout)
        while ev.busy and not ev.gone and time.monotonic() < end:
            msg = self._recv()
            if msg is not None:
                self._dispatch(msg)
        if ev.busy:
            log.warning("evaluation of round %d did not finish; stopping the evaluator", ev.busy)
        self._send(ev, m.Stop("job finished"))

    def _evaluate(self, local: int, buffers: tuple[str, ...], rid: int, iteration: int,
                  leader: int | None) -> dict:
        """The final evaluation, by a worker (training is over)."""
        w = self.workers[local]
        life = w.life  # a process started in its place has not the model to evaluate
        self._send(w, m.Evaluate(buffers, rid, iteration))
        end = time.monotonic() + max(60.0, 2 * self.cfg.round_timeout)
        while time.monotonic() < end and not w.gone and w.life == life:
            msg = self._recv()
            if isinstance(msg, m.EvalResult):
                self._eval_rows(rid, iteration, msg.metrics, leader)
                return {EVAL_NAMES[k]: v for k, v in msg.metrics.items()}
        log.warning("evaluation by worker %d did not finish", w.worker_id)
        return {}
