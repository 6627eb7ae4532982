"""``python -m lsgd plot RUN_DIR [-o FILE.png]``: one PNG of a run, finished or still going.

It reads every ``RUN_DIR/node*/metrics.csv`` (columns: ``local_server/metrics.py``; the last
line of a file still being written may be cut short, and is skipped) and draws:

- loss per worker against time (each node's own clock) and against global iterations;
- the leader timeline: the worker id of the global leader at each global round, coloured by
  the node it belongs to (LSGD);
- each worker's distance to what it was pulled toward at each round: the global leader (LSGD),
  the center (EASGD), dotted: its node's leader (LSGD local rounds);
- evaluation curves: the leader, the workers' average and the center, per metric.

matplotlib comes with the extra ``lsgd[plot]``; it is drawn with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .local_server.metrics import cell_float as _num
from .local_server.metrics import cell_int as _int

INSTALL = "pip install 'lsgd[plot]'"
DISTANCES = (("pull_global", "global leader", "-"), ("pull_center", "center", "-"),
             ("pull_local", "node leader", ":"))
TARGET_STYLE = {"leader": "-", "average": "--", "center": ":"}


class PlotError(Exception):
    """The run cannot be plotted; the message says why."""


@dataclass
class Run:
    """The rows of one run directory, by kind."""

    rounds: list[dict] = field(default_factory=list)  # round rows, with "node" added
    evals: list[dict] = field(default_factory=list)
    node_of: dict[int, int] = field(default_factory=dict)  # worker id -> node index
    nodes: list[int] = field(default_factory=list)
    skipped: int = 0  # lines that could not be read (a line cut short by a running job)
    stop_reason: str | None = None  # from RUN_DIR/global/summary.json once the job is over


def read_csv_rows(path: Path) -> tuple[list[dict], int]:
    """The rows of one metrics file, and how many lines were skipped (a partial last line)."""
    text = path.read_text(errors="replace")
    skipped = 0
    if text and not text.endswith("\n"):  # being written: its last line may be incomplete
        text, _, _ = text.rpartition("\n")
        skipped = 1
    reader = csv.DictReader(io.StringIO(text))
    rows = []
    for row in reader:
        if None in row or any(v is None for v in row.values()):  # too many or too few fields
            skipped += 1
            continue
        rows.append(row)
    return rows, skipped


def load(run_dir: str | Path) -> Run:
    """Read a run directory. Raises PlotError when it holds no metrics."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlotError(f"run directory {root} does not exist")
    files = sorted((int(m.group(1)), p) for p in root.glob("node*/metrics.csv")
                   if (m := re.fullmatch(r"node(\d+)", p.parent.name)))
    if not files:
        raise PlotError(f"no node*/metrics.csv in {root} (is it a RUN_DIR of lsgd?)")
    run = Run()
    for node, path in files:
        try:
            rows, skipped = read_csv_rows(path)
        except OSError as exc:
            raise PlotError(f"cannot read {path}: {exc.strerror}") from None
        run.skipped += skipped
        run.nodes.append(node)
        for row in rows:
            it = _num(row.get("iteration"))
            if it is None:
                run.skipped += 1
                continue
            if row.get("kind") == "eval":
                run.evals.append(row)
                continue
            wid = _int(row.get("worker_id"))
            if wid is None:
                run.skipped += 1
                continue
            row["node"] = node
            run.node_of.setdefault(wid, node)
            run.rounds.append(row)
    try:
        summary = json.loads((root / "global" / "summary.json").read_text())
        run.stop_reason = str(summary["stop_reason"])[:200]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # still running, or not node 0's directory
    if not run.rounds and not run.evals:
        raise PlotError(f"the metrics files in {root} have no rows yet (the job writes one per "
                        "worker and round)")
    return run


def draw(run: Run, title: str = "") -> Any:
    """The figure (a matplotlib ``Figure``, not tied to pyplot). Panels are named by their
    titles: loss vs time, loss vs iterations, leader timeline, distance, evaluations."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 12), dpi=100, layout="constrained")
    axes = fig.subplots(3, 2)
    loss_t, loss_i = axes[0]
    lead, dist = axes[1]
    evals, info = axes[2]
    by_worker: dict[int, list[dict]] = {}
    for r in run.rounds:
        by_worker.setdefault(int(float(r["worker_id"])), []).append(r)
    workers = sorted(by_worker)
    colors = {w: f"C{i % 10}" for i, w in enumerate(workers)}
    for w, mine in sorted(by_worker.items()):
        pts = [(_num(r["time_s"]), _num(r["iteration"]), _num(r["loss"])) for r in mine]
        pts = [p for p in pts if p[2] is not None]
        label = f"worker {w} (node {run.node_of.get(w, '?')})"
        loss_t.plot([p[0] for p in pts if p[0] is not None],
                    [p[2] for p in pts if p[0] is not None], color=colors[w], lw=1, label=label)
        loss_i.plot([p[1] for p in pts], [p[2] for p in pts], color=colors[w], lw=1, label=label)
        for column, target, style in DISTANCES:
            d = [(_num(r["iteration"]), _num(r.get(column))) for r in mine]
            d = [p for p in d if p[1] is not None]
            if d:
                dist.plot([p[0] for p in d], [p[1] for p in d], style, color=colors[w], lw=1,
                          label=f"worker {w} to {target}")
    _leaders(lead, run)
    _evaluations(evals, run)
    _info(info, run, workers)
    it = "global iteration"
    for ax, name, x, y in ((loss_t, "loss per worker vs time", "seconds since the node started",
                            "loss"),
                           (loss_i, "loss per worker vs global iterations", it, "loss"),
                           (dist, "distance to the leader or center", it,
                            "distance (before the pull)")):
        ax.set_title(name)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        _finish(ax)
    for ax in (loss_t, loss_i, dist):  # values over two decades and more: a log scale
        if _positive(ax):
            ax.set_yscale("log")
    fig.suptitle(title or "lsgd run")
    return fig


def _leaders(ax: Any, run: Run) -> None:
    """Worker id of the global leader per global round, coloured by its node."""
    seen = _global_leaders(run)
    by_node: dict[Any, list[tuple[float, int]]] = {}
    for it, leader in seen.values():
        by_node.setdefault(run.node_of.get(leader, "?"), []).append((it, leader))
    timeline = sorted(seen.values())
    if timeline:  # a light line joins the rounds, so a change of leader stands out
        ax.step([p[0] for p in timeline], [p[1] for p in timeline], where="post", color="0.8",
                lw=0.8, zorder=0)
    for i, (node, pts) in enumerate(sorted(by_node.items(), key=lambda kv: str(kv[0]))):
        pts.sort()
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, color=f"C{i % 10}",
                   label=f"node {node}")
    ax.set_title("leader timeline (global rounds)")
    ax.set_xlabel("global iteration")
    ax.set_ylabel("worker id of the global leader")
    ax.yaxis.get_major_locator().set_params(integer=True)
    _finish(ax, empty="no global leader (EASGD, or no global round yet)")


def _evaluations(ax: Any, run: Run) -> None:
    """One curve per target and metric; metrics after the first on a second y axis (an
    accuracy near 1 and a loss near 0.1 would flatten each other on one)."""
    curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in run.evals:
        value = _num(r.get("value"))
        if value is not None and r.get("target") and r.get("metric"):
            curves.setdefault((r["metric"], r["target"]), []).append((_num(r["iteration"]), value))
    metrics = sorted({m for m, _ in curves})
    axis = {m: ax for m in metrics[:1]}
    if len(metrics) > 1:
        twin = ax.twinx()
        axis.update({m: twin for m in metrics[1:]})
        twin.set_ylabel(", ".join(metrics[1:]))
    for (metric, target), pts in sorted(curves.items()):
        pts.sort()
        axis[metric].plot([p[0] for p in pts], [p[1] for p in pts], TARGET_STYLE.get(target, "-."),
                          marker="o", ms=3, color=f"C{metrics.index(metric) % 10}",
                          label=f"{target} {metric}")
    ax.set_title("evaluations")
    ax.set_xlabel("global iteration")
    ax.set_ylabel(metrics[0] if metrics else "value")
    if curves:
        handles = [h for a in {id(a): a for a in axis.values()}.values()
                   for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles, [h.get_label() for h in handles], fontsize="x-small")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no evaluation yet (EVAL_EVERY; the last one comes at the end)",
                ha="center", va="center", transform=ax.transAxes, color="gray")


def _info(ax: Any, run: Run, workers: list[int]) -> None:
    ax.axis("off")
    last = max((_num(r["iteration"]) or 0 for r in run.rounds), default=0)
    kinds = sorted({r.get("kind", "") for r in run.rounds})
    changes = _leader_changes(run)
    lines = [f"nodes: {len(run.nodes)} ({', '.join(f'node{n}' for n in run.nodes)})",
             f"workers: {len(workers)}",
             f"round rows: {len(run.rounds)} ({', '.join(kinds)})",
             f"evaluation rows: {len(run.evals)}", f"last global iteration: {last:.0f}"]
    if changes is not None:
        lines.append(f"global leader changes: {changes}")
    if run.stop_reason:
        lines.append(f"stop reason: {run.stop_reason}")
    if run.skipped:
        lines.append(f"lines skipped: {run.skipped} (cut short while being written)")
    ax.text(0.02, 0.98, "\n".join(lines), va="top", family="monospace", transform=ax.transAxes)
    ax.set_title("run")


def _global_leaders(run: Run) -> dict[int, tuple[float, int]]:
    """Global (and final) round id -> (its iteration, the worker id of its leader)."""
    seen: dict[int, tuple[float, int]] = {}
    for r in run.rounds:
        leader, rid = _int(r.get("global_leader")), _int(r.get("round"))
        if r.get("kind") in ("global", "final") and leader is not None and rid is not None:
            seen.setdefault(rid, (_num(r["iteration"]), leader))
    return seen


def _leader_changes(run: Run) -> int | None:
    leaders = _global_leaders(run)
    seq = [leaders[k][1] for k in sorted(leaders)]
    return sum(a != b for a, b in zip(seq, seq[1:])) if seq else None


def _finish(ax: Any, empty: str = "no data yet") -> None:
    if ax.lines or ax.collections:
        if len(ax.get_legend_handles_labels()[0]) <= 16:
            ax.legend(fontsize="x-small")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")


def _positive(ax: Any) -> bool:
    ys = [y for line in ax.lines for y in line.get_ydata()]
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 100


def save(fig: Any, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(out, format="png")






def add_parser(sub: Any) -> None:
    """The ``plot`` subcommand's arguments."""
    p = sub.add_parser("plot", help="draw a run's loss, leaders, distances and evaluations to a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's RUN_DIR (finished or running)")
    p.add_argument("-o", "--output", metavar="FILE.png", help="default: RUN_DIR/plots.png")


def main(args: argparse.Namespace) -> int:
    """Run ``lsgd plot``; returns the exit code (2: matplotlib missing, or no metrics)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"lsgd plot: error: drawing needs matplotlib: {INSTALL}", file=sys.stderr)
        return 2
    try:
        run = load(args.run_dir)
    except PlotError as exc:
        print(f"lsgd plot: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path(args.run_dir) / "plots.png"
    try:
        save(draw(run, title=f"lsgd run {args.run_dir}"), out)
    except OSError as exc:
        print(f"lsgd plot: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"lsgd plot: wrote {out} ({len(run.rounds)} round rows, {len(run.evals)} "
          f"evaluation rows, {len(run.nodes)} node(s))")
    return 0


__all__ = ["Run", "PlotError", "load", "draw", "save", "main", "add_parser"]
