"""The global server's brain, driven by hand with an injected clock."""

import pytest

from lsgd.global_server.coordinator import Coordinator, CoordinatorError, Schedule
from lsgd.leader import Candidate
from lsgd.rules.base import RoundKind


def make(num_groups=2, workers=2, l_comm=2, g_comm=4, local=True, iters=None, seconds=None,
         now=0.0, node_timeout=5.0, round_timeout=10.0, eval_every=0):
    sched = Schedule.for_job(num_groups=num_groups, workers=workers, l_comm=l_comm, g_comm=g_comm,
                             local_rounds=local, max_iterations=iters)
    return Coordinator(job_id="j", algorithm="lsgd", num_groups=num_groups, workers=workers,
                       schedule=sched, max_seconds=seconds, node_timeout=node_timeout,
                       round_timeout=round_timeout, join_timeout=30.0, now=now,
                       eval_every=eval_every)


def join_all(c, n, now=0.0):
    return {i: c.join(job_id="j", index=i, workers=c.workers, algorithm="lsgd",
                      num_groups=c.num_groups, now=now).session for i in range(n)}


def acq(c, s, i, now=0.0, consumed=0, want=100, seen=None, released=0, late=0):
    seen = c.nodes[i].last_round_seen if seen is None else seen
    return c.acquire(i, s[i], consumed=consumed, late=late, released=released, want=want,
                     last_round_seen=seen, now=now)


def test_schedule_boundaries_and_kinds():
    s = Schedule.for_job(num_groups=2, workers=2, l_comm=2, g_comm=4, local_rounds=True,
                         max_iterations=20)
    assert (s.local_period, s.global_period) == (8, 16)
    assert s.next_event(0) == (8, RoundKind.LOCAL)
    assert s.next_event(8) == (16, RoundKind.GLOBAL)
    assert s.next_event(9) == (16, RoundKind.GLOBAL)
    assert s.next_event(16) == (20, RoundKind.FINAL)
    assert Schedule(None, 16, None).next_event(0) == (16, RoundKind.GLOBAL)


def test_no_credits_until_every_node_joined():
    c = make()
    s = join_all(c, 1)
    assert acq(c, s, 0).wait
    s.update(join_all_rest(c))
    assert acq(c, s, 0).grant > 0


def join_all_rest(c):
    return {1: c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=0).session}


def drain(c, s, nodes, now=0.0):
    """Nodes take and use credits in turn until a round opens; returns (round, grants).

    Each node uses every credit it holds, those a previous round's answer carried included."""
    grants = []
    for _ in range(1000):
        for i in nodes:
            ans = acq(c, s, i, consumed=c.nodes[i].outstanding, now=now)
            grants.append(ans.grant)
            if ans.round is not None:
                return ans.round, grants
    raise AssertionError("no round opened")


def test_credits_never_cross_the_round_boundary_and_round_opens_exactly_there():
    c = make()  # local period 8, global 16
    s = join_all(c, 2)
    g0 = acq(c, s, 0, want=100).grant
    g1 = acq(c, s, 1, want=100).grant
    assert g0 == g1 == 2  # half a fair share of the 8-step period per request
    g0b = acq(c, s, 0, consumed=g0, want=100).grant
    g1b = acq(c, s, 1, want=100).grant  # node 1 is slow: still holds its first 2
    assert (g0b, g1b) == (2, 2) and c.done + c.outstanding == 8
    assert acq(c, s, 0, consumed=g0b, want=100).wait  # nothing left: node 1 holds the rest
    ans = acq(c, s, 1, consumed=g1 + g1b)
    assert ans.round is not None and ans.round.kind == RoundKind.LOCAL and ans.round.iteration == 8
    assert c.done == 8
    # node 0 learns of the round on its next request, whatever it asks
    assert acq(c, s, 0).round.id == ans.round.id
    # after seeing it, credits for the next period flow
    assert acq(c, s, 0, seen=1).grant > 0


def test_over_reporting_is_rejected_without_state_change():
    c = make()
    s = join_all(c, 2)
    g = acq(c, s, 0).grant
    with pytest.raises(CoordinatorError) as e:
        acq(c, s, 0, consumed=g + 1)
    assert e.value.code == "INVALID_ARGUMENT"
    assert c.done == 0 and c.nodes[0].outstanding == g


def test_wrong_session_or_job_is_refused():
    c = make()
    s = join_all(c, 2)
    with pytest.raises(CoordinatorError, match="not a member"):
        c.acquire(0, s[0] + 1, consumed=0, late=0, released=0, want=1, last_round_seen=0, now=0)
    with pytest.raises(CoordinatorError, match="job id"):
        c.join(job_id="other", index=0, workers=2, algorithm="lsgd", num_groups=2, now=0)
    with pytest.raises(CoordinatorError, match="same train.sh"):
        c.join(job_id="j", index=1, workers=3, algorithm="lsgd", num_groups=2, now=0)
    with pytest.raises(CoordinatorError, match="already in the job"):
        c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=0)


def test_global_round_barrier_elects_lowest_loss_and_closes_on_all_reports():
    c = make(l_comm=4, g_comm=4)  # every boundary global: 16
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    assert rnd.kind == RoundKind.GLOBAL and c.done == 16
    out = c.report(0, s[0], rnd.id, Candidate(1, 0.5), 2, now=1)
    assert not out.ready
    out = c.report(1, s[1], rnd.id, Candidate(2, 0.3), 2, now=1)
    assert out.ready and out.leader == Candidate(2, 0.3) and out.leader_node == 1
    assert out.participants == 4 and out.nodes == (0, 1)
    assert c.outcome(0, rnd.id).leader == Candidate(2, 0.3)


def test_a_rounds_outcome_stays_its_own_after_a_newer_round_opened():
    """A node that reported in time may hear the answer late (on the session port its answer
    waits for the leader's upload): meanwhile the time budget ran out and the final round
    opened. Its answer is still the round's, not "missed"; a report that came too late is."""
    c = make(l_comm=4, g_comm=4, seconds=100.0)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    c.report(0, s[0], rnd.id, Candidate(0, 0.5), 2, now=1)
    c.report(1, s[1], rnd.id, Candidate(2, 0.3), 2, now=1)
    c.tick(now=200.0)  # the budget is over: the final round opens
    assert c.round.id > rnd.id and c.round.kind == RoundKind.FINAL
    for i in (0, 1):
        out = c.outcome(i, rnd.id)
        assert out.ready and not out.missed and out.leader == Candidate(2, 0.3)
    assert c.outcome(0, c.round.id - 5).missed  # a round it never reported


def test_round_closes_at_deadline_without_a_stuck_node_and_late_report_is_missed():
    c = make(l_comm=4, g_comm=4, round_timeout=10)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1], now=1)
    c.report(0, s[0], rnd.id, Candidate(0, 1.0), 2, now=2)
    c.heartbeat(1, s[1], now=9)  # alive, but does not report
    c.tick(now=10.5)
    assert not c.round.closed  # opened at t=1, deadline t=11
    c.heartbeat(1, s[1], now=11)
    c.tick(now=11.5)
    out = c.outcome(0, rnd.id)
    assert out.ready and out.leader == Candidate(0, 1.0) and out.nodes == (0,)
    assert c.report(1, s[1], rnd.id, Candidate(2, 0.1), 2, now=12).missed


def test_silent_node_is_dropped_its_credits_freed_and_round_goes_on():
    c = make(l_comm=4, g_comm=4, node_timeout=5)
    s = join_all(c, 2)
    g1 = acq(c, s, 1, now=0).grant
    assert g1 > 0
    held = 0
    for _ in range(100):  # node 0 takes everything else, then waits on node 1
        ans = acq(c, s, 0, consumed=held, now=1)
        held = ans.grant
        if ans.wait:
            break
    assert c.done == 16 - g1
    assert c.tick(now=6) == [1]  # node 1 silent since t=0
    ans = acq(c, s, 0, now=6)
    assert ans.grant == g1  # node 1's forfeited credits are free again
    rnd = acq(c, s, 0, consumed=ans.grant, now=7).round
    assert rnd is not None and rnd.expected == {0}
    with pytest.raises(CoordinatorError, match="dropped"):
        c.heartbeat(1, s[1], now=7)
    # and it may rejoin with a new session
    node = c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=8)
    assert node.session != s[1] and node.alive


def test_iteration_budget_ends_with_a_final_round_at_exactly_the_budget():
    c = make(num_groups=1, workers=2, l_comm=2, g_comm=4, local=False, iters=10)
    s = join_all(c, 1)
    total, rounds = 0, []
    for _ in range(100):
        ans = acq(c, s, 0, consumed=0)
        if ans.round is not None:
            rounds.append((ans.round.kind, ans.round.iteration))
            if ans.round.kind == RoundKind.FINAL:
                break
            c.report(0, s[0], ans.round.id, None, 2, now=0)
            total += ans.grant  # the round's answer carries the first credits after it
            acq(c, s, 0, seen=ans.round.id, consumed=ans.grant, want=0)
            continue
        if ans.grant:
            total += ans.grant
            acq(c, s, 0, consumed=ans.grant, want=0)
    assert rounds == [(RoundKind.GLOBAL, 8), (RoundKind.FINAL, 10)]
    assert c.done == 10 == total
    assert c.stop_reason == "iteration budget reached"


def test_time_budget_stops_granting_and_final_round_waits_for_outstanding_credits():
    c = make(num_groups=1, workers=2, l_comm=100, g_comm=100, local=False, seconds=60)
    s = join_all(c, 1)
    g = acq(c, s, 0, want=50, now=1).grant
    assert g == 50
    c.heartbeat(0, s[0], now=60)
    c.tick(now=61)
    assert c.stop_reason == "time budget reached" and c.round is None
    assert acq(c, s, 0, consumed=20, want=50, now=62).wait  # no new credits, 30 outstanding
    ans = acq(c, s, 0, consumed=30, now=63)
    assert ans.round.kind == RoundKind.FINAL and ans.round.iteration == 50 and c.done == 50


def test_released_and_late_counts_keep_the_counter_exact():
    c = make(num_groups=1, workers=2, l_comm=5, g_comm=5, local=False)
    s = join_all(c, 1)
    assert acq(c, s, 0, want=10).grant == 5
    # a stuck worker's 4 credits are released; they are granted again
    assert acq(c, s, 0, consumed=1, released=4, want=10).grant == 5
    assert acq(c, s, 0, consumed=5, want=10).grant == 4
    ans = acq(c, s, 0, consumed=4)
    assert ans.round is not None and c.done == 10  # the period completes without the straggler
    # the straggler later reports 3 steps it did on released credits: counted, not lost
    acq(c, s, 0, late=3, seen=ans.round.id, want=0)
    assert c.done == 13 and c.nodes[0].consumed == 13


def test_leave_and_all_gone():
    c = make(num_groups=1, workers=1, local=False)
    s = join_all(c, 1)
    g = acq(c, s, 0).grant
    c.leave(0, s[0], consumed=g, late=0, now=1)
    assert c.done == g and c.all_gone


def test_no_join_while_the_final_round_is_open():
    c = make(num_groups=2, workers=1, l_comm=1, g_comm=1, iters=2)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    assert rnd.kind == RoundKind.FINAL
    c.tick(now=100)  # both nodes silent: dropped
    with pytest.raises(CoordinatorError, match="finishing"):
        c.join(job_id="j", index=1, workers=1, algorithm="lsgd", num_groups=2, now=100)


def test_evaluation_rounds_are_the_first_global_rounds_past_each_multiple():
    c = make(l_comm=2, g_comm=4, eval_every=40)  # local rounds every 8, global every 16
    s = join_all(c, 2)
    flagged = []
    for _ in range(12):  # rounds at 8, 16, ..., 96
        rnd, _ = drain(c, s, [0, 1])
        for i in (0, 1):
            out = c.report(i, s[i], rnd.id, Candidate(2 * i, 1.0), 2, now=0)
            c.nodes[i].last_round_seen = rnd.id
        assert out.ready
        if out.evaluate:
            assert rnd.kind == RoundKind.GLOBAL
            flagged.append(rnd.iteration)
    assert flagged == [48, 80]  # past 40 and past 80 (80 itself counts)


def test_a_retried_credit_request_counts_once_and_a_replayed_one_is_refused():
    c = make()
    s = join_all(c, 2)

    def ask(consumed, seq):
        return c.acquire(0, s[0], consumed=consumed, late=0, released=0, want=100,
                         last_round_seen=0, now=0, seq=seq)

    g = ask(0, 1).grant
    assert ask(0, 1).grant == g and c.nodes[0].outstanding == g  # retry: same answer, no new grant
    g2 = ask(g, 2).grant
    assert (c.done, c.nodes[0].outstanding) == (g, g2)
    assert ask(g, 2).grant == g2 and (c.done, c.nodes[0].outstanding) == (g, g2)  # not twice
    with pytest.raises(CoordinatorError, match="replayed") as e:
        ask(g2, 1)
    assert e.value.code == "FAILED_PRECONDITION" and c.done == g


def test_replayed_round_reports_change_nothing():
    c = make(l_comm=4, g_comm=4)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])
    c.report(0, s[0], rnd.id, Candidate(1, 0.5), 2, now=1)
    with pytest.raises(CoordinatorError, match="already reported") as e:
        c.report(0, s[0], rnd.id, Candidate(0, 0.1), 2, now=1)  # a better claim, replayed
    assert e.value.code == "FAILED_PRECONDITION"
    out = c.report(1, s[1], rnd.id, Candidate(2, 0.3), 2, now=1)
    assert out.leader == Candidate(2, 0.3)
    for i in (0, 1):
        c.nodes[i].last_round_seen = rnd.id
    rnd2, _ = drain(c, s, [0, 1])
    assert rnd2.id > rnd.id
    late = c.report(0, s[0], rnd.id, Candidate(0, 0.0), 2, now=2)  # an old round's report
    assert late.missed and c.round.id == rnd2.id and not c.round.reports


def test_reattaching_counts_each_step_once():
    c = make()
    s = join_all(c, 2)

    def ask(consumed, seq):
        return c.acquire(0, s[0], consumed=consumed, late=0, released=0, want=100,
                         last_round_seen=0, now=0, seq=seq).grant

    g = ask(0, 1)
    ask(2, 2)  # arrived: counted; its answer is lost, so the node keeps the 2 steps "in doubt"
    assert c.done == 2

    def reattach(seq, unanswered_seq):
        return c.join(job_id="j", index=0, workers=2, algorithm="lsgd", num_groups=2, now=1,
                      resume_session=s[0], held=g - 2, unreported=1, seq=seq,
                      unanswered_seq=unanswered_seq, unanswered_steps=2)

    reattach(3, 2)
    assert c.done == 3  # the 1 unreported step; the 2 of request 2 were already counted
    reattach(3, 2)  # the same join again (its answer was lost): nothing twice
    assert c.done == 3 and c.nodes[0].outstanding == g - 2
    s2 = c.nodes[0].session
    g3 = c.acquire(0, s2, consumed=0, late=0, released=0, want=100, last_round_seen=0, now=1,
                   seq=4)
    assert g3.grant >= 0 and c.done == 3


def test_a_reattaching_node_takes_part_in_the_round_that_waits_for_it():
    c = make(l_comm=4, g_comm=4)
    s = join_all(c, 2)
    rnd, _ = drain(c, s, [0, 1])  # a global round, expecting both nodes
    node = c.join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2, now=0,
                  resume_session=s[1], seq=1)
    assert node.last_round_seen == rnd.id - 1  # it will be told of this round, not skip it
    assert c.acquire(1, s[1], consumed=0, late=0, released=0, want=1, last_round_seen=rnd.id - 1,
                     now=0, seq=2).round.id == rnd.id


def test_a_round_answer_carries_the_first_credits_after_the_round_but_the_final_one_none():
    c = make(num_groups=2, workers=2, l_comm=2, g_comm=4, iters=16)  # local 8, global 16: final
    s = join_all(c, 2)
    rnd, grants = drain(c, s, [0, 1])  # the call that opened the round learnt of it
    assert rnd.kind == RoundKind.LOCAL and rnd.iteration == 8
    first = next(i for i in (0, 1) if c.nodes[i].outstanding)
    other = 1 - first
    assert grants[-1] == 2 == c.outstanding  # half a fair share of the next 8-step period
    ans = acq(c, s, other, seen=0)  # the other node learns of the round: credits too
    assert ans.round is rnd and ans.grant == 2 and not ans.wait
    assert c.outstanding == 4 and c.done == 8
    for i in (0, 1):
        c.nodes[i].last_round_seen = rnd.id
    for _ in range(100):  # use every credit up to the final round
        for i in (0, 1):
            a = acq(c, s, i, consumed=c.nodes[i].outstanding)
            if a.round is not None and a.round.kind == RoundKind.FINAL:
                assert a.grant == 0 and c.outstanding == 0 and c.done == 16
                return
            assert c.done + c.outstanding <= c.target
    raise AssertionError("the final round never opened")
