"""Shared pieces of the benchmarks: the result record, machine facts, process CPU time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """One measured number, its baseline from the same run, and whether the target is met."""

    target: str  # e.g. "1. control plane"
    metric: str  # what was measured, in words
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None  # value/baseline or baseline/value, as ``ratio_note`` says
    ratio_note: str = ""
    goal: str = ""
    met: bool | None = None  # None: reported, no target
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine() -> dict[str, Any]:
    """Facts about the machine the numbers came from."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import grpc
    import numpy

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gb, 1),
            "python": platform.python_version(), "numpy": numpy.__version__,
            "grpcio": grpc.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def lsgd_env(**knobs: object) -> dict[str, str]:
    """Environment for running ``train.sh`` from the repo with this interpreter."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in knobs.items()})
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("LOG_LEVEL", "WARNING")
    return env


def run_node(index: int, env: dict[str, str], timeout: float = 0) -> subprocess.Popen:
    """Start ``bash train.sh <index>`` (its output goes to RUN_DIR/node<index>.log)."""
    run_dir = Path(env["RUN_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    log = (run_dir / f"node{index}.log").open("w")
    return subprocess.Popen(["bash", str(REPO / "train.sh"), str(index)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
