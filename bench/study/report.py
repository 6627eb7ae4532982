"""The study's table, plots and the results block of docs/study.md, from the results file.

The time axis (docs/study.md explains it): a cluster where every worker has its own device of
this machine's single-core speed, and links of the measured latency and bandwidth. Every run is
timed with the same constants: per workload the median step time, and the median link, over all
the invocations that made the runs.

- A worker's step costs ``t_step``.
- A synchronous rule's round puts a call to the global server on every worker's critical path
  (its report, and for a global round a push and a pull): ``2 * latency`` per round, local rounds
  (LSGD's, which also wait for every node at the global server) included. The bytes the global
  server moved pass through its one link: ``bytes / bandwidth``, spread evenly over the steps.
- An asynchronous rule exchanges beside training (each node's sync thread), so it costs time
  only where that traffic takes longer than the computation: ``T(k) = max(k * t_step,
  comm * k / steps)``, ``comm = max(bytes / bandwidth, syncs * 2 * latency)`` with ``syncs`` the
  most any node made.
- Exchanges inside a node go through shared memory and are not charged.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from . import grid
from .run import METHOD

START, END = "<!-- study:start -->", "<!-- study:end -->"
SYNC = {"bsp", "localsgd", "easgd", "lsgd", "diloco", "grawa"}


def pick(results: dict, workload: str, rule: grid.Rule, steps: int) -> tuple[int, str]:
    """The (setting, model) tuning picked, or the quick form's (the middle, the product)."""
    t = results.get("tuned", {}).get(f"{workload}/{rule.name}/{steps}/{METHOD}")
    if t and t["grid"] == [list(map(list, g)) for g in rule.grid]:
        return t["setting"], t["model"]
    return len(rule.grid) // 2, rule.product


def constants(results: dict) -> dict:
    """{"t_step": {workload: s}, "latency_s", "bandwidth_Bps"}: medians over the invocations."""
    inv = results.get("invocations", [])
    names = {n for i in inv for n in i["t_step"]}
    return {"t_step": {n: statistics.median(i["t_step"][n] for i in inv if n in i["t_step"])
                       for n in names},
            "latency_s": statistics.median(i["link"]["latency_s"] for i in inv) if inv else 0.0,
            "bandwidth_Bps": statistics.median(i["link"]["bandwidth_Bps"] for i in inv) if inv else 1.0}


def comm_seconds(rec: dict, k: dict) -> float:
    """The communication time the model charges the whole run (see the module's docstring)."""
    rule, moved = rec["config"]["rule"], rec["moved"]
    if rule == "sgd":
        return 0.0
    link_time = (moved["bytes_in"] + moved["bytes_out"]) / k["bandwidth_Bps"]
    if rule in SYNC:
        rounds = sum(v for v in (moved["node_rounds"][0] or {}).values())
        return rounds * 2 * k["latency_s"] + link_time
    return max(link_time, max(moved["node_syncs"], default=0) * 2 * k["latency_s"])


def model_times(rec: dict, k: dict) -> np.ndarray:
    """Modelled seconds at each mark and at the end of the run."""
    steps = rec["config"]["steps"]
    x = np.asarray(rec["marks"] + [steps], float)
    compute = x * k["t_step"][rec["config"]["workload"]]
    comm = comm_seconds(rec, k) * x / steps
    return compute + comm if rec["config"]["rule"] in SYNC else np.maximum(compute, comm)


def first_reach(xs: np.ndarray, ys: list[float], target: float) -> float | None:
    """Where the curve first reaches ``target``, interpolated between points; None: never."""
    y = np.asarray(ys, float)
    hit = np.nonzero(y >= target)[0]
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return float(xs[0])
    f = (target - y[i - 1]) / (y[i] - y[i - 1])
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
    """The study's runs (the picked setting, the reported seeds), by (workload, rule, workers)."""
    out: dict[tuple[str, str, int], list[dict]] = {}
    for rec in results["runs"].values():
        c = rec["config"]
        b = budgets.get(c["workload"])
        if (not rec["ok"] or b is None or c["steps"] != b.steps or c.get("method") != METHOD
                or c["seed"] == grid.TUNE_SEED):
            continue
        rule = grid.RULES[c["rule"]]
        setting, _ = pick(results, c["workload"], rule, b.steps)
        if tuple(map(tuple, c["knobs"])) != grid.resolve(rule.base + rule.grid[setting], c["workers"]):
            continue  # another setting's run
        out.setdefault((c["workload"], c["rule"], c["workers"]), []).append(rec)
    return out


def curve(results: dict, rec: dict, budgets: dict, split: str = "test") -> list[float]:
    """The run's accuracy at each mark and at the end, of the model its rule's tuning picked."""
    c = rec["config"]
    _, model = pick(results, c["workload"], grid.RULES[c["rule"]], budgets[c["workload"]].steps)
    return rec[split].get(model) or rec[split]["average"]


def table(results: dict, budgets: dict) -> list[str]:
    lines = []
    g = groups(results, budgets)
    k = constants(results)
    for name, b in budgets.items():
        rows = sorted(((r, w) for (n, r, w) in g if n == name),
                      key=lambda rw: (rw[1], list(grid.RULES).index(rw[0])))
        if not rows:
            continue
        lines += [f"**{name}**: {b.steps} steps per worker, target {b.target:.0%} test accuracy; "
                  f"a step {k['t_step'][name] * 1000:.2f} ms",
                  "", "| rule | model | workers | seeds | test accuracy at the budget | steps to "
                  "target | modelled s to target | modelled s at the budget | steps taken | "
                  "workers apart (steps) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for rule, w in rows:
            recs = g[(name, rule, w)]
            _, model = pick(results, name, grid.RULES[rule], b.steps)
            curves = [curve(results, r, budgets) for r in recs]
            steps_x = [np.asarray(r["marks"] + [b.steps], float) for r in recs]
            final = [c[-1] for c in curves]
            steps_to = [first_reach(x, c, b.target) for x, c in zip(steps_x, curves)]
            time_to = [first_reach(model_times(r, k), c, b.target) for r, c in zip(recs, curves)]
            total = [float(model_times(r, k)[-1]) for r in recs]
            taken = [s for r in recs for s in r["steps"]]
            apart = max(r["lag_s"] / r["pace_s"] for r in recs)
            held = "" if all(r.get("fair") for r in recs) else " (not held)"
            lines.append(f"| {rule} | {model} | {w} | {len(recs)} | {_ms(final)} | "
                         f"{_ms(steps_to, '{:.0f}')} | {_ms(time_to, '{:.2f}')} | "
                         f"{_ms(total, '{:.2f}')} | {min(taken)}-{max(taken)}{held} | {apart:.0f} |")
        lines.append("")
    return lines


def plots(results: dict, budgets: dict, out_dir: Path, prefix: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    g = groups(results, budgets)
    k = constants(results)
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
                    n = min(len(r["marks"]) for r in recs) + 1  # the marks and the end
                    ys = np.mean([curve(results, r, budgets)[-n:] for r in recs], axis=0)
                    xs = (np.asarray(recs[0]["marks"][-n + 1:] + [b.steps], float) if axis == "steps"
                          else np.mean([model_times(r, k)[-n:] for r in recs], axis=0))
                    ax.plot(xs, ys, label=rule, color=colors[rule],
                            ls="--" if rule == "sgd" else "-")
                ax.axhline(b.target, color="gray", ls=":", lw=1)
                ax.set_title(f"{name}, {w} workers (mean of seeds)")
                ax.set_xlabel("steps per worker" if axis == "steps" else "modelled seconds")
                ax.set_ylabel("test accuracy")
                ax.set_ylim(max(0.0, b.target - 0.3), None)
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
    k = constants(results)
    lines = [START, "", f"Produced by `{command}` (the results file: "
             f"`{len(results['runs'])}` runs, {len(inv)} invocations).", ""]
    if inv:
        m = inv[-1]["machine"]
        lines += [f"Machine: {m['cpu']}, {m['cores']} cores. The modelled cluster (medians over "
                  "the invocations): a step " + ", ".join(
                      f"{n} {v * 1000:.2f} ms" for n, v in sorted(k["t_step"].items()))
                  + f"; a transfer {k['latency_s'] * 1000:.2f} ms + bytes at "
                  f"{k['bandwidth_Bps'] / 1e9:.2f} GB/s.", ""]
    tuned = {key: t for key, t in results.get("tuned", {}).items() if key.endswith(METHOD)}
    if tuned:
        lines += [f"Tuning ({grid.TUNE_WORKERS} workers, seed {grid.TUNE_SEED}, validation "
                  "accuracy at the budget: the mean of the last two marks and the end):", ""]
        for key, t in sorted(tuned.items()):
            chosen = t["grid"][t["setting"]]
            scores = "; ".join(", ".join(f"{m} {v:.3f}" for m, v in sc.items())
                               for sc in t["val_scores"])
            lines.append(f"- `{key.rsplit('/', 2)[0]}`: "
                         f"{', '.join('='.join(kv) for kv in chosen) or 'its defaults'}, "
                         f"the {t['model']} (per setting: {scores})")
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
