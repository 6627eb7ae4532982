"""End to end: the rules of issue 11 (``average``, ``diloco``, and ``average`` with ``G_COMM=1``:
BSP) train the default digits job through ``train.sh`` on 2 nodes x 2 workers, with an exact
counter; their product is the center (the average, DiLoCo's outer parameters)."""

from __future__ import annotations

import json
import time

import pytest

from conftest import assert_clean_exit, global_summary

CASES = {
    "average": dict(ALGORITHM="average"),
    "diloco": dict(ALGORITHM="diloco"),
    # synchronous data-parallel SGD: every step of every worker is a global round
    "average-bsp": dict(ALGORITHM="average", G_COMM=1, L_COMM=1, ITERATIONS=1200),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_new_rule_trains_digits_on_two_nodes(cluster, case):
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ITERATIONS=6000) | CASES[case]
    t0 = time.monotonic()
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n1.wait(150) == 0, n1.output
    assert n0.wait(30) == 0, n0.output
    g = global_summary(cluster.run_dir)
    counter = g["counter"]
    done = sum(sum(n.summary()["workers"].values()) for n in (n0, n1))
    ev = n0.summary()["evaluation"]
    print(f"{case}: {time.monotonic() - t0:.1f} s, counter {counter}, workers' iterations {done}, "
          f"{g['rounds']} rounds, "
          f"accuracy {json.dumps(ev)}")
    assert counter == done == knobs["ITERATIONS"]
    period = 4 * knobs.get("G_COMM", 64)  # a global round every G_COMM steps of each worker
    assert abs(g["rounds"] - knobs["ITERATIONS"] / period) <= 2, g["rounds"]
    for node in (n0, n1):
        assert set(node.summary()["worker_exit_codes"].values()) == {0}
    assert ev["center"]["accuracy"] >= 0.95, ev  # the rule's product
    assert "Traceback" not in n0.output + n1.output
    assert_clean_exit(cluster.run_dir, [n0, n1])
