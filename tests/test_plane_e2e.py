"""PLANE=chain end to end: real nodes started with train.sh on loopback pass each global round's
leader node to node, or add their sums up node to node (docs/design-scale.md), and a node lost
mid-job leaves the chain without stopping it. Mid-transfer kills and hangs are in
test_plane_node.py."""

from __future__ import annotations

import time

import pytest

from conftest import assert_clean_exit, global_summary, metric_rows, wait_for_rows

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO", ALGORITHM="lsgd", PLANE="chain",
           TOYJOB_SIZE=300000)  # 1.2 MB: five chunks


def leaders_by_round(run_dir, nodes) -> dict[int, set]:
    """Round -> the global leaders the nodes' workers were told to pull toward."""
    out: dict[int, set] = {}
    for i in nodes:
        for row in metric_rows(run_dir / f"node{i}" / "metrics.csv"):
            if row["kind"] == "global" and row["global_leader"] not in ("", None):
                out.setdefault(int(row["round"]), set()).add(int(float(row["global_leader"])))
    return out


def run_three_nodes(cluster, knobs) -> list:
    """Nodes 0, 1 and 2 of one job with ``knobs``: each exits 0, and the counter is exact."""
    n0 = cluster(0, PORT=0, **knobs)
    port = cluster.port_of_node0()
    nodes = [n0] + [cluster(i, PORT=port, **knobs) for i in (1, 2)]
    for node in nodes:
        assert node.wait(120) == 0, node.output
    assert global_summary(cluster.run_dir)["counter"] == knobs["ITERATIONS"]
    return nodes


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fanout", [1, 2])  # 2: the source feeds both other nodes at once
def test_a_chain_job_passes_every_leader_node_to_node(cluster, fanout):
    knobs = dict(NUM_GROUPS=3, WORKERS=2, ITERATIONS=3000, PLANE_FANOUT=fanout, **TOY)
    n0, *rest = run_three_nodes(cluster, knobs)
    stats = {n.index: n.summary()["plane"] for n in [n0, *rest]}
    assert all(s["failed"] == 0 and s["bypasses"] == 0 for s in stats.values()), stats
    # each global round: the source sends once per child, every other member receives once
    assert sum(s["sent"] for s in stats.values()) == sum(s["received"] for s in stats.values())
    # Every node that did not lead every round received: at least two. (Leadership follows the
    # losses; one node leading all of a short job's rounds happens, 1 run in 3 to 7 here.)
    assert sum(1 for s in stats.values() if s["received"] > 0) >= 2, stats
    if fanout == 2:  # a tree: each round's source sends to both others, nobody forwards
        rounds = sum(s["sent"] for s in stats.values()) // 2
        assert all(s["sent"] == 2 * (rounds - s["received"]) for s in stats.values()), stats
    rounds = leaders_by_round(cluster.run_dir, range(3))
    assert rounds and all(len(ids) == 1 for ids in rounds.values()), rounds  # one leader each
    for node in [n0, *rest]:
        assert "data listener at 127.0.0.1:" in node.output
        assert "came down the route is refused" not in node.output  # the digests matched
    assert_clean_exit(cluster.run_dir, [n0, *rest])


@pytest.mark.timeout(150)
def test_a_chain_job_adds_the_easgd_sums_up_and_sends_the_center_down(cluster):
    """Three nodes, so that node 1 both adds and forwards; with evaluation rounds, whose leader
    goes through the server, never down the reduce route (whose staging buffer holds the
    partial sums)."""
    knobs = dict(NUM_GROUPS=3, WORKERS=2, ITERATIONS=4000, EVAL_EVERY=1200,
                 **(TOY | dict(ALGORITHM="easgd")))
    n0, *rest = run_three_nodes(cluster, knobs)
    stats = {n.index: n.summary()["plane"] for n in [n0, *rest]}
    # Every global round, the sums go 2 -> 1 -> 0 (node 0 uploads the total), then the new
    # center 0 -> 1 -> 2 (node 0 downloads it from the server beside it).
    rounds = stats[2]["sent"]
    assert rounds > 3 and all(s["failed"] == 0 for s in stats.values()), stats
    assert (stats[0]["received"], stats[0]["sent"]) == (rounds, rounds), stats
    assert (stats[1]["received"], stats[1]["sent"]) == (2 * rounds, 2 * rounds), stats
    assert stats[2]["received"] == rounds, stats
    # Every periodic evaluation: the center the reduces built, the leader and the average, all
    # trained. (A leader sent down the reduce route was, before a fix, a partial sum: 0.43.)
    rows = [r for r in metric_rows(cluster.run_dir / "node0" / "metrics.csv") if r["kind"] == "eval"]
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["target"], []).append(float(r["value"]))
    evaluations = len(by.get("center", []))
    assert evaluations >= 2 and len(by.get("leader", [])) >= 2, by
    assert all(v > 0.9 for vs in by.values() for v in vs), by
    assert n0.summary()["evaluation"]["center"]["accuracy"] > 0.9
    # The server's link carried one vector each way per round, node 0's, over loopback (on the
    # star: 3 downloads and 3 uploads a round). Beside them: every node's download of the
    # initial center, node 0's evaluation downloads (leader, average) and final ones (leader,
    # center, average), and the evaluation rounds' leader and sum uploads.
    g = global_summary(cluster.run_dir)
    calls, bulk = g["calls"], g["bulk_transfers"]  # (1.2 MB vectors: on the bulk port)
    pulls = calls.get("PullParams", 0) + bulk["download"]
    pushes = calls.get("PushParams", 0) + bulk["upload"]
    assert pulls <= rounds + 3 + 2 * evaluations + 3, (calls, bulk)
    assert pushes <= rounds + 1 + 4 * evaluations + 4, (calls, bulk)
    assert bulk["download"] >= rounds and bulk["upload"] >= rounds, bulk
    assert calls["Digest"] == 2 * rounds, calls  # nodes 1 and 2 check each new center
    for node in [n0, *rest]:
        assert "came down the route is refused" not in node.output  # the digests matched
    assert_clean_exit(cluster.run_dir, [n0, *rest])


@pytest.mark.slow  # the plane's own fault tests (test_plane_node.py) cover mid-transfer deaths
@pytest.mark.timeout(180)
def test_a_node_lost_from_a_chain_job_leaves_the_route_and_rejoins_it(cluster):
    knobs = dict(NUM_GROUPS=4, WORKERS=1, NODE_TIMEOUT=2, ROUND_TIMEOUT=5, ITERATIONS=12000,
                 TOYJOB_STEP_SECONDS="0.0005", **TOY)
    n0 = cluster(0, PORT=0, **knobs)
    port = cluster.port_of_node0()
    rest = [cluster(i, PORT=port, **knobs) for i in (1, 2, 3)]
    wait_for_rows(cluster.run_dir / "node2" / "metrics.csv", rows=10)
    rest[1].kill_group()  # node 2: its local server, data listener and worker die at once
    killed = time.monotonic()
    while "node 2 dropped" not in n0.output and time.monotonic() < killed + 15:
        time.sleep(0.05)
    assert "node 2 dropped" in n0.output
    again = cluster(2, PORT=port, **knobs)  # a supervisor starts it again
    for node in (n0, rest[0], rest[2], again):
        assert node.wait(150) == 0, node.output
    assert "node 2 joins a running job" in again.output
    assert global_summary(cluster.run_dir)["counter"] == 12000
    # the rounds went on, the leader still node to node, with node 2 left out while it was away
    assert rest[2].summary()["plane"]["received"] > 0
    rounds = leaders_by_round(cluster.run_dir, (0, 1, 3))
    assert rounds and all(len(ids) == 1 for ids in rounds.values()), rounds
