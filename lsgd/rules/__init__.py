"""Training rules (LSGD, EASGD) and the numpy kernels they run on flat float32 vectors."""

from __future__ import annotations

from .base import Exchange, RoundKind, RoundRoles, Rule
from .easgd import EASGD
from .lsgd import LSGD

RULES: dict[str, type[Rule]] = {LSGD.name: LSGD, EASGD.name: EASGD}

__all__ = ["EASGD", "LSGD", "RULES", "Exchange", "RoundKind", "RoundRoles", "Rule"]
