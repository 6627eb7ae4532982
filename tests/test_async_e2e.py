"""End to end: the asynchronous built-in rules (issue 12) train the default digits job through
``train.sh`` on 2 nodes x 2 workers with no barrier: the counter is exact, every delta a node
sent was applied by the global server once, and the center (the rules' product) is accurate.

A center rule added later is covered by one entry in ``EXTRA`` (its knobs; ``{}`` for the
defaults): the test fails for an asynchronous built-in that has none, so it cannot be forgotten.
Gossip rules have no center; ``test_gosgd.py`` runs GoSGD end to end.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import assert_clean_exit, global_summary
from lsgd.rules import RULES

ASYNC_RULES = sorted(n for n, r in RULES.items() if not r.synchronous and not r.gossip)

EXTRA = {  # per rule: its knobs on top of the job's
    "easgd-async": dict(ALPHA=0.25),
    "downpour": {},
}


def test_every_asynchronous_built_in_has_an_end_to_end_case():
    assert ASYNC_RULES, "no asynchronous built-in rule"
    assert set(ASYNC_RULES) <= set(EXTRA), f"add an EXTRA entry for {set(ASYNC_RULES) - set(EXTRA)}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rule", ASYNC_RULES)
def test_an_asynchronous_rule_trains_digits_on_two_nodes_with_every_delta_applied(cluster, rule):
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ITERATIONS=6000, ALGORITHM=rule) | EXTRA.get(rule, {})
    t0 = time.monotonic()
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n1.wait(150) == 0, n1.output
    assert n0.wait(30) == 0, n0.output
    g = global_summary(cluster.run_dir)
    summaries = [n.summary() for n in (n0, n1)]
    done = sum(sum(s["workers"].values()) for s in summaries)
    sent = sum(s["async"]["deltas_sent"] for s in summaries)
    ev = summaries[0]["evaluation"]
    print(f"{rule}: {time.monotonic() - t0:.1f} s, counter {g['counter']}, workers' iterations "
          f"{done}, deltas sent {sent}, center deltas {g['center_deltas']}, "
          f"async {[s['async'] for s in summaries]}, accuracy {json.dumps(ev)}")
    assert g["counter"] == done == knobs["ITERATIONS"]
    assert g["center_deltas"]["applied"] == sent > 0  # each delta once, none left on a node
    for s in summaries:
        assert not s.get("deltas_lost"), s
        assert s["async"]["exchanges"] > 0 and s["async"]["syncs"] > 0, s["async"]
        assert set(s["worker_exit_codes"].values()) == {0}
    assert g["rounds"] == 1  # the final round only: no barrier
    assert ev["center"]["accuracy"] >= 0.95, ev  # the rule's product
    assert "Traceback" not in n0.output + n1.output
    assert_clean_exit(cluster.run_dir, [n0, n1])
