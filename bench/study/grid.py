"""What the study runs: the rules, their tuning grids, the worker counts, the budgets.

**Communication.** Every rule talks across nodes once every 16 of a worker's steps: the period
is fixed, not tuned, so that no rule wins by communicating more (BSP, which averages after
every step, is the exception by definition; ``sgd`` never communicates). LSGD also meets
inside each node every 4 steps (``L_COMM=4``), its design.

**Tuning.** Each rule gets the same budget: at most three settings of its one key knob that is
not the period (the grid below), one run each, at 8 workers with seed ``TUNE_SEED`` (a seed the
study does not report, so the pick carries no winner's luck into the table), picked by
*validation* accuracy at the budget. The model a rule delivers (its leader, the workers'
average or its center) is picked the same way, on validation. The test split never chooses.
Everything else is shared: the model, the batch (32), the learning rate (0.05, Nesterov
momentum 0.9), the per-worker step budget and the data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WORKERS = (4, 8, 16)
SEEDS = (0, 1, 2)
TUNE_WORKERS, TUNE_SEED = 8, 100
PERIOD = 16  # a worker's steps between exchanges across nodes
MODELS = ("leader", "average", "center")  # what the study evaluates at every snapshot


@dataclass(frozen=True)
class Budget:
    steps: int  # per worker
    mark: int  # snapshot every this many of a worker's steps
    target: float  # test accuracy the table times


BUDGETS = {"cnn": Budget(steps=1500, mark=75, target=0.7),
           "mlp": Budget(steps=2000, mark=100, target=0.62)}
QUICK = {"cnn": Budget(steps=400, mark=40, target=0.6),
         "mlp": Budget(steps=800, mark=80, target=0.55)}

Knobs = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Rule:
    name: str
    algorithm: str
    base: Knobs  # knobs of every run
    grid: tuple[Knobs, ...] = ((),)  # the settings tuned over
    single: bool = False  # one worker (the baseline), whatever the worker count
    product: str = "average"  # the model the rule delivers (docs/rules.md): the quick form's pick
    pace: float = 1.0  # the first run's pace, times the usual (a round after every step is slow)


def resolve(knobs: Knobs, workers: int) -> Knobs:
    """Knob values as the job gets them: ``0.9/W`` (anywhere in a value) is 0.9 divided by the
    worker count."""
    def per_worker(m: re.Match) -> str:
        return f"{float(m.group(1)) / workers:.6g}"

    return tuple((name, re.sub(r"([0-9.]+)/W", per_worker, value)) for name, value in knobs)


P = str(PERIOD)
SYNC = (("G_COMM", P), ("L_COMM", P))  # one global round every PERIOD steps, no local rounds
RULES = {r.name: r for r in (
    Rule("sgd", "lsgd", (), single=True, product="leader"),
    Rule("bsp", "average", (("G_COMM", "1"), ("L_COMM", "1")), pace=2.5),
    Rule("localsgd", "average", SYNC),
    # EASGD's paper ties the two rates: beta = p * alpha for p workers (beta = 0.9 there)
    Rule("easgd", "easgd", SYNC,
         tuple((("ALPHA", f"{b}/W"), ("BETA", b)) for b in ("0.3", "0.6", "0.9")), product="center"),
    Rule("easgd-async", "easgd-async", SYNC,
         tuple((("ALPHA", f"{b}/W"),) for b in ("0.3", "0.6", "0.9")), product="center"),
    # DOWNPOUR pushes its change scaled by `scale` (default 1/N, N the job's workers)
    Rule("downpour", "downpour", (),
         tuple((("RULE_ARGS", f"n_push={P},n_fetch={P},scale={s}/W"),)
               for s in ("0.5", "1", "2")), product="center"),
    Rule("gosgd", "gosgd", (("RULE_ARGS", f"p={1 / PERIOD:g}"),)),
    # LSGD: local rounds every 4 steps, global every 16; the leader elected on the mean of the
    # last 16 losses (the reference code's avg_size = l_comm elects on 2 here: too noisy)
    Rule("lsgd", "lsgd", (("G_COMM", P), ("L_COMM", "4"), ("AVG_SIZE", P)),
         tuple((("C1", c), ("C2", c)) for c in ("0.05", "0.15", "0.4")), product="leader"),
    Rule("diloco", "diloco", SYNC,
         tuple((("OUTER_LR", v),) for v in ("0.3", "0.7", "1.0")), product="center"),
    Rule("grawa", "grawa", SYNC, tuple((("C2", c),) for c in ("0.1", "0.3", "0.5")),
         product="center"),
)}
