"""Leader SGD (Teng et al., NeurIPS 2019, Algorithm 1).

In a local round every participant of a node pulls toward the node's best worker with strength
``c1``; in a global round it then pulls toward the best worker of the job with ``c2``. A leader
is never pulled toward itself. With a single node there are no local rounds: only the global
leader is used. The optional per-step proximal pull (``p1``/``p2``) of the authors' reference
code is not part of the paper and is off by default; see ``per_step_pulls``.
"""

from __future__ import annotations

from .base import GLOBAL_LEADER, LOCAL_LEADER, SUM, RoundKind, RoundRoles, Rule


class LSGD(Rule):
    """LSGD pulls toward the local and global leaders."""

    name = "lsgd"

    def __init__(self, c1: float = 0.1, c2: float = 0.1, p1: float = 0.0, p2: float = 0.0,
                 l_comm: int = 16, g_comm: int = 64) -> None:
        for name, v in (("c1", c1), ("c2", c2), ("p1", p1), ("p2", p2)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} (pulling strength) must be in [0, 1], got {v}")
        if l_comm < 1 or g_comm < 1 or g_comm % l_comm:
            raise ValueError(f"g_comm ({g_comm}) must be a positive multiple of l_comm ({l_comm})")
        self.c1, self.c2, self.p1, self.p2 = c1, c2, p1, p2
        self.l_comm, self.g_comm = l_comm, g_comm

    @classmethod
    def from_config(cls, config, **args) -> "LSGD":
        for name in ("c1", "c2", "p1", "p2", "l_comm", "g_comm"):  # RULE_ARGS override the knobs
            args.setdefault(name, getattr(config, name))
        return cls(**args)

    @property
    def node_buffers(self) -> tuple[str, ...]:
        return (LOCAL_LEADER, GLOBAL_LEADER, SUM)

    def has_local_rounds(self, num_groups: int) -> bool:
        return num_groups > 1

    def pulls(self, kind: RoundKind, roles: RoundRoles) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        if kind == RoundKind.FINAL:
            return out
        if (roles.multi_node and roles.local_leader is not None
                and roles.worker_id != roles.local_leader):
            out.append((LOCAL_LEADER, self.c1))
        if (kind == RoundKind.GLOBAL and roles.global_leader is not None
                and roles.worker_id != roles.global_leader):
            out.append((GLOBAL_LEADER, self.c2))
        return out

    def per_step_pulls(self, multi_node: bool) -> list[tuple[str, float]]:
        """Per-step pulls toward the last known leaders (reference code, not the paper).

        After every SGD step: ``x <- (1 - p2/g_comm) x + (p2/g_comm) xg_last``, then the same with
        ``p1/l_comm`` toward ``xl_last`` (multi-node only). Empty when p1 = p2 = 0.
        """
        out: list[tuple[str, float]] = []
        if self.p2:
            out.append((GLOBAL_LEADER, self.p2 / self.g_comm))
        if self.p1 and multi_node:
            out.append((LOCAL_LEADER, self.p1 / self.l_comm))
        return out
