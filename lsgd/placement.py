"""Where a node stands in the job, read from a cluster launcher's environment (issue 13).

Pure: an environment (a mapping) goes in, a ``Placement`` (node index, number of nodes, node 0's
address, and where they came from) or a ``PlacementError`` comes out. ``lsgd place``
(``main``) prints it for ``train.sh``, which calls it when no node index is given.

- **Slurm** (``SLURM_JOB_ID``, ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``): one
  task per node; the node index is ``SLURM_PROCID``, the number of nodes ``SLURM_NTASKS``, node
  0's address the first host of the step's node list (``SLURM_STEP_NODELIST``, which srun sets;
  the job's where it is absent), expanded by ``scontrol show hostnames`` or ``expand_hostlist``
  (Slurm's compressed syntax, ``gpu-[01-03,07],cpu5``), and mapped to its ``NodeAddr`` by
  ``scontrol show node`` where scontrol answers (a node name need not be a host name). Tasks per
  node other than one are refused, naming the fix, and so is a multi-node job's batch script
  (no ``SLURM_STEP_ID``: not a task, its other nodes would never start).
- **Kubernetes** Indexed Job (``JOB_COMPLETION_INDEX``): the node index; the number of nodes
  and node 0's address (the headless Service's DNS name) come from the manifest's
  ``NUM_GROUPS`` and ``IP_ADDR``, which must be set.
- ``NODE`` or ``NUM_GROUPS`` set by the user must agree with the launcher (else one line names
  both); ``IP_ADDR`` set by the user wins (node 0 on another network). Nothing falls back
  silently to localhost.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

MAX_HOSTS = 100_000  # a node list expanding to more is refused (a typo such as [1-1000000])


class PlacementError(ValueError):
    """The launcher's environment does not place this node: one line, naming the variable."""


@dataclass(frozen=True)
class Placement:
    node_index: int
    num_groups: int
    ip_addr: str
    source: str  # "slurm" | "kubernetes"


# ---------------------------------------------------------------------- Slurm's host lists
def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise PlacementError(f"host list {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise PlacementError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise PlacementError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _range(spec: str, text: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07`` (the width of the lower bound kept)."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if m is None:
            raise PlacementError(f"host list {text!r}: {item!r} is not a number or a range")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise PlacementError(f"host list {text!r}: range {item!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise PlacementError(f"host list {text!r}: range {item!r} has over {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``gpu-[01-03,07],cpu5`` ->
    ``gpu-01 gpu-02 gpu-03 gpu-07 cpu5``; several brackets in one name make every
    combination (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``), as ``scontrol show hostnames``."""
    text = text.strip()
    if not text:
        raise PlacementError("host list is empty")
    hosts: list[str] = []
    for part in _split_top(text):
        if not part:
            raise PlacementError(f"host list {text!r}: an empty name")
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, range, literal, range, ..., literal
        choices = [[p] if i % 2 == 0 else _range(p, text) for i, p in enumerate(pieces)]
        count = 1
        for c in choices:
            count *= len(c)
        if len(hosts) + count > MAX_HOSTS:
            raise PlacementError(f"host list {text!r}: over {MAX_HOSTS} hosts")
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


# ---------------------------------------------------------------------- the environment
def _int(env: Mapping[str, str], name: str, low: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise PlacementError(f"{name}={raw!r} is not a whole number") from None
    if value < low:
        raise PlacementError(f"{name}={value} must be >= {low}")
    return value


def slurm_nodelist(env: Mapping[str, str]) -> str:
    """The node list the tasks run on: the step's (srun's), else the job's."""
    return env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]


def _slurm(env: Mapping[str, str], hosts: list[str] | None) -> Placement:
    ntasks = _int(env, "SLURM_NTASKS", 1)
    procid = _int(env, "SLURM_PROCID")
    if procid >= ntasks:
        raise PlacementError(f"SLURM_PROCID={procid} is not below SLURM_NTASKS={ntasks}")
    hosts = hosts if hosts is not None else expand_hostlist(slurm_nodelist(env))
    num_nodes = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NUM_NODES"
    nodes = _int(env, num_nodes, 1) if env.get(num_nodes) else len(hosts)
    if nodes > 1 and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        raise PlacementError(
            f"SLURM_JOB_ID={env['SLURM_JOB_ID']} runs on {nodes} nodes but this shell is not one "
            "of its tasks (no SLURM_STEP_ID: the batch script or salloc's shell), so the other "
            "nodes would never start: use `srun --ntasks-per-node=1 bash train.sh`")
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if ntasks != nodes or (per_node and per_node != "1"):
        raise PlacementError(
            f"lsgd runs one task per node; Slurm gave SLURM_NTASKS={ntasks} on {nodes} node(s)"
            + (f" (SLURM_NTASKS_PER_NODE={per_node})" if per_node else "")
            + ": use `srun --ntasks-per-node=1` (or #SBATCH --ntasks-per-node=1)")
    return Placement(procid, ntasks, hosts[0], "slurm")


def _kubernetes(env: Mapping[str, str]) -> Placement:
    index = _int(env, "JOB_COMPLETION_INDEX")
    if not env.get("NUM_GROUPS") or not env.get("IP_ADDR"):
        raise PlacementError("JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but "
                             "NUM_GROUPS and IP_ADDR are not: set them in the manifest (IP_ADDR: "
                             "node 0's name in the headless Service)")
    num_groups = _int(env, "NUM_GROUPS", 1)
    if index >= num_groups:
        raise PlacementError(f"JOB_COMPLETION_INDEX={index} is not below NUM_GROUPS={num_groups} "
                             "(the Job's completions must equal NUM_GROUPS)")
    return Placement(index, num_groups, env["IP_ADDR"], "kubernetes")


def from_env(env: Mapping[str, str], hosts: list[str] | None = None) -> Placement | None:
    """This node's placement from a launcher's environment (None: no launcher found).
    ``hosts``: Slurm's node list already expanded (by ``scontrol show hostnames``, where it
    exists)."""
    if all(env.get(k) for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                "SLURM_JOB_NODELIST")):
        found = _slurm(env, hosts)
    elif env.get("JOB_COMPLETION_INDEX", "") != "":
        found = _kubernetes(env)
    else:
        return None
    node = _int(env, "NODE") if env.get("NODE") else found.node_index
    groups = _int(env, "NUM_GROUPS", 1) if env.get("NUM_GROUPS") else found.num_groups
    for knob, mine, theirs in (("NODE", node, found.node_index),
                               ("NUM_GROUPS", groups, found.num_groups)):
        if mine != theirs:
            raise PlacementError(f"{knob}={mine} disagrees with {found.source}, which makes it "
                                 f"{theirs}: unset {knob} (the launcher sets it) or fix it")
    return Placement(node, groups, env.get("IP_ADDR") or found.ip_addr, found.source)


# ---------------------------------------------------------------------- ``lsgd place``
SCONTROL_TIMEOUT = 10.0  # seconds for each scontrol call (hostnames, a node's NodeAddr)


def scontrol_hosts(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames``'s expansion, where scontrol exists and answers (None: it
    does not, e.g. inside a container: the list is parsed here instead)."""
    hosts = (_scontrol("show", "hostnames", nodelist) or "").split()
    return hosts or None


def scontrol_node_addr(node: str) -> str | None:
    """The ``NodeAddr`` slurm.conf gives ``node`` (Slurm's own way to reach it: a node's name
    need not resolve), where scontrol exists and answers; None otherwise."""
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", _scontrol("show", "node", "-o", node) or "")
    return m.group(1) if m else None


def _scontrol(*args: str) -> str | None:
    """scontrol's output (None: no scontrol, a failure or no answer within the timeout)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def main(env: Mapping[str, str] | None = None) -> int:
    """``lsgd place``: ``<node index> <number of nodes> <node 0's address> <launcher>`` on one
    line for ``train.sh``; nothing when no launcher is found; exit 2 with one line on a misfit."""
    env = os.environ if env is None else env
    try:
        hosts = scontrol_hosts(slurm_nodelist(env)) if env.get("SLURM_JOB_NODELIST") \
            and env.get("SLURM_PROCID") else None
        if hosts and not env.get("IP_ADDR"):  # node 0 at its NodeAddr, as Slurm reaches it
            hosts[0] = scontrol_node_addr(hosts[0]) or hosts[0]
        placed = from_env(env, hosts)
    except PlacementError as exc:
        print(f"lsgd: error: {exc}", file=sys.stderr)
        return 2
    if placed is not None:
        if not re.fullmatch(r"[A-Za-z0-9._:\-\[\]]+", placed.ip_addr):
            print(f"lsgd: error: node 0's address {placed.ip_addr!r} (from {placed.source}) is "
                  "not a host name or an IP address", file=sys.stderr)
            return 2
        print(f"{placed.node_index} {placed.num_groups} {placed.ip_addr} {placed.source}")
    return 0
