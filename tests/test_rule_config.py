"""A rule's configuration: RULE_ARGS over the job's knobs, what it pulls checked at start, and
the rule (with its arguments) the same on every node."""

from __future__ import annotations

import re

import pytest

from lsgd.config import ConfigError, JobConfig
from lsgd.global_server.coordinator import Coordinator, CoordinatorError, Schedule
from lsgd.rules import CENTER, GLOBAL_LEADER, RoundKind, Rule
from lsgd.rules.loader import check_rule


def test_rule_args_override_the_built_ins_job_knobs():
    rule = JobConfig(c1=0.1, rule_args="c1=0.3,c2=0.2").make_rule()
    assert (rule.c1, rule.c2) == (0.3, 0.2)
    easgd = JobConfig(algorithm="easgd", alpha=0.1, rule_args="alpha=0.2").make_rule()
    assert easgd.alpha == 0.2
    diloco = JobConfig(algorithm="diloco", outer_lr=0.7, rule_args="outer_lr=0.5").make_rule()
    assert (diloco.outer_lr, diloco.outer_momentum) == (0.5, 0.9)


class _Pulls(Rule):
    name = "pulls"

    def __init__(self, target: str = GLOBAL_LEADER, strength: float = 0.5) -> None:
        self.target, self.strength = target, strength

    def pulls(self, kind, roles):
        return [(self.target, self.strength)] if kind == RoundKind.GLOBAL else []


@pytest.mark.parametrize("rule, says", [
    (_Pulls(strength=1.5), "pull strength 1.5 toward global_leader is not in [0, 1]"),
    (_Pulls(target=CENTER), "names 'center', which this rule's node does not have"),
    (_Pulls(target="moon"), "names 'moon'"),
])
def test_what_a_rule_pulls_is_checked_before_the_job_starts(rule, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        check_rule(rule, num_groups=2)
    check_rule(_Pulls(), num_groups=2)  # a good one passes


@pytest.mark.parametrize("knobs, says", [
    (dict(num_groups=2, rule_args="c1=1.5"), "c1 (pulling strength) must be in [0, 1], got 1.5"),
    (dict(algorithm="easgd", rule_args="beta=2"), "beta must be in [0, 1], got 2.0"),
    (dict(algorithm="easgd", num_groups=2, rule_args="alpha=0.5"),
     "alpha * workers in the job = 2 > 1 makes the EASGD center diverge"),
    (dict(algorithm="grawa", rule_args="c2=-1"), "c2 (pulling strength toward the center)"),
])
def test_rule_args_meet_the_same_checks_as_the_knobs(knobs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        JobConfig(**knobs)


class _LastWorker(Rule):
    name = "last"

    def pulls(self, kind, roles):  # a bad strength only for the job's last worker
        return [(GLOBAL_LEADER, 2.0 if roles.worker_id == 3 else 0.5)]


def test_every_worker_of_the_job_is_asked_what_it_pulls():
    check_rule(_LastWorker(), num_groups=1, workers=2)  # no worker 3 in this job
    with pytest.raises(ValueError, match="pull strength 2.0"):
        check_rule(_LastWorker(), num_groups=2, workers=2)


def test_a_node_with_other_rule_args_is_refused_at_join():
    spec = JobConfig(rule_args="c1=0.3").rule_spec
    assert spec == "lsgd (c1=0.3)" and JobConfig().rule_spec == "lsgd"
    assert JobConfig(rule_args=" c2=0.2, c1=0.3").rule_spec == JobConfig(
        rule_args="c1=0.3,c2=0.2").rule_spec  # the order of RULE_ARGS does not matter
    coord = Coordinator(job_id="j", algorithm=spec, num_groups=2, workers=2,
                        schedule=Schedule(64, 256, 1000), max_seconds=None, node_timeout=5,
                        round_timeout=5, join_timeout=5, now=0.0)
    with pytest.raises(CoordinatorError, match=r"runs algorithm=lsgd num_groups=2 .* the job runs "
                                               r"algorithm=lsgd \(c1=0\.3\)"):
        coord.check_join(job_id="j", index=1, workers=2, algorithm="lsgd", num_groups=2)
