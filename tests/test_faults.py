"""Injected faults: what still holds (issue 5). Each test is bounded."""

from __future__ import annotations

import math

import pytest

from conftest import assert_clean_exit, global_summary, metric_rows

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm, nodes", [("lsgd", 2), ("easgd", 1)])
def test_a_diverged_worker_never_leads_and_is_reset(cluster, tmp_path, algorithm, nodes):
    knobs = dict(NUM_GROUPS=nodes, ITERATIONS=4000, ALGORITHM=algorithm, TOYJOB_NAN="1:100",
                 TOYJOB_COUNT_DIR=tmp_path, **TOY)
    started = [cluster(0, PORT=0, **knobs)]
    if nodes == 2:
        started.append(cluster(1, PORT=cluster.port_of_node0(), **knobs))
    for node in started:
        assert node.wait(90) == 0, node.output
    n0 = started[0]
    assert "worker 1 has non-finite losses or parameters; resetting it" in n0.output
    assert n0.summary()["resets"] == {"1": 1}
    rows = [r for r in metric_rows(cluster.run_dir / "node0" / "metrics.csv") if r["kind"] != "eval"]
    reset_rows = [r for r in rows if r["reset"]]
    assert [r["worker_id"] for r in reset_rows] == ["1"]
    sick_round = [r for r in rows if r["round"] == reset_rows[0]["round"]]
    assert len(sick_round) >= 2  # the round went on with the healthy workers...
    for r in sick_round:  # ...and the diverged one did not lead it
        assert "1" not in (r["local_leader"], r["global_leader"])
    ev = n0.summary()["evaluation"]  # the leader, the average and the center stayed finite
    assert all(math.isfinite(v["accuracy"]) and v["accuracy"] > 0.5 for v in ev.values()), ev
    assert all((tmp_path / f"{w}.finite").read_text() == "True" for w in range(2 * nodes))
    assert global_summary(cluster.run_dir)["counter"] == 4000
    assert_clean_exit(cluster.run_dir, started)
