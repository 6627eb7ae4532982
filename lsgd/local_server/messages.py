"""Messages between workers and their local server over multiprocessing queues.

Each worker process has a pipe to the local server (``inbox.py``) and a reply queue. Every message
names the worker by its local index (``EVALUATOR`` for node 0's evaluator process) and, with
``life``, the process of that worker that sent it (0: the first, n: the n-th respawned one), so
that what a dead process sent is never taken for its successor's. Parameters never travel in
messages: they move through node shared memory (``store.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .store import StoreLayout

EVALUATOR = -1  # the local index of the evaluator process

# ---------------------------------------------------------------- worker -> local server


@dataclass(frozen=True)
class Hello:
    """First message: the worker built its model."""

    local: int
    param_count: int
    stats_count: int = 0  # trailing entries never pulled
    average_stats: bool = False  # ... and averaged over each round's participants
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Ready:
    """The worker published its initial parameters in its slot."""

    local: int
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Ask:
    """The worker used its credits (``consumed`` steps since its last report) and wants more."""

    local: int
    consumed: int
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Progress:
    """Still working through its credits; ``consumed`` steps since the last report."""

    local: int
    consumed: int
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Bye:
    """The training loop ended on its own; ``consumed`` steps were not reported yet."""

    local: int
    consumed: int
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Join:
    """The worker published its parameters for ``round_id``."""

    local: int
    round_id: int
    loss: float  # loss estimate (lsgd.leader.LossWindow); NaN when it has no loss or a non-finite one
    consumed: int
    iterations: int  # the worker's own step count so far
    healthy: bool = True  # its recent losses and its parameters are all finite
    life: int = 0  # which process of the worker sent it (see the module doc)
    scalars: dict[str, float] = field(default_factory=dict)  # the rule's scalars (Rule.scalars)


@dataclass(frozen=True)
class Exchange:
    """Asynchronous rules: the worker published its parameters for an exchange (``action``,
    from ``AsyncRule.due``) and waits for ``Exchanged``."""

    local: int
    action: int
    loss: float  # loss estimate since its last exchange (NaN: none)
    consumed: int
    iterations: int
    healthy: bool = True
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Done:
    """The worker finished its pulls of ``round_id``; ``distances`` maps buffer -> ||x - target||."""

    local: int
    round_id: int
    distances: dict[str, float] = field(default_factory=dict)
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Loaded:
    """The evaluator copied the buffers of ``round_id``; the node may overwrite them."""

    local: int
    round_id: int


@dataclass(frozen=True)
class EvalResult:
    local: int
    round_id: int
    iteration: int
    metrics: dict[str, dict[str, float]]  # buffer name -> metric -> value
    life: int = 0  # which process of the worker sent it (see the module doc)


@dataclass(frozen=True)
class Failed:
    """The worker raised; ``error`` is the one-line cause, ``trace`` the traceback."""

    local: int
    error: str
    trace: str = ""
    life: int = 0  # which process of the worker sent it (see the module doc)


# ---------------------------------------------------------------- local server -> worker


@dataclass(frozen=True)
class Setup:
    layout: StoreLayout
    from_slot: bool = False  # start from the parameters already in your slot (a leader/center)
    iterations: int = 0  # steps this worker took before (resuming from a checkpoint)
    resume: bool = False  # RESUME=1: load your own saved state


@dataclass(frozen=True)
class Credits:
    count: int


@dataclass(frozen=True)
class RoundCall:
    """Publish your parameters and loss for this round."""

    round_id: int
    kind: int


@dataclass(frozen=True)
class Exchanged:
    """The exchange ran: with ``changed``, the slot holds the worker's new parameters."""

    changed: bool
    reset: bool = False  # they are the center: the worker's losses or parameters were not finite


@dataclass(frozen=True)
class Pull:
    """Apply these pulls in order: ``[(buffer, strength), ...]`` (empty: none)."""

    round_id: int
    pulls: tuple[tuple[str, float], ...]
    reset_window: bool  # a round the worker took part in: its loss window starts again
    stats_averaged: bool = False  # the slot's statistics now hold the participants' mean
    reset: bool = False  # non-finite worker: overwrite the whole slot with the one buffer named
    checkpoint: bool = False  # a checkpoint round: save your own state (register(state=...))


@dataclass(frozen=True)
class Evaluate:
    """Load each named buffer in turn and evaluate it (the evaluator first copies them all)."""

    buffers: tuple[str, ...]
    round_id: int = 0
    iteration: int = 0


@dataclass(frozen=True)
class Stop:
    """Leave the training loop now."""

    reason: str = ""
