"""What the study runs: the rules, their tuning grids, the worker counts, the budgets.

Every rule gets the same tuning budget: at most three settings of its key knobs (the grid
below), one run each, at 8 workers with seed 0, picked by *validation* accuracy (the test split
is never used to choose). Everything else is shared by all rules: the model, the batch (32), the
learning rate (0.05, Nesterov momentum 0.9), the per-worker step budget and the data. Rules that
exchange periodically do so every 16 of a worker's steps (``G_COMM=16``) unless their grid says
otherwise: LocalSGD's only knob is its period, and BSP averages after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKERS = (4, 8, 16)
SEEDS = (0, 1, 2)
TUNE_WORKERS, TUNE_SEED = 8, 0


@dataclass(frozen=True)
class Budget:
    steps: int  # per worker
    mark: int  # snapshot every this many of a worker's steps
    target: float  # test accuracy the table times


BUDGETS = {"cnn": Budget(steps=1500, mark=75, target=0.7),
           "mlp": Budget(steps=2000, mark=100, target=0.62)}
QUICK = {"cnn": Budget(steps=400, mark=40, target=0.6),
         "mlp": Budget(steps=800, mark=80, target=0.55)}


@dataclass(frozen=True)
class Rule:
    name: str
    algorithm: str
    base: tuple[tuple[str, str], ...]  # knobs of every run
    grid: tuple[tuple[tuple[str, str], ...], ...] = ((),)  # the settings tuned over
    curve: str = "average"  # the model the rule delivers, as its curve: "average" or "leader"
    single: bool = False  # one worker (the baseline), whatever the worker count


PERIOD = (("G_COMM", "16"), ("L_COMM", "4"))


def resolve(knobs: tuple[tuple[str, str], ...], workers: int) -> tuple[tuple[str, str], ...]:
    """Knob values as the job gets them: ``"0.9/W"`` is 0.9 divided by the worker count."""
    out = []
    for name, value in knobs:
        if value.endswith("/W"):
            value = f"{float(value[:-2]) / workers:.6g}"
        out.append((name, value))
    return tuple(out)
RULES = {r.name: r for r in (
    Rule("sgd", "lsgd", (), single=True, curve="leader"),
    Rule("bsp", "average", (("G_COMM", "1"), ("L_COMM", "1"))),
    Rule("localsgd", "average", (),
         tuple((("G_COMM", g), ("L_COMM", g)) for g in ("4", "16", "64"))),
    # EASGD's paper ties the two rates: beta = p * alpha for p workers (beta = 0.9 there)
    Rule("easgd", "easgd", PERIOD,
         tuple((("ALPHA", f"{b}/W"), ("BETA", b)) for b in ("0.3", "0.6", "0.9"))),
    Rule("easgd-async", "easgd-async", PERIOD,
         tuple((("ALPHA", f"{b}/W"),) for b in ("0.3", "0.6", "0.9"))),
    Rule("downpour", "downpour", (),
         tuple((("RULE_ARGS", f"n_push={n},n_fetch={n}"),) for n in ("1", "4", "16"))),
    Rule("gosgd", "gosgd", (), tuple((("RULE_ARGS", f"p={p}"),) for p in ("0.02", "0.1", "0.5"))),
    Rule("lsgd", "lsgd", PERIOD,
         tuple((("C1", c), ("C2", c)) for c in ("0.05", "0.15", "0.4")), curve="leader"),
    Rule("diloco", "diloco", PERIOD,
         tuple((("OUTER_LR", v),) for v in ("0.3", "0.7", "1.0"))),
    Rule("grawa", "grawa", PERIOD, tuple((("C2", c),) for c in ("0.1", "0.3", "0.5"))),
)}
