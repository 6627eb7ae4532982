"""Training rules and the numpy kernels they run on flat float32 vectors.

The public Rule API is ``lsgd.rules.base`` (re-exported here); ``docs/rules.md`` explains it.
"""

from __future__ import annotations

from .base import (CENTER, GLOBAL_LEADER, LOCAL_LEADER, Contribution, Exchange, RoundKind,
                   RoundRoles, Rule, RuleError)
from .asynchronous import AsyncRule
from .average import Average
from .diloco import DiLoCo
from .downpour import Downpour
from .easgd import EASGD
from .easgd_async import AsyncEASGD
from .gosgd import GoSGD
from .grawa import GRAWA
from .lsgd import LSGD

RULES: dict[str, type[Rule]] = {r.name: r for r in (LSGD, EASGD, Average, DiLoCo, GRAWA,
                                                     AsyncEASGD, Downpour, GoSGD)}

__all__ = ["AsyncEASGD", "AsyncRule", "Average", "Downpour", "CENTER", "DiLoCo", "EASGD", "GLOBAL_LEADER", "GRAWA", "LOCAL_LEADER", "LSGD", "RULES", "Contribution",
           "Exchange", "GoSGD", "RoundKind", "RoundRoles", "Rule", "RuleError"]
