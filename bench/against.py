"""Run a benchmark against another revision of lsgd, on the same host, in the same run.

``worktree(rev)`` checks ``rev`` out in a temporary git worktree; ``json_rows(...)`` runs
Python (a module, ``-m ...``, or a script) with a given ``PYTHONPATH`` (the other revision's tree, or this checkout) and returns the
JSON objects it printed, one per line; ``cell(old, new)`` writes "old → new (ratio×)".
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO


def short(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A checkout of ``rev`` for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="lsgd-bench-against-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=REPO,
                       check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                           check=False)


def json_rows(args: list[str], cwd: Path, pythonpath: Path, timeout: float = 900) -> list[dict]:
    """The JSON objects ``python <args>`` printed one per line (stderr on failure)."""
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"PYTHONPATH": str(pythonpath)})
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"python {' '.join(args)} (PYTHONPATH={pythonpath}) printed no "
                           f"row:\n{done.stderr[-2000:]}")
    return rows


def cell(old: Any, new: Any, unit: str = "") -> str:
    if not isinstance(old, (int, float)) or not isinstance(new, (int, float)) or not old:
        return f"{old} → {new}"
    return f"{old:g}{unit} → {new:g}{unit} ({new / old:.2f}×)"
