"""Target 9: the Platoon comparison. Samples/s of a plain training loop against the same loop
under lsgd with asynchronous EASGD (``easgd-async``), 1 and 2 workers on one node.

Platoon (Bouthillier et al., arXiv 1605.00521) reports asynchronous EASGD on 1-4 GPUs at 0.95x,
1.82x, 2.65x and 3.42x the samples/s of the same training without a framework. Here: the
medium workload of target 5 (``bench.workload``, a 2.1M-parameter numpy MLP, ~10 ms per step
on one core, batch 64) on a CPU-only machine; each worker is a process on a core of its own,
so 2 cores bound 2 workers. Measured in the same run: the plain loop alone in one process (the
baseline), two plain loops at once (the machine's ceiling: what 2 workers could reach with
nothing in between), lsgd's synchronous ``lsgd`` rule with 2 workers (a reference), and
easgd-async with 2 workers exchanging every 8 steps instead of 64 (about one sync of the node
with the global server every ``SYNC_EVERY`` = 0.05 s: what frequent syncing costs on 2 cores).
Each configuration runs 3 times (20 s), in an order rotated between repetitions, and each ratio
is taken against the plain loop of its own repetition; the table shows the medians.

    python -m bench.platoon [--quick]     # ~7 minutes (--quick: ~2); prints the table
    python -m bench --only platoon         # the same into bench/results.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import Result
from .throughput import lsgd_run, plain, rate

TARGET = "9. Platoon comparison"
PLATOON = {1: 0.95, 2: 1.82}  # Platoon's asynchronous EASGD, x of no framework, by GPUs
RUNS = (  # (label, workers, rule, knobs)
    ("easgd-async, 1 worker", 1, "easgd-async", {}),
    ("easgd-async, 2 workers", 2, "easgd-async", {}),
    ("lsgd (synchronous), 2 workers", 2, "lsgd", {}),
    ("easgd-async, 2 workers, an exchange every 8 steps", 2, "easgd-async",
     {"RULE_ARGS": "every=8"}),
)


def run(quick: bool, seconds: float | None = None, reps: int | None = None) -> list[Result]:
    """Every configuration ``reps`` times, in an order rotated between repetitions, each ratio
    against the plain loop of its own repetition: load from other work on a shared machine
    then hits every configuration alike. Reported: the median ratio (and each one in
    ``extra``)."""
    seconds = seconds or (12.0 if quick else 20.0)
    reps = reps or (1 if quick else 3)
    names = ["plain", "ceiling"] + [label for label, *_ in RUNS]
    rates: dict[str, list[float]] = {n: [0.0] * reps for n in names}
    info: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            shift = rep * len(names) // reps
            for name in names[shift:] + names[:shift]:
                if name == "plain":
                    (base,) = plain(seconds)
                    rates[name][rep] = rate([base])
                    info[name].append({"ms_per_step": 1000 * (base["last"] - base["first"])
                                       / base["steps"]})
                elif name == "ceiling":
                    rates[name][rep] = rate(plain(seconds, copies=2))
                else:
                    _, workers, rule, knobs = next(r for r in RUNS if r[0] == name)
                    r = lsgd_run(workers, seconds, Path(tmp) / f"r{rep}-{names.index(name)}",
                                 algorithm=rule, **knobs)
                    rates[name][rep] = rate(r["records"])
                    info[name].append({
                        "time_in_lsgd_pct": 100 * sum(x["in_lsgd_s"] for x in r["records"])
                        / sum(x["last"] - x["first"] for x in r["records"]),
                        "local_server_cpu_pct": 100 * r["local_cpu"],
                        "global_server_cpu_pct": 100 * r["global_cpu"],
                        "syncs": (r["summary"].get("async") or {}).get("syncs")})
    base_rate = float(np.median(rates["plain"]))
    ratios = {n: [rates[n][i] / rates["plain"][i] for i in range(reps)] for n in names}
    common = {"reps": reps, "seconds_per_run": seconds,
              "plain_samples_per_s": rates["plain"],
              "ms_per_step_plain": [x["ms_per_step"] for x in info["plain"]]}
    out = [Result(TARGET, "samples/s, two plain loops at once, no lsgd (the machine's ceiling)",
                  float(np.median(rates["ceiling"])), "samples/s", baseline=base_rate,
                  baseline_name="the plain loop alone, same run",
                  ratio=float(np.median(ratios["ceiling"])), ratio_note="value / baseline",
                  extra=common | {"ratios": ratios["ceiling"]})]
    for label, workers, rule, knobs in RUNS:
        platoon = PLATOON.get(workers) if rule == "easgd-async" and not knobs else None
        to_ceiling = [a / b for a, b in zip(rates[label], rates["ceiling"])]
        med = {k: float(np.median([x[k] for x in info[label] if x[k] is not None] or [np.nan]))
               for k in ("time_in_lsgd_pct", "local_server_cpu_pct", "global_server_cpu_pct",
                         "syncs")}
        out.append(Result(
            TARGET, f"samples/s, {label}", float(np.median(rates[label])), "samples/s",
            baseline=base_rate, baseline_name="the plain loop alone, same run",
            ratio=float(np.median(ratios[label])), ratio_note="lsgd / plain",
            goal=f"Platoon: {platoon}x" if platoon else "",
            extra=common | med | {"rule": rule, "workers": workers, "knobs": knobs,
                                  "ratios": ratios[label],
                                  "ratio_to_ceiling": float(np.median(to_ceiling)),
                                  "ratios_to_ceiling": to_ceiling}))
    return out


def table(results: list[Result]) -> str:
    lines = ["| run | samples/s | x plain loop (same run) | x two plain loops | time in lsgd | "
             "local / global server CPU, % of a core | syncs |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.extra
        ratios = e.get("ratios", [])
        notes = [f"{min(ratios):.2f}-{max(ratios):.2f}"] if len(ratios) > 1 else []
        notes += [f"Platoon {r.goal.removeprefix('Platoon: ')}"] if r.goal else []
        ratio = f"**{r.ratio:.2f}x**" + (f" ({'; '.join(notes)})" if notes else "")
        if "rule" not in e:  # the ceiling
            lines.append(f"| two plain loops at once | {r.value:,.0f} | {ratio} | 1x | – | – | – |")
            continue
        syncs = "–" if e.get("syncs") is None or np.isnan(e["syncs"]) else f"{e['syncs']:.0f}"
        lines.append(f"| {r.metric.removeprefix('samples/s, ')} | {r.value:,.0f} | {ratio} | "
                     f"{e['ratio_to_ceiling']:.2f}x | "
                     f"{e['time_in_lsgd_pct']:.1f}% | {e['local_server_cpu_pct']:.1f} / "
                     f"{e['global_server_cpu_pct']:.1f} | {syncs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.platoon", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of 12 s runs")
    args = parser.parse_args()
    t0 = time.monotonic()
    results = run(args.quick)
    print(f"plain loop alone: {results[0].baseline:,.0f} samples/s; {time.monotonic() - t0:.0f} s")
    print(table(results))
