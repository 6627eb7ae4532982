"""The client a training loop uses to be an lsgd worker.

An existing loop becomes a worker with a few added lines (the local server starts the process
and runs the user's script or function in it)::

    import lsgd
    worker = lsgd.connect()
    worker.register(model.params, evaluate=lambda: {"accuracy": model.accuracy(xt, yt)})
    for xb, yb in batches:
        loss = model.train_step(xb, yb)
        if not worker.step(loss):
            break
    worker.close()

``step(loss)`` costs a counter decrement on most iterations: the worker holds *credits* (steps
it may take before asking again) granted by its local server. When they run out it asks for
more; the answer may be more credits, a round (publish, pull, go on) or the end of the job.
A rule that uses per-step scalars (GRAWA's gradient norm) gets them as keyword arguments,
``worker.step(loss, grad_norm=g)``, or from a PyTorch model's ``.grad`` (``scalars_window.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..config import JobConfig
from ..data import shard_indices
from ..leader import LossWindow
from ..local_server import messages as m
from ..local_server.liveness import stale_after
from ..local_server.store import NodeStore
from ..rules import ops
from . import scalars as worker_scalars
from . import state as worker_state
from .scalars_window import ScalarsWindow, grad_norm_source
from .adapters import ParamAdapter, as_params
from .rounds import NotTraining, RoundsMixin
from .solo import SoloWorker, check_register, check_step, loss_value

log = logging.getLogger(__name__)

POLL = 1.0  # seconds between checks that the local server is still alive
FULL_CHECKS = 3  # rounds with steps, per process, whose check also covers pulled parameters


class LocalServerGone(RuntimeError):
    """The local server died or stopped answering."""


@dataclass
class WorkerContext:
    """What the local server hands a worker process."""

    config: JobConfig
    local_index: int
    inbox: Any  # to the local server: ``put(msg)`` (a pipe of this process's own, inbox.py)
    replies: Any  # this worker's reply queue
    parent_pid: int
    beat: Any  # shared double: the local server's loop writes time.monotonic() into it as it runs
    evaluator: bool = False  # the node's evaluator: builds the model, never trains
    restarts: int = 0  # how many times this worker's process was respawned before this one
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES of this process (local_server/gpus.py)


class EvaluatorDone(BaseException):
    """Raised out of ``register()`` in the evaluator process once the job is over.

    A BaseException, so that a user's ``except Exception`` does not swallow it.
    """


class Worker(RoundsMixin):
    """One lsgd worker. Not thread-safe: use it from the training loop's thread."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self.config = ctx.config
        self.local_index = ctx.local_index
        self.is_evaluator = ctx.evaluator
        self.restarts = ctx.restarts  # > 0: a respawned process, started from a leader/center
        # The evaluator borrows worker 0's id, so code that shards data by id works unchanged.
        self.worker_id = ctx.config.worker_id(0 if ctx.evaluator else ctx.local_index)
        self.num_workers = ctx.config.total_workers
        self.iterations = 0
        self._window = LossWindow(ctx.config.window)
        self._given = ScalarsWindow()  # per-step scalars of step(); the rule's after register()
        self._rule_scalars: tuple[str, ...] | None = None
        self._credits = 0
        self._unreported = 0
        self._params: ParamAdapter | None = None
        self._evaluate: Callable[[], dict[str, float]] | None = None
        self._store: NodeStore | None = None
        self._proximal: list[tuple[str, float]] = []
        self._due: Callable[[int, random.Random], int] | None = None  # AsyncRule.due
        self._rng = random.Random(ctx.config.seed * 1_000_003 + self.worker_id)
        self._state: worker_state.WorkerState | None = None
        self._pulled = 0  # leading slot entries that pulls move
        self._load_state_later = False
        self._stopped = False
        self._past_end: bool | str = False  # a step was taken after the job ended (see step)
        # Fingerprint of the slot when lsgd last read the model or wrote it, and the step count
        # then: the model read unchanged after steps means the loop trains other arrays.
        self._touched: int | None = None
        self._touched_at = 0
        self._full_checks = FULL_CHECKS  # see _check_trained
        # A reply wait lasts while the local server is alive and its loop keeps running; its
        # longest blocking call (a round barrier or the first connection) is bounded by these.
        self._stale_after = stale_after(ctx.config.round_timeout, ctx.config.connect_timeout)
        # Tell the local server we are alive while we work through long credit shares.
        self._progress_every = min(1.0, ctx.config.round_timeout / 4)
        self._last_sent = time.monotonic()
        self._scalars = worker_scalars.for_worker(  # log(): the loop's own numbers
            ctx.config, "evaluator" if ctx.evaluator else f"worker{self.worker_id}",
            lambda: self.iterations)

    # ------------------------------------------------------------------ public API
    def register(self, params: Any, evaluate: Callable[[], dict[str, float]] | None = None, *,
                 buffers: str = "local", state: Any = None, grad_norm: bool | None = None) -> None:
        """Register the model's parameters (once) and an optional evaluation function.

        Args:
            params: a list of numpy arrays or of PyTensor shared variables, a PyTorch
                ``nn.Module`` or list of tensors, or a ``ParamAdapter``.
            evaluate: called with the leader / worker average / center loaded into the model
                (periodically with ``EVAL_EVERY``, and at the end of the job); returns metrics
                such as ``{"accuracy": 0.97}``.
            buffers: PyTorch modules only: ``"local"`` keeps batch-norm statistics per worker,
                ``"average"`` averages them over each round's participants on the node.
            state: this worker's own state for checkpoints (optimizer buffers), never
                exchanged: a list of arrays / shared variables / tensors, or a function
                returning one (see ``lsgd.worker.state``).
            grad_norm: PyTorch only: read the gradient norm a rule uses (GRAWA) from the
                parameters' ``.grad`` at each round. None (default): when the rule uses it;
                False: never (pass ``step(loss, grad_norm=g)`` yourself). See
                ``scalars_window.py``.
        """
        check_register(self._params)
        self._params = as_params(params, buffers=buffers)
        source = grad_norm_source(self._params, grad_norm, self.wants("grad_norm"))
        self._state = worker_state.make(state, self.config.run_dir, self.config.node_index,
                                        self.worker_id)
        self._evaluate = evaluate
        p = self._params
        stats = getattr(p, "stats_count", 0)  # an adapter of the user's may have none
        self._pulled = p.param_count - stats  # the statistics tail is never pulled
        self._send(m.Hello(self.local_index, p.param_count, stats, getattr(p, "average_stats", False)))
        if self.is_evaluator and isinstance(msg := self._get(), m.Stop):
            raise EvaluatorDone()  # the job ended before the model was even needed
        setup = msg if self.is_evaluator else self._get()
        if isinstance(setup, m.Stop):  # a respawned worker, and the job ended before its Setup
            return  # step() answers False at once
        if not isinstance(setup, m.Setup):
            raise RuntimeError(f"expected Setup from the local server, got {setup!r}")
        self._store = NodeStore.attach(setup.layout)
        if self.is_evaluator:
            self._serve_evaluations()  # until the job ends
            raise EvaluatorDone()
        self.iterations = setup.iterations  # > 0 when the job resumed from a checkpoint
        if setup.resume and self._state is not None:
            if self._state.exists:
                self._state.load()
            else:  # created lazily (PyTorch optimizers): load it after the first step
                self._load_state_later = True
        if (pin := getattr(self._params, "pin", None)) is not None:  # a GPU model (torch_pinned.py)
            pin(self._store.memory())
        if setup.from_slot:  # respawned, resumed, or joining a running job: continue from there
            self._params.write_from(self._store.slot(self.local_index))
        else:
            self._params.read_into(self._store.slot(self.local_index))
        self._touched, self._touched_at = ops.fingerprint(self._store.slot(self.local_index)), self.iterations
        rule = self.config.make_rule()
        self._given = ScalarsWindow(rule.scalars, rule.scalar_momentum,
                                    {"grad_norm": source} if source else None)
        self._proximal = rule.per_step_pulls(self.config.num_groups > 1)
        if not rule.synchronous:  # an asynchronous rule: exchanges on this worker's own clock
            self._due = rule.due
        self._send(m.Ready(self.local_index))
        if not self._refill(m.Ask(self.local_index, 0)):  # credits for the first steps
            self._stopped = True

    def step(self, loss: float, **scalars: Any) -> bool:
        """Record one finished SGD step and its minibatch loss.

        Args:
            loss: the minibatch loss (a number, or a one-element array or tensor).
            scalars: per-step numbers the job's rule uses (``Rule.scalars``, see ``wants``),
                e.g. ``grad_norm=g``; read at the next round (``scalars_window.py``).

        Returns:
            True to keep training, False when the job is over (leave the loop).
        """
        if self._params is None:  # (inline: step() is the hot path)
            check_step(self._params)
        loss = loss_value(loss)
        if scalars:
            self._given.latest.update(scalars)
        if self._stopped:
            # The job ended before this update got a credit (e.g. before this worker's first
            # one): the loop made it, so it is counted once (reported by close()). Steps of a
            # loop that goes on after False train alone and are not counted.
            if not self._past_end:
                self._past_end = True
                self.iterations += 1
                self._unreported += 1
            elif self._past_end is True:
                self._past_end = "warned"
                log.warning("step() after the job ended (it answered False): this loop trains "
                            "alone now and its steps are not counted; leave the loop on False")
            return False
        self.iterations += 1
        self._unreported += 1
        if self._load_state_later and self._state is not None and self._state.exists:
            self._load_state_later = False
            self._state.load()
        self._window.add(loss)
        if self._proximal:
            self._proximal_step()
        if self._due is not None and (action := self._due(self.iterations, self._rng)):
            if not self._exchange(action):
                return False
        self._credits -= 1
        if self._credits > 0:
            now = time.monotonic()
            if now - self._last_sent > self._progress_every:
                self._send(m.Progress(self.local_index, self._take_unreported()))
            return True
        return self._refill(m.Ask(self.local_index, self._take_unreported()))

    def wants(self, name: str) -> bool:
        """Whether the job's rule uses the per-step scalar ``name`` (give it to ``step()``
        then): ``worker.wants("grad_norm")`` is True under GRAWA."""
        return name in self.rule_scalars

    @property
    def rule_scalars(self) -> tuple[str, ...]:
        """The per-step scalars the job's rule uses (``Rule.scalars``)."""
        if self._rule_scalars is None:
            self._rule_scalars = tuple(self.config.make_rule().scalars)
        return self._rule_scalars

    def shard(self, *arrays: Any, mode: str | None = None) -> Any:
        """This worker's part of the training data: ``x, y = worker.shard(x, y)``.

        ``mode`` (default: the job's ``SHARD``) is ``"permutation"`` (every sample, in an order
        of this worker's own) or ``"disjoint"`` (a disjoint 1/num_workers share). Arrays are
        numpy arrays or anything indexable by an integer array (PyTorch tensors).
        """
        n = _common_length(arrays)
        return _take(arrays, shard_indices(n, self.worker_id, self.num_workers,
                                           mode or self.config.shard, self.config.seed))

    def log(self, scalars: Mapping[str, float], step: int | None = None) -> None:
        """Log the loop's own scalars, ``worker.log({"train/accuracy": 0.9})``: to TensorBoard
        (``RUN_DIR/tensorboard/worker<id>/`` with ``TENSORBOARD=1``) and to every ``on_log``
        function. ``step`` defaults to this worker's iteration count. See ``scalars.py``."""
        self._scalars.log(scalars, step)

    def on_log(self, fn: worker_scalars.LogFn) -> worker_scalars.LogFn:
        """Call ``fn(scalars, step)`` at every ``log()`` (route them to W&B, MLflow, ...)."""
        return self._scalars.on_log(fn)

    @property
    def registered(self) -> bool:
        return self._params is not None

    def close(self) -> None:
        """Report the last steps and detach from shared memory (safe to call twice)."""
        self._scalars.close()
        if self.is_evaluator:
            self._stopped = True
        elif self._params is not None and (self._unreported or not self._stopped):
            self._send(m.Bye(self.local_index, self._take_unreported()))
            self._stopped = True
        if self._store is not None:
            if (unpin := getattr(self._params, "unpin", None)) is not None:
                try:  # before the segment is unmapped; a broken GPU must not fail a clean end
                    unpin()
                except Exception as exc:  # noqa: BLE001 - the process ends anyway
                    log.warning("could not unpin the node memory: %s", exc)
            self._store.close()
            self._store = None

    # ------------------------------------------------------------------ internals
    def _take_unreported(self) -> int:
        n, self._unreported = self._unreported, 0
        return n

    def _send(self, msg: object) -> None:
        if self.restarts and hasattr(msg, "life"):  # which process of this worker sends it
            msg = dataclasses.replace(msg, life=self.restarts)
        self._last_sent = time.monotonic()
        try:
            self._ctx.inbox.put(msg)
        except OSError:  # its end of our pipe is closed
            raise LocalServerGone("the local server exited") from None

    def _get(self) -> object:
        while True:
            try:
                msg = self._ctx.replies.get(timeout=POLL)
            except queue.Empty:
                if os.getppid() != self._ctx.parent_pid:
                    raise LocalServerGone("the local server exited") from None
                silent = time.monotonic() - self._ctx.beat.value
                if silent > self._stale_after:
                    raise LocalServerGone(
                        f"the local server has not run its loop for {silent:.0f} s") from None
                continue
            if isinstance(msg, m.Stop):
                self._stopped = True
            return msg

    def _expect(self, kind: type) -> Any:
        msg = self._get()
        if isinstance(msg, m.Stop):
            raise LocalServerGone(f"stopped before {kind.__name__}: {msg.reason}")
        if not isinstance(msg, kind):
            raise RuntimeError(f"expected {kind.__name__} from the local server, got {msg!r}")
        return msg

    def _refill(self, ask: m.Ask) -> bool:
        self._send(ask)
        while True:
            msg = self._get()
            if isinstance(msg, m.Credits):
                self._credits = msg.count
                return True
            if isinstance(msg, m.RoundCall):
                if not self._round(msg):
                    return False
                continue  # the Done message asked for credits again
            if isinstance(msg, m.Stop):
                return False
            raise RuntimeError(f"unexpected message from the local server: {msg!r}")

    def _serve_evaluations(self) -> None:
        """The evaluator's loop: snapshot the named buffers, let the node go on, evaluate."""
        assert self._store is not None
        copies: dict[str, np.ndarray] = {}  # private snapshots, allocated once per buffer
        while True:
            msg = self._get()
            if isinstance(msg, m.Stop):
                return
            if not isinstance(msg, m.Evaluate):
                raise RuntimeError(f"unexpected message for the evaluator: {msg!r}")
            for name in msg.buffers:
                if name not in copies:
                    copies[name] = np.empty_like(self._store.buffer(name))
                ops.copy_(copies[name], self._store.buffer(name))
            self._send(m.Loaded(self.local_index, msg.round_id))
            results = self._run_evaluation({n: copies[n] for n in msg.buffers})
            self._send(m.EvalResult(self.local_index, msg.round_id, msg.iteration, results))

    def _run_evaluation(self, vectors: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
        assert self._params is not None
        results: dict[str, dict[str, float]] = {}
        if self._evaluate is None:
            return results
        for name, vec in vectors.items():
            if not ops.all_finite(vec):
                results[name] = {"error": math.nan}
                continue
            self._params.write_from(vec)
            results[name] = {k: float(v) for k, v in self._evaluate().items()}
        if not self.is_evaluator and self._store is not None:  # back to this worker's own
            self._params.write_from(self._store.slot(self.local_index))
        return results


def _common_length(arrays: tuple) -> int:
    if not arrays or any(len(a) != len(arrays[0]) for a in arrays):
        raise ValueError("shard() takes one or more arrays of the same length")
    return len(arrays[0])


def _take(arrays: tuple, idx: np.ndarray) -> Any:
    parts = tuple(a[idx] for a in arrays)
    return parts[0] if len(parts) == 1 else parts


_current: Worker | None = None  # set in a worker process before the user's code runs
_solo: SoloWorker | None = None


def connect(params: Any = None, evaluate: Callable[[], dict[str, float]] | None = None, *,
            buffers: str = "local", grad_norm: bool | None = None) -> Worker | SoloWorker:
    """This process's lsgd worker; registers ``params`` too when given.

    In a process that ``train.sh`` started, this is the worker the local server set up. In any
    other process (``python my_script.py``) it is a ``SoloWorker``: the loop trains alone, so
    the same script runs with and without lsgd.
    """
    global _solo
    worker: Worker | SoloWorker | None = _current
    if worker is None:
        if _solo is None:
            log.warning("lsgd.connect(): not started by train.sh; training alone")
            _solo = SoloWorker()
        worker = _solo
    if params is not None:
        worker.register(params, evaluate, buffers=buffers, grad_norm=grad_norm)
    return worker


__all__ = ["Worker", "WorkerContext", "LocalServerGone", "EvaluatorDone", "NotTraining", "SoloWorker",
           "connect"]
