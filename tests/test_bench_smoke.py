"""Tiny smoke runs of the benchmark harness (the benchmarks themselves run with `python -m bench`)."""

import math

from bench.__main__ import table
from bench.common import Result
from bench.throughput import time_to


def test_table_formats_every_result():
    rows = [Result("1. control plane", "step", 0.2, "us", baseline=500.0, baseline_name="relay",
                   ratio=2500.0, ratio_note="baseline / lsgd", goal="<= 50 us", met=True),
            Result("6. time to accuracy", "x", math.nan, "s", met=None)]
    text = table(rows).splitlines()
    assert len(text) == 4
    assert "0.2 us" in text[2] and "2,500x" in text[2] and "| yes |" in text[2]
    assert "| – |" in text[3]


def test_time_to_target_uses_a_smoothed_curve():
    accs = [0.5, 0.9, 0.5, 0.5, 0.8, 0.8, 0.8]
    curve = [(10.0 + i, i, a) for i, a in enumerate(accs)]
    # the lone 0.9 at t=11 does not count; the mean of 3 first reaches 0.7 at t=15
    assert time_to(curve, 0.7, t0=10.0, smooth=3) == 5.0
    assert time_to(curve, 0.95, t0=10.0) is None


def test_pull_benchmark_smoke():
    from bench import pulls

    results = pulls.run(quick=True)
    assert {r.target for r in results} == {"4. pulls"}
    speed = results[0]
    assert speed.value > 0 and speed.baseline > 0
    assert abs(speed.ratio - speed.value / speed.baseline) < 0.01


def test_throughput_counts_only_the_window_when_all_workers_train():
    from bench.throughput import BATCH, rate

    fast = {"first": 0.0, "last": 10.0, "marks": [(i * 0.1, i * 10) for i in range(1, 101)]}
    late = {"first": 1.0, "last": 10.0, "marks": [(1 + i * 0.1, i * 10) for i in range(1, 91)]}
    assert abs(rate([fast]) / BATCH - 100) < 2  # marks every 10 steps: ~1% of edge error
    assert abs(rate([fast, late]) / BATCH - 200) < 3  # the late start does not dilute the rate


def test_rule_exchange_benchmark_smoke():
    """The rule-exchange rows on a tiny model with in-process servers (the benchmark checks
    every round's exchanged vector against the closed form and raises on a mismatch)."""
    from bench import exchange

    results = exchange.run(quick=True, n=1 << 16, in_process=True, rounds=2)
    assert {r.target for r in results} == {exchange.TARGET}
    lsgd, average, diloco, pull = results
    assert lsgd.metric.startswith("LSGD") and lsgd.value > 0
    for r, name in ((average, "average"), (diloco, "diloco")):
        assert r.metric.startswith(name) and r.baseline == lsgd.value
        # value and baseline are rounded to 0.1 ms (a few ms here: about 1% each), the ratio
        # is of the unrounded times: they agree within what the rounding can move
        half = 0.5e-4
        bound = r.ratio * (half / r.value + half / r.baseline) + 0.0005
        assert abs(r.ratio - r.baseline / r.value) <= bound and r.met == (r.ratio >= exchange.GOAL)
        assert r.extra["rounds"] == 2 and set(r.extra["phases_ms"]) == set(exchange.PHASES)
        assert r.extra["wire_bytes"] == 2 * lsgd.extra["wire_bytes"]  # every node up and down
    assert pull.unit == "ms" and pull.value > 0 and pull.met is not None


def test_window_rate_counts_only_while_every_worker_trains():
    from bench.hetero import window_rate

    fast = {"ends": [0.5 + 0.01 * i for i in range(301)] + [5.0]}  # 100/s, then a long last call
    slow = {"ends": [1.0 + 0.1 * i for i in range(21)] + [5.0]}  # from 1.0 to 3.0
    assert abs(window_rate([fast, slow], fast) - 100) < 1  # counted over [1.0, 3.0]
    assert abs(window_rate([fast, slow], slow) - 10) < 0.5
    assert abs(window_rate([fast], fast) - 100) < 1  # the final wait (3.5 -> 5.0) left out


def test_mixed_speeds_benchmark_smoke(tmp_path):
    """One real 2-node job of the mixed-speeds benchmark (easgd-async, 3 s budget) and its row;
    the harness checks the exact counter and raises otherwise."""
    from bench import hetero

    r = hetero.job("easgd-async", 2, 3.0, tmp_path / "run")
    assert {w["node"] for w in r["workers"]} == {0, 1} and r["rounds"] == 1
    row = hetero._row("easgd-async", r, 180.0, "fast node")
    assert row.target == hetero.TARGET and row.value > row.extra["slow_steps_per_s"] > 0
    assert row.extra["fast_idle_at_end_s"] >= 0 and len(row.extra["local_server_cpu_pct"]) == 2
    assert "| easgd-async |" in hetero.table([row])


def test_platoon_table_formats_the_ceiling_and_the_runs():
    from bench import platoon
    from bench.common import Result

    ceiling = Result(platoon.TARGET, "ceiling", 13000.0, "samples/s", baseline=7000.0, ratio=1.86)
    run = Result(platoon.TARGET, "samples/s, easgd-async, 2 workers", 12000.0, "samples/s",
                 baseline=7000.0, ratio=12000 / 7000, goal="Platoon: 1.82x",
                 extra={"rule": "easgd-async", "ratio_to_ceiling": 0.92, "time_in_lsgd_pct": 1.5,
                        "local_server_cpu_pct": 2.0, "global_server_cpu_pct": 1.0, "syncs": 40.0,
                        "ratios": [1.6, 12 / 7, 1.8]})
    lines = platoon.table([ceiling, run]).splitlines()
    assert "| two plain loops at once | 13,000 | **1.86x** |" in lines[2]
    assert "| easgd-async, 2 workers | 12,000 | **1.71x** (1.60-1.80; Platoon 1.82x) | 0.92x |" in lines[3]
    assert lines[3].endswith("| 40 |")


def test_study_quick_form_runs_every_step_of_the_study(tmp_path):
    """A part of ``python -m bench.study --quick`` (one workload, three rules): real jobs through
    train.sh, snapshots evaluated, the table, the plots and the document's block written."""
    import json

    from bench.study.__main__ import main as study

    results, doc = tmp_path / "quick.json", tmp_path / "quick.md"
    code = study(["--quick", "--workloads", "mlp", "--rules", "sgd", "lsgd", "easgd-async",
                  "--results", str(results), "--doc", str(doc)])
    assert code == 0
    runs = json.loads(results.read_text())["runs"]
    assert len(runs) == 3 and all(r["ok"] for r in runs.values()), \
        [r["error"] for r in runs.values()]
    for r in runs.values():
        workers = r["config"]["workers"]
        assert len(r["test"]["workers"]) == workers and len(r["marks"]) >= 5
        assert r["test"]["average"][-1] > 0.3  # ten classes: chance is 0.1
        assert sum(r["steps"]) == workers * r["config"]["steps"]  # the job's counter, exactly
    text = doc.read_text()
    for rule in ("sgd", "lsgd", "easgd-async"):
        assert f"| {rule} |" in text
    assert (tmp_path / "img" / "quick-mlp-time.png").stat().st_size > 0
