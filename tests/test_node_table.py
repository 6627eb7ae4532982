"""The coordinator's running totals (credits held, live nodes) stay equal to a full count through
every kind of change, and silent nodes are still dropped on time (issue 15: no call is O(N))."""

import random

import pytest

from lsgd.global_server.coordinator import DROP_SCAN, CoordinatorError
from lsgd.global_server.records import NodeState, NodeTable
from lsgd.rules.base import RoundKind

from test_coordinator import acq, drain, join_all, make


def counted(c):
    return (sum(n.outstanding for n in c.nodes.values() if n.alive),
            sum(1 for n in c.nodes.values() if n.alive and not n.left))


@pytest.mark.parametrize("seed", range(5))
def test_totals_match_a_full_count_through_random_joins_steps_drops_leaves_and_rejoins(seed):
    rng = random.Random(seed)
    c = make(num_groups=6, workers=2, l_comm=3, g_comm=6, node_timeout=5.0, round_timeout=2.0)
    now = 0.0
    sessions = join_all(c, 6)
    held = {i: 0 for i in sessions}
    checked = 0
    for _ in range(600):
        now += rng.choice((0.0, 0.01, 0.3, 2.0))
        i = rng.randrange(6)
        op = rng.random()
        try:
            if op < 0.6:
                used = rng.randint(0, held[i])
                freed = rng.randint(0, held[i] - used) if rng.random() < 0.2 else 0
                g = acq(c, sessions, i, now=now, consumed=used, released=freed,
                        want=rng.randint(0, 20))
                held[i] += g.grant - used - freed
                if g.round is not None:
                    c.nodes[i].last_round_seen = g.round.id
                    if g.round.kind != g.round.kind.LOCAL:
                        c.report(i, sessions[i], g.round.id, None, 0, now)
            elif op < 0.7:
                c.leave(i, sessions[i], consumed=held[i], late=0, now=now)
                held[i] = 0
            elif op < 0.85:  # a new process of the node (after a leave, a drop, or at once)
                sessions[i] = c.join(job_id="j", index=i, workers=2, algorithm="lsgd",
                                     num_groups=6, now=now,
                                     replaces_session=sessions[i]).session
                held[i] = 0
            else:
                c.tick(now)
        except CoordinatorError:
            pass  # refused (e.g. dropped, already left): the state must still add up
        for j, node in c.nodes.items():  # a drop forfeits what the node held
            if not node.alive or node.left:
                held[j] = 0
        assert (c.outstanding, c.live_count) == counted(c)
        checked += 1
    assert checked == 600
    assert any(not n.alive or n.left for n in c.nodes.values())  # the walk did drop or leave


def test_a_silent_node_is_dropped_within_one_scan_of_its_timeout():
    c = make(num_groups=2, node_timeout=5.0)
    s = join_all(c, 2)
    for t in (1.0, 2.0, 3.0, 4.0, 4.99):
        c.heartbeat(0, s[0], t)
        assert c.tick(t) == []
    dropped = []
    t = 5.0
    while not dropped and t < 5.0 + 1.0:
        t += 0.001
        c.heartbeat(0, s[0], t)
        dropped = c.tick(t)
    assert dropped == [1]
    assert t <= 5.0 + DROP_SCAN + 0.002
    assert c.live_count == 1 and c.missing_nodes() == [1]


def test_the_table_refuses_removals_and_keeps_a_replaced_node_out_of_the_totals():
    table = NodeTable()
    a = NodeState(0, 1, 2, joined_at=0.0, last_seen=0.0, outstanding=3)
    table[0] = a
    assert (table.outstanding, table.live) == (3, 1)
    b = NodeState(0, 2, 2, joined_at=0.0, last_seen=0.0, outstanding=5)
    table[0] = b
    a.outstanding = 100  # the replaced record no longer counts
    assert (table.outstanding, table.live) == (5, 1)
    version = table.version
    b.alive = False
    b.session = 2  # the same session: no membership change
    assert (table.outstanding, table.live) == (0, 0) and table.version == version
    b.session = 3
    assert table.version == version + 1
    for remove in (lambda: table.pop(0), lambda: table.__delitem__(0), table.clear):
        with pytest.raises(TypeError):
            remove()
    assert len(table) == 1


def test_a_round_waits_again_for_an_expected_node_that_comes_back_before_it_closes():
    c = make(num_groups=4, workers=2, l_comm=2, g_comm=2, node_timeout=5.0, round_timeout=30.0)
    s = join_all(c, 4)
    rnd, _ = drain(c, s, [0, 1, 2, 3])
    assert rnd.kind == RoundKind.GLOBAL and rnd.expected == {0, 1, 2, 3}
    for i in (0, 1):
        c.report(i, s[i], rnd.id, None, 2, now=1.0)
    for i in (0, 1, 3):
        c.heartbeat(i, s[i], 6.5)
    assert c.tick(6.5) == [2]  # node 2, silent since 0, is dropped: the round forgets it
    assert rnd.pending == {3} and not rnd.closed
    c.join(job_id="j", index=2, workers=2, algorithm="lsgd", num_groups=4, now=7.0,
           resume_session=s[2], held=0, unreported=0)  # back in time for the round
    assert c.report(3, s[3], rnd.id, None, 2, now=7.5).ready is False  # it waits for node 2
    out = c.report(2, s[2], rnd.id, None, 2, now=8.0)
    assert out.ready and not out.missed and out.nodes == (0, 1, 2, 3)
