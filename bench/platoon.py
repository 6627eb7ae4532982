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

    python -m bench.platoon [--quick]     # ~4 minutes (--quick: ~2); prints the table
    python -m bench --only platoon         # the same into bench/results.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

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


def run(quick: bool) -> list[Result]:
    seconds = 15.0 if quick else 30.0
    (base,) = plain(seconds)
    base_rate = rate([base])
    ceiling = rate(plain(seconds, copies=2))
    out = [Result(TARGET, "samples/s, two plain loops at once, no lsgd (the machine's ceiling)",
                  ceiling, "samples/s", baseline=base_rate,
                  baseline_name="the plain loop alone, same run", ratio=ceiling / base_rate,
                  ratio_note="value / baseline")]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, workers, rule, knobs) in enumerate(RUNS):
            r = lsgd_run(workers, seconds, Path(tmp) / f"r{i}", algorithm=rule, **knobs)
            got = rate(r["records"])
            platoon = PLATOON.get(workers) if rule == "easgd-async" and not knobs else None
            out.append(Result(
                TARGET, f"samples/s, {label}", got, "samples/s", baseline=base_rate,
                baseline_name="the plain loop alone, same run", ratio=got / base_rate,
                ratio_note="lsgd / plain", goal=f"Platoon: {platoon}x" if platoon else "",
                extra={"rule": rule, "workers": workers, "knobs": knobs,
                       "ratio_to_ceiling": got / ceiling, "ceiling_samples_per_s": ceiling,
                       "time_in_lsgd_pct": 100 * sum(x["in_lsgd_s"] for x in r["records"])
                       / sum(x["last"] - x["first"] for x in r["records"]),
                       "local_server_cpu_pct": 100 * r["local_cpu"],
                       "global_server_cpu_pct": 100 * r["global_cpu"],
                       "async": r["summary"].get("async"),
                       "steps": sum(x["steps"] for x in r["records"]),
                       "ms_per_step_baseline": 1000 * (base["last"] - base["first"]) / base["steps"]}))
    return out


def table(results: list[Result]) -> str:
    lines = ["| run | samples/s | x plain loop (same run) | x two plain loops | time in lsgd | "
             "local / global server CPU, % of a core | syncs |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.extra
        if not e:  # the ceiling
            lines.append(f"| two plain loops at once | {r.value:,.0f} | **{r.ratio:.2f}x** | 1x | "
                         f"– | – | – |")
            continue
        syncs = (e.get("async") or {}).get("syncs", "–")
        lines.append(f"| {r.metric.removeprefix('samples/s, ')} | {r.value:,.0f} | **{r.ratio:.2f}x**"
                     f"{f' (Platoon {r.goal[9:]})' if r.goal else ''} | {e['ratio_to_ceiling']:.2f}x | "
                     f"{e['time_in_lsgd_pct']:.1f}% | {e['local_server_cpu_pct']:.1f} / "
                     f"{e['global_server_cpu_pct']:.1f} | {syncs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.platoon", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 s runs instead of 30 s")
    args = parser.parse_args()
    t0 = time.monotonic()
    results = run(args.quick)
    print(f"plain loop alone: {results[0].baseline:,.0f} samples/s; {time.monotonic() - t0:.0f} s")
    print(table(results))
