"""Leader election, loss windows and the rules' pull plans."""

import math

import pytest

from lsgd.leader import Candidate, LossWindow, elect
from lsgd.rules import EASGD, LSGD, RoundKind, RoundRoles
from lsgd.rules.base import CENTER, GLOBAL_LEADER, LOCAL_LEADER


def test_empty_window_is_not_eligible_and_a_partial_one_is_never_zero_filled():
    w = LossWindow(3)
    assert not w.eligible and math.isnan(w.estimate)  # a fresh worker never looks best
    w.add(5.0)
    w.add(1.0)
    # fewer losses than avg_size (a round came first): eligible, the mean of the losses held
    # (3.0), not a window padded with zeros (2.0)
    assert w.eligible and w.estimate == pytest.approx(3.0)
    w.add(3.0)
    assert w.eligible and w.estimate == pytest.approx(3.0)
    w.add(2.0)  # window slides: [1, 3, 2]
    assert w.estimate == pytest.approx(2.0)


def test_window_larger_than_a_round_lets_every_worker_lead():
    # AVG_SIZE=32, 8 steps between rounds: every worker's window restarts at each round, and
    # the lowest mean of the round's losses leads; with full windows required nobody but the
    # first leader ever qualified again (issue 9)
    windows = [LossWindow(32), LossWindow(32)]
    leaders = []
    for rnd in range(6):
        for wid, w in enumerate(windows):
            for step in range(8):  # worker (rnd % 2) has the lower losses this round
                w.add(1.0 if wid == rnd % 2 else 2.0)
        best = elect(Candidate(wid, w.estimate) for wid, w in enumerate(windows))
        leaders.append(best.worker_id if best else None)
        for w in windows:
            w.reset()  # every participant's window starts again at a round
    assert leaders == [0, 1, 0, 1, 0, 1]


def test_window_with_nan_or_inf_is_not_eligible_until_it_slides_out():
    w = LossWindow(2)
    w.add(float("nan"))
    w.add(1.0)
    assert not w.eligible
    w.add(float("inf"))
    assert not w.eligible
    w.add(1.0)
    w.add(3.0)
    assert w.eligible and w.estimate == 2.0


def test_window_reset_forgets_losses():
    w = LossWindow(1)
    w.add(1.0)
    w.reset()
    assert not w.eligible


def test_elect_lowest_finite_loss_ties_to_lowest_id():
    cands = [Candidate(3, 0.5), Candidate(1, float("nan")), Candidate(2, 0.5), Candidate(0, float("inf"))]
    assert elect(cands) == Candidate(2, 0.5)
    assert elect([Candidate(0, float("nan"))]) is None
    assert elect([]) is None


def test_lsgd_multi_node_pulls_local_then_global_and_never_the_leader():
    rule = LSGD(c1=0.2, c2=0.3)
    roles = lambda wid: RoundRoles(wid, local_leader=1, global_leader=5, multi_node=True)
    assert rule.pulls(RoundKind.LOCAL, roles(0)) == [(LOCAL_LEADER, 0.2)]
    assert rule.pulls(RoundKind.LOCAL, roles(1)) == []
    assert rule.pulls(RoundKind.GLOBAL, roles(0)) == [(LOCAL_LEADER, 0.2), (GLOBAL_LEADER, 0.3)]
    assert rule.pulls(RoundKind.GLOBAL, roles(1)) == [(GLOBAL_LEADER, 0.3)]
    assert rule.pulls(RoundKind.GLOBAL, roles(5)) == [(LOCAL_LEADER, 0.2)]
    assert rule.pulls(RoundKind.FINAL, roles(0)) == []


def test_lsgd_single_node_uses_only_the_global_leader():
    rule = LSGD(c1=0.2, c2=0.3)
    assert not rule.has_local_rounds(1) and rule.has_local_rounds(2)
    roles = RoundRoles(0, local_leader=1, global_leader=1, multi_node=False)
    assert rule.pulls(RoundKind.GLOBAL, roles) == [(GLOBAL_LEADER, 0.3)]


def test_lsgd_without_a_leader_pulls_nothing():
    roles = RoundRoles(0, local_leader=None, global_leader=None, multi_node=True)
    assert LSGD().pulls(RoundKind.GLOBAL, roles) == []


def test_lsgd_proximal_pulls_off_by_default_and_scaled_when_on():
    assert LSGD().per_step_pulls(True) == []
    rule = LSGD(p1=0.1, p2=0.2, l_comm=4, g_comm=16)
    assert rule.per_step_pulls(True) == [(GLOBAL_LEADER, 0.2 / 16), (LOCAL_LEADER, 0.1 / 4)]
    assert rule.per_step_pulls(False) == [(GLOBAL_LEADER, 0.2 / 16)]


def test_easgd_pulls_everyone_toward_the_center_and_beta_defaults_to_alpha_times_p():
    rule = EASGD(alpha=0.1)
    roles = RoundRoles(0, local_leader=0, global_leader=0, multi_node=True)
    assert rule.pulls(RoundKind.GLOBAL, roles) == [(CENTER, 0.1)]
    assert rule.beta_for(4) == pytest.approx(0.4)
    assert EASGD(alpha=0.1, beta=0.43).beta_for(4) == 0.43
