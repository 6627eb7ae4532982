"""The study's table, plots and the results block of docs/study.md, from the results file.

The time axis (docs/study.md explains it): a cluster where every worker has its own device of
this machine's single-core speed, and the links of the measured latency and bandwidth.

- A worker's step costs ``t_step``, measured alone in the same invocation as the run.
- A synchronous rule's global round puts a push and a pull on every worker's critical path:
  ``2 * latency`` per round, plus the bytes the global server moved over the run divided by the
  bandwidth (its one link carries every node's transfer), spread evenly over the steps.
- An asynchronous rule exchanges beside training (each node's sync thread): it costs time only
  where the link is busier than the computation, ``T(k) = max(k * t_step, comm * k / steps)``.
- Exchanges inside a node go through shared memory and are not charged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from . import grid

START, END = "<!-- study:start -->", "<!-- study:end -->"
SYNC = {"bsp", "localsgd", "easgd", "lsgd", "diloco", "grawa"}


def curve(rec: dict, split: str = "test") -> list[float]:
    return rec[split][grid.RULES[rec["config"]["rule"]].curve]


def comm_seconds(rec: dict) -> float:
    """The communication time the model charges the whole run (see the module's docstring)."""
    rule, moved, lk = rec["config"]["rule"], rec["moved"], rec["link"]
    if rule == "sgd":
        return 0.0
    link_time = (moved["bytes_in"] + moved["bytes_out"]) / lk["bandwidth_Bps"]
    rounds = moved.get("node0_rounds") or {}
    if rule in SYNC:
        globals_ = sum(v for k, v in rounds.items() if k in ("global", "final"))
        return globals_ * 2 * lk["latency_s"] + link_time
    exchanges = rounds.get("exchange", 0)  # node 0's; the other nodes' run beside them
    return max(link_time, exchanges * 2 * lk["latency_s"])


def model_times(rec: dict) -> np.ndarray:
    """Modelled seconds at each mark."""
    k = np.asarray(rec["marks"], float)
    steps = rec["config"]["steps"]
    compute = k * rec["t_step"]
    comm = comm_seconds(rec) * k / steps
    if rec["config"]["rule"] in SYNC:
        return compute + comm
    return np.maximum(compute, comm)


def first_reach(xs: np.ndarray, ys: list[float], target: float) -> float | None:
    """Where the curve, smoothed over 2 marks, first reaches ``target`` (interpolated)."""
    y = np.asarray(ys, float)
    if y.size < 2:
        return None
    sm = np.concatenate([[y[0]], (y[1:] + y[:-1]) / 2])
    hit = np.nonzero(sm >= target)[0]
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return float(xs[0])
    f = (target - sm[i - 1]) / (sm[i] - sm[i - 1])
    return float(xs[i - 1] + f * (xs[i] - xs[i - 1]))


def _ms(values: list[float | None], fmt: str = "{:.3f}") -> str:
    got = [v for v in values if v is not None and math.isfinite(v)]
    if not got:
        return "–"
    text = fmt.format(np.mean(got))
    if len(got) > 1:
        text += " ± " + fmt.format(np.std(got))
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)})"
    return text


def groups(results: dict, budgets: dict) -> dict[tuple[str, str, int], list[dict]]:
    """Runs of the study proper (the tuned setting), by (workload, rule, workers)."""
    out: dict[tuple[str, str, int], list[dict]] = {}
    for rec in results["runs"].values():
        c = rec["config"]
        b = budgets.get(c["workload"])
        if not rec["ok"] or b is None or c["steps"] != b.steps:
            continue
        rule = grid.RULES[c["rule"]]
        tuned = results["tuned"].get(f"{c['workload']}/{c['rule']}/{b.steps}", {}).get("setting")
        setting = tuned if tuned is not None else (0 if len(rule.grid) == 1 else len(rule.grid) // 2)
        want = grid.resolve(rule.base + rule.grid[setting], c["workers"])
        if tuple(map(tuple, c["knobs"])) != want:
            continue  # a tuning run of another setting
        out.setdefault((c["workload"], c["rule"], c["workers"]), []).append(rec)
    return out


def table(results: dict, budgets: dict) -> list[str]:
    lines = []
    g = groups(results, budgets)
    for name, b in budgets.items():
        rows = sorted(((r, w) for (n, r, w) in g if n == name),
                      key=lambda rw: (rw[1], list(grid.RULES).index(rw[0])))
        if not rows:
            continue
        lines += [f"**{name}**: {b.steps} steps per worker, target {b.target:.0%} test accuracy",
                  "", "| rule | workers | seeds | accuracy at the budget | product's final "
                  "evaluation | steps to target | modelled s to target | modelled s at the "
                  "budget | workers apart (steps) |", "|---|---|---|---|---|---|---|---|---|"]
        for rule, w in rows:
            recs = g[(name, rule, w)]
            final = [float(np.mean(curve(r)[-2:])) for r in recs]
            product = [_product(r) for r in recs]
            steps_to = [first_reach(np.asarray(r["marks"], float), curve(r), b.target) for r in recs]
            time_to = [first_reach(model_times(r), curve(r), b.target) for r in recs]
            total = [float(model_times(r)[-1]) for r in recs]
            apart = [r.get("lag_s", 0.0) / r["pace_s"] for r in recs if r["pace_s"]]
            lines.append(f"| {rule} | {w} | {len(recs)} | {_ms(final)} | {_ms(product)} | "
                         f"{_ms(steps_to, '{:.0f}')} | {_ms(time_to, '{:.2f}')} | "
                         f"{_ms(total, '{:.2f}')} | {max(apart, default=0):.0f} |")
        lines.append("")
    return lines


def _product(rec: dict) -> float | None:
    rule = rec["config"]["rule"]
    f = rec.get("final") or {}
    want = {"sgd": "leader", "lsgd": "leader", "bsp": "average", "localsgd": "average",
            "gosgd": "average"}.get(rule, "center")
    return f.get(want)


def plots(results: dict, budgets: dict, out_dir: Path, prefix: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    g = groups(results, budgets)
    written = []
    colors = dict(zip(grid.RULES, plt.get_cmap("tab10").colors))
    for name, b in budgets.items():
        counts = sorted({w for (n, r, w) in g if n == name and r != "sgd"})
        if not counts:
            continue
        for axis in ("steps", "time"):
            fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
            for ax, w in zip(axes[0], counts):
                for rule in grid.RULES:
                    recs = g.get((name, rule, 1 if rule == "sgd" else w), [])
                    if not recs:
                        continue
                    n = min(len(r["marks"]) for r in recs)
                    ys = np.mean([curve(r)[:n] for r in recs], axis=0)
                    xs = (np.asarray(recs[0]["marks"][:n], float) if axis == "steps"
                          else np.mean([model_times(r)[:n] for r in recs], axis=0))
                    ax.plot(xs, ys, label=rule, color=colors[rule],
                            ls="--" if rule == "sgd" else "-")
                ax.axhline(b.target, color="gray", ls=":", lw=1)
                ax.set_title(f"{name}, {w} workers")
                ax.set_xlabel("steps per worker" if axis == "steps" else "modelled seconds")
                ax.set_ylabel("test accuracy")
                lo = min(b.target - 0.25, 0.5)
                ax.set_ylim(lo, None)
            axes[0][-1].legend(fontsize=7, loc="lower right")
            fig.tight_layout()
            path = out_dir / f"{prefix}{name}-{axis}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written


def write(results: dict, budgets: dict, doc: Path, command: str) -> list[str]:
    """Rewrite the results block of ``doc`` (created if missing); returns what it printed."""
    img = doc.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    prefix = "study-" if doc.name == "study.md" else f"{doc.stem}-"
    paths = plots(results, budgets, img, prefix)
    inv = results.get("invocations", [])
    lines = [START, "", f"Produced by `{command}` (the results file: "
             f"`{len(results['runs'])}` runs).", ""]
    if inv:
        last = inv[-1]
        lines.append(f"Machine: {last['machine']['cpu']}, {last['machine']['cores']} cores. "
                     "Step time alone, link latency and bandwidth per invocation: "
                     + "; ".join(f"{i['machine']['date']}: "
                                 + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in i["t_step"].items())
                                 + f", latency {i['link']['latency_s'] * 1000:.2f} ms, "
                                 f"{i['link']['bandwidth_Bps'] / 1e9:.2f} GB/s" for i in inv[-4:]))
        lines.append("")
    tuned = results.get("tuned", {})
    if tuned:
        lines += ["Tuning (8 workers, seed 0, validation accuracy at the budget):", ""]
        for key, t in sorted(tuned.items()):
            pick = t["grid"][t["setting"]]
            lines.append(f"- `{key}`: {', '.join('='.join(kv) for kv in pick) or 'defaults'} "
                         f"(validation {', '.join(f'{s:.3f}' for s in t['val_scores'])})")
        lines.append("")
    lines += table(results, budgets)
    lines += [f"![{p.stem}](img/{p.name})" for p in paths]
    lines += ["", END]
    block = "\n".join(lines)
    text = doc.read_text() if doc.exists() else f"# Study results\n\n{START}\n{END}\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text += "\n" + block + "\n"
    doc.write_text(text)
    return lines
