"""Shares of a period (issue 15): once every node's speed is known, the answer that names a
round gives each node a share in proportion to its speed, so a node makes one credit call per
period and nodes of different speeds still finish a period together."""

import pytest

from lsgd.global_server import shares
from lsgd.global_server.coordinator import Coordinator, Schedule


def test_speed_is_a_ratio_of_decaying_sums_and_ignores_what_is_not_a_sample():
    s = shares.sampled(0.0, 0.0, 100, 1000)
    assert shares.rate(*s) == pytest.approx(100.0)
    # the workers that came back first, then the rest a moment later: the ratio of sums stays
    # near the true 100 steps/s where an average of the two ratios would say 525
    s = shares.sampled(*s, 10, 1000)
    s = shares.sampled(*s, 90, 100)
    assert 80 < shares.rate(*s) < 125
    assert shares.sampled(*s, 0, 500) == s and shares.sampled(*s, 5, 0) == s
    assert shares.sampled(*s, 5, shares.MAX_USED_MS + 1) == s
    assert shares.rate(0.0, 0.0) == 0.0
    assert shares.proportional(64, 1.0, 0.0) == 0 and shares.proportional(64, 0.0, 3.0) == 0
    assert shares.proportional(64, 1.0, 4.0) == 16 and shares.half_fair(64, 4) == 8


def simulate(speeds, periods=12, local=True, measured=True):
    """Nodes stepping at ``speeds`` (steps per second each) on a coordinator, in virtual time,
    as the local server does: use the credits held, report them with the time they took, take
    the answer's credits after its round; a node with nothing to do long-polls (one call,
    answered when a round opens or credits are freed). Returns (credit calls per node and period after the
    first two periods, seconds per period after the first two, the coordinator)."""
    n = len(speeds)
    sched = Schedule.for_job(num_groups=n, workers=4, l_comm=4, g_comm=16, local_rounds=local,
                             max_iterations=None)
    c = Coordinator(job_id="j", algorithm="lsgd", num_groups=n, workers=4, schedule=sched,
                    max_seconds=None, node_timeout=1e9, round_timeout=1e9, join_timeout=1e9,
                    now=0.0)
    s = {i: c.join(job_id="j", index=i, workers=4, algorithm="lsgd", num_groups=n,
                   now=0.0).session for i in range(n)}
    held = {i: 0 for i in range(n)}
    busy_until = {i: 0.0 for i in range(n)}  # when the node has used what it holds
    since = {i: 0.0 for i in range(n)}
    seen = {i: 0 for i in range(n)}
    waiting: set[int] = set()
    calls, opened_at = [], []

    def ask(i, t, resumed=False):  # resumed: a long-poll's next pass, the same call
        g = c.acquire(i, s[i], consumed=held[i], late=0, released=0, want=1 << 30,
                      last_round_seen=seen[i], now=t,
                      used_ms=int((t - since[i]) * 1000) if measured else 0)
        if not resumed:
            calls.append((t, i))
        held[i] = g.grant
        if g.round is not None:
            seen[i] = g.round.id
            if g.round.kind != g.round.kind.LOCAL:
                c.report(i, s[i], g.round.id, None, 4, t)
        if g.wait:
            waiting.add(i)
        else:
            waiting.discard(i)
            since[i] = t
            busy_until[i] = t + g.grant / speeds[i]
        if len(opened_at) < c.rounds_opened:
            opened_at.append(t)

    t = 0.0
    while len(opened_at) < periods:
        ready = [i for i in range(n) if i not in waiting]
        if not ready or len(calls) > 100_000:
            raise AssertionError("every node waits: a hang")
        i = min(ready, key=lambda j: busy_until[j])
        t = max(t, busy_until[i])
        ask(i, t)
        for j in sorted(waiting):  # a round or freed credits wake the polls
            if j != i and (c.round is not None and seen[j] < c.round.id
                           or c.target - c.done - c.outstanding > 0):
                ask(j, t, resumed=True)
    start, end = opened_at[1], opened_at[-1]
    steady = [i for (when, i) in calls if start <= when < end]
    rounds = len(opened_at) - 2
    return len(steady) / (n * rounds), (end - start) / rounds, c


def test_equal_nodes_make_one_credit_call_per_period_once_their_speed_is_known():
    per_call, per_round, c = simulate([100.0] * 4)
    half, half_round, _ = simulate([100.0] * 4, measured=False)
    # one call per local period instead of two; a global period takes two (below): 1.25
    assert per_call <= 1.3 < 1.8 <= half
    ideal = c.schedule.local_period / 400.0
    assert per_round == pytest.approx(ideal, rel=0.02)
    assert half_round == pytest.approx(ideal, rel=0.02)
    assert c.done == sum(n.consumed for n in c.nodes.values())


@pytest.mark.parametrize("speeds", [[300.0, 100.0], [100.0, 100.0, 400.0, 50.0]])
def test_nodes_of_different_speeds_get_shares_in_proportion_and_lose_no_time(speeds):
    per_call, per_round, c = simulate(speeds)
    ideal = c.schedule.local_period / sum(speeds)  # every node busy all period long
    assert per_round == pytest.approx(ideal, rel=0.05)
    assert per_call <= 1.3
    _, half_round, _ = simulate(speeds, measured=False)
    assert per_round <= half_round * 1.01  # never slower than half shares


def test_without_local_rounds_the_global_rounds_share_by_speed_too():
    # a global round's answer carries no credits (held through its exchange, they would stall
    # the others): the node asks after the round, then reports and waits for the next one
    per_call, per_round, c = simulate([200.0, 100.0], local=False)
    assert per_round == pytest.approx(c.schedule.global_period / 300.0, rel=0.05)
    assert 1.9 <= per_call <= 2.1
    assert c.done == sum(n.consumed for n in c.nodes.values())


def run_async(speeds, measured=True, budget=20_000):
    """An asynchronous rule (no rounds before the final one) stepping nodes of ``speeds`` in
    virtual time up to an iteration budget: how long the fastest node waits for the final
    round after its last step, and the credit calls per node."""
    n = len(speeds)
    sched = Schedule.for_job(num_groups=n, workers=1, l_comm=64, g_comm=64, local_rounds=False,
                             max_iterations=budget, rounds=False)
    c = Coordinator(job_id="j", algorithm="easgd-async", num_groups=n, workers=1,
                    schedule=sched, max_seconds=None, node_timeout=1e9, round_timeout=1e9,
                    join_timeout=1e9, now=0.0)
    s = {i: c.join(job_id="j", index=i, workers=1, algorithm="easgd-async", num_groups=n,
                   now=0.0).session for i in range(n)}
    held, since, busy = [0] * n, [0.0] * n, [0.0] * n
    waiting, calls, t = set(), 0, 0.0
    while c.round is None:
        ready = [i for i in range(n) if i not in waiting]
        assert ready and calls < 100_000, "every node waits: a hang"
        i = min(ready, key=lambda j: busy[j])
        t = max(t, busy[i])
        for j in [i] + sorted(waiting - {i}):
            g = c.acquire(j, s[j], consumed=held[j], late=0, released=0, want=1 << 30,
                          last_round_seen=0, now=t,
                          used_ms=int((t - since[j]) * 1000) if measured and held[j] else 0)
            calls += j == i
            held[j] = g.grant
            if g.grant:
                waiting.discard(j)
                since[j], busy[j] = t, t + g.grant / speeds[j]
            elif c.round is None:
                waiting.add(j)
            if c.round is not None:
                break
    fastest = max(range(n), key=lambda j: speeds[j])
    assert c.done == budget
    return t - busy[fastest], calls / n


def test_an_asynchronous_rule_sizes_every_grant_by_speed_so_the_end_waits_little():
    idle, per_node = run_async([200.0, 20.0])
    idle_half, per_node_half = run_async([200.0, 20.0], measured=False)
    # half shares: near the end the slow node still holds a grant of several of its 50 ms
    # steps when the fast one has used all of its own (0.32 s here); by speed, every grant is
    # worth the same time for both, so they run out together
    assert idle < 0.1 < 0.25 < idle_half
    assert per_node < 0.6 * per_node_half  # and the fast node asks far less often


def async_coordinator(n, workers=4):
    sched = Schedule.for_job(num_groups=n, workers=workers, l_comm=16, g_comm=16,
                             local_rounds=False, max_iterations=None, rounds=False)
    c = Coordinator(job_id="j", algorithm="easgd-async", num_groups=n, workers=workers,
                    schedule=sched, max_seconds=600, node_timeout=1e9, round_timeout=1e9,
                    join_timeout=1e9, now=0.0)
    s = {i: c.join(job_id="j", index=i, workers=workers, algorithm="easgd-async",
                   num_groups=n, now=0.0).session for i in range(n)}
    return c, s


def test_a_node_never_holds_more_than_a_period_so_it_can_always_reattach():
    # without rounds free credits are unbounded; a node asks again while its workers still
    # hold their shares: what it holds must stay within what a reattach may claim
    c, s = async_coordinator(1)
    t = 0.0
    for k in range(50):
        t += 0.1
        c.acquire(0, s[0], consumed=8 if k else 0, late=0, released=0, want=1 << 30,
                  last_round_seen=0, now=t, used_ms=10 if k else 0)
        assert c.nodes[0].outstanding <= c.schedule.period
    held = c.nodes[0].outstanding
    assert held > 0
    c.nodes[0].alive = False  # dropped (a partition), then back with what it holds
    node = c.join(job_id="j", index=0, workers=4, algorithm="easgd-async", num_groups=1,
                  now=t + 1, resume_session=s[0], held=held, unreported=0, seq=0)
    assert node.alive and node.outstanding == held


def test_a_node_claiming_a_huge_speed_cannot_starve_the_others():
    c, s = async_coordinator(2)
    period = c.schedule.period
    t = 0.0
    for k in range(20):  # both measured; node 1 says it took 1 ms for its steps
        t += 0.2
        for i in (0, 1):
            held = c.nodes[i].outstanding
            c.acquire(i, s[i], consumed=held, late=0, released=0, want=1 << 30,
                      last_round_seen=0, now=t, used_ms=(200 if i == 0 else 1) if held else 0)
        c.tick(t)
    honest = c.nodes[0]
    t += 0.2
    g = c.acquire(0, s[0], consumed=honest.outstanding, late=0, released=0, want=1 << 30,
                  last_round_seen=0, now=t, used_ms=200)
    assert g.grant >= shares.half_fair(period, 2) // 4 > 1


def three_measured_nodes():
    """Three asynchronous nodes of one speed, stepped until their speeds size the shares:
    (coordinator, sessions, now)."""
    c, s = async_coordinator(3)
    t = 0.0
    for _ in range(10):
        t += 0.2
        for i in range(3):
            held = c.nodes[i].outstanding
            c.acquire(i, s[i], consumed=held, late=0, released=0, want=1 << 30,
                      last_round_seen=0, now=t, used_ms=200 if held else 0)
        c.tick(t)
    assert c.rate_sum > 0
    return c, s, t


def test_speeds_taken_before_a_node_left_no_longer_size_the_shares():
    # 3 nodes of one speed, measured; node 2 leaves between two scans: its speed is still in
    # the sum, which would make node 0's share a third of a period (and, had a node joined
    # instead, leave the newcomer nothing). Until the next scan takes the speeds of the nodes
    # that are there, shares are half a fair share.
    c, s, t = three_measured_nodes()
    period = c.schedule.period
    c.leave(2, s[2], consumed=c.nodes[2].outstanding, late=0, now=t)
    g = c.acquire(0, s[0], consumed=c.nodes[0].outstanding, late=0, released=0, want=1 << 30,
                  last_round_seen=0, now=t, used_ms=200)
    assert g.grant == shares.half_fair(period, 2) != shares.proportional(period, 1.0, 3.0)
    t += 0.1  # the next scan: shares by speed again, now over two nodes
    c.tick(t)
    g = c.acquire(1, s[1], consumed=c.nodes[1].outstanding, late=0, released=0, want=1 << 30,
                  last_round_seen=0, now=t, used_ms=200)
    assert g.grant == shares.proportional(period, 1.0, 2.0)


def test_a_drop_and_a_return_between_two_scans_also_stop_the_old_speeds_sizing_shares():
    # the same live count and sessions as when the speeds were taken, but a node went away and
    # came back (it may hold credits the shares did not count): half shares until the next scan
    c, s, t = three_measured_nodes()
    period = c.schedule.period
    held = c.nodes[2].outstanding
    c.nodes[2].alive = False  # dropped (a partition), then back with what it holds
    c.join(job_id="j", index=2, workers=4, algorithm="easgd-async", num_groups=3, now=t,
           resume_session=s[2], held=held, unreported=0, seq=0)
    assert c.live_count == 3 and c.nodes[2].session == s[2]
    g = c.acquire(0, s[0], consumed=c.nodes[0].outstanding, late=0, released=0, want=1 << 30,
                  last_round_seen=0, now=t, used_ms=200)
    assert g.grant == shares.half_fair(period, 3)
