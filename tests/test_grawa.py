"""GRAWA (MGRAWA): the rule's math on hand-computed float32 values (rule test kit), how per-step
scalars reach a rule (smoothing, the missing-scalar fallback, the PyTorch ``.grad`` hook), and
one job through train.sh on 2 nodes x 2 workers."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import assert_clean_exit, global_summary
from lsgd.config import ConfigError, JobConfig
from lsgd.local_server import messages as m
from lsgd.local_server.round_runner import RoundMixin
from lsgd.rules import CENTER, GRAWA, RULES, Contribution, RoundKind, RoundRoles
from lsgd.rules.base import MAX_WEIGHT, MIN_WEIGHT
from lsgd.rules.testkit import RoundDriver
from lsgd.worker.client import SoloWorker, Worker, WorkerContext
from lsgd.worker.scalars_window import MOMENTUM, NO_GRAD, ScalarsWindow, grad_norm_source

f32 = np.float32


def vecs(*rows):
    return [np.array(r, dtype=np.float32) for r in rows]


def norms(*gs):
    return [{"grad_norm": g} for g in gs]


# ------------------------------------------------------------------ the rule


def test_center_is_the_inverse_gradient_norm_weighted_mean_and_workers_pull_toward_it():
    w = vecs([1, 2], [3, 6], [5, 10], [7, 2])
    d = RoundDriver(GRAWA(c2=0.5), [w[:2], w[2:]])
    d.global_round([0.4, 0.3, 0.2, 0.1], norms(0.25, 0.5, 1.0, 1.0))
    assert d.rounds[-1]["weights"] == [4.0, 2.0, 1.0, 1.0]  # 1 / g
    # (4*[1,2] + 2*[3,6] + [5,10] + [7,2]) / 8 = [22, 32] / 8
    np.testing.assert_array_equal(d.center, f32([2.75, 4.0]))
    # x <- x - 0.5 (x - center), toward this round's new center
    expected = vecs([1.875, 3.0], [2.875, 5.0], [3.875, 7.0], [4.875, 3.0])
    for x, e in zip(w, expected):
        np.testing.assert_array_equal(x, e)


def test_flat_workers_weigh_more_than_plain_averaging_gives_them():
    w = vecs([0.0], [8.0])
    d = RoundDriver(GRAWA(c2=1.0), [w])
    d.global_round([0.0, 0.0], norms(3.0, 1.0))  # weights 1/3 and 1: (0/3 + 8) / (4/3) = 6
    np.testing.assert_allclose(d.center, [6.0], rtol=1e-6)
    np.testing.assert_allclose(w[0], [6.0], rtol=1e-6)  # c2 = 1: every worker takes the center
    d.global_round([0.0, 0.0])  # no norms at all: plain averaging
    np.testing.assert_allclose(d.center, [6.0], rtol=1e-6)
    assert d.rounds[-1]["weights"] == [1.0, 1.0]


@pytest.mark.parametrize("g, weight", [
    (0.5, 2.0), (4.0, 0.25),
    (None, 1.0), (math.nan, 1.0), (math.inf, 1.0), (-1.0, 1.0),  # unusable: plain averaging
    (0.0, MAX_WEIGHT), (1e-9, MAX_WEIGHT), (1e9, MIN_WEIGHT),  # clipped into [1e-6, 1e6]
])
def test_weight_is_the_inverse_norm_clipped_and_one_without_a_usable_norm(g, weight):
    scalars = {} if g is None else {"grad_norm": g}
    assert GRAWA().weight(Contribution(0, 0.1, scalars)) == weight


def test_pulls_c2_toward_the_center_in_global_rounds_only_and_c2_comes_from_the_job():
    rule = GRAWA(c2=0.3)
    roles = RoundRoles(0, None, None, True)
    assert rule.pulls(RoundKind.GLOBAL, roles) == [(CENTER, 0.3)]
    assert rule.pulls(RoundKind.FINAL, roles) == [] and rule.pulls(RoundKind.LOCAL, roles) == []
    assert rule.pull_after_exchange and rule.scalars == ("grad_norm",)
    assert RULES["grawa"] is GRAWA
    assert JobConfig(algorithm="grawa", c2=0.2).make_rule().c2 == 0.2
    assert JobConfig(algorithm="grawa", c2=0.2, rule_args="c2=0.5").make_rule().c2 == 0.5
    with pytest.raises(ConfigError, match=r"c2 .* must be in \[0, 1\], got 1.5"):
        JobConfig(algorithm="grawa", rule_args="c2=1.5").validate()


# ------------------------------------------------------------------ scalars: smoothing


def test_scalars_are_an_exponential_moving_average_with_bias_correction():
    assert MOMENTUM == GRAWA.scalar_momentum == 0.9 ** 8
    win = ScalarsWindow(("grad_norm",), momentum=0.5)
    assert win.read() == {}  # nothing given yet: absent
    win.latest.update(grad_norm=2.0, other=7.0)
    assert win.read() == {"grad_norm": 2.0}  # m = 1, corrected by 1 - 0.5
    assert win.latest == {}  # each round folds in the values given since the last one
    assert win.read() == {"grad_norm": 2.0}  # none given: the estimate stays
    win.latest["grad_norm"] = np.float32(4.0)
    assert win.read() == {"grad_norm": pytest.approx(2.5 / 0.75)}  # m = 0.5 + 2, / (1 - 0.25)
    win.latest["grad_norm"] = 1.0
    win.latest["grad_norm"] = np.array([4.0])  # the latest value of the round counts
    assert win.read() == {"grad_norm": pytest.approx((0.5 * 2.5 + 2) / 0.875)}
    latest = ScalarsWindow(("g",), momentum=0.0)
    for v in (3.0, 5.0):
        latest.latest["g"] = v
        assert latest.read() == {"g": v}


def test_non_finite_scalars_are_left_out_and_a_non_number_is_an_error(caplog):
    win = ScalarsWindow(("grad_norm",), momentum=0.5)
    with caplog.at_level(logging.WARNING, "lsgd.worker.scalars_window"):
        for bad in (math.nan, math.inf, np.float32("nan")):
            win.latest["grad_norm"] = bad
            assert win.read() == {}
    assert len(caplog.records) == 1 and "non-finite grad_norm" in caplog.text  # once
    win.latest["grad_norm"] = 3.0
    assert win.read() == {"grad_norm": 3.0}
    win.latest["grad_norm"] = None  # no value this time
    assert win.read() == {"grad_norm": 3.0}
    for bad, kind in (("1", "str"), (np.ones(2), "ndarray of 2 elements"), ([1.0], "list")):
        win.latest["grad_norm"] = bad
        with pytest.raises(TypeError, match=f"scalar 'grad_norm' must be .*{kind}"):
            win.read()
    win.reset()
    assert win.read() == {}


def test_step_keeps_the_latest_scalars_and_the_stand_in_checks_them():
    class Inbox:
        def put(self, msg: object) -> None:
            pass

    worker = Worker(WorkerContext(JobConfig(), 0, Inbox(), None, 0, None))
    worker._params, worker._credits = object(), 10  # registered, holding credits
    assert worker.step(0.5, grad_norm=np.float32(2.0)) and worker.step(0.4)
    assert worker._given.latest == {"grad_norm": 2.0}
    assert not worker.wants("grad_norm") and worker.rule_scalars == ()  # LSGD uses none
    grawa = Worker(WorkerContext(JobConfig(algorithm="grawa"), 0, Inbox(), None, 0, None))
    assert grawa.wants("grad_norm")
    solo = SoloWorker()
    solo.register([np.zeros(3, np.float32)])
    assert solo.step(0.5, grad_norm=np.float32(1.5)) and not solo.wants("grad_norm")
    with pytest.raises(TypeError, match="scalar 'other' must be one number"):
        solo.step(0.5, other=[1.0, 2.0])


def test_a_missing_scalar_is_told_once_per_node_and_the_rule_falls_back(caplog):
    class Node(RoundMixin):
        rule = GRAWA()
        workers = [SimpleNamespace(worker_id=5, set_up_at=0), SimpleNamespace(worker_id=6, set_up_at=40)]
        repeats = None  # not used: the weights are in range

    node = Node()
    with caplog.at_level(logging.WARNING, "lsgd.local_server.server"):
        # worker 6 (resumed at 40 steps) is called into a round before its first step: it has
        # no value to give yet, which says nothing of its loop (CI: a node joining a job whose
        # round was due at once warned about a job that gives every norm)
        assert node._weights({1: m.Join(1, 1, 0.1, 0, 40)}) == [1.0]
        assert not caplog.records
        assert node._weights({0: m.Join(0, 1, 0.1, 0, 3), 1: m.Join(1, 1, 0.1, 0, 41)}) == [1.0, 1.0]
        assert node._weights({1: m.Join(1, 1, 0.1, 0, 42)}) == [1.0]
        assert node._weights({1: m.Join(1, 1, 0.1, 0, 43, scalars={"grad_norm": 0.5})}) == [2.0]
    assert len(caplog.records) == 1, caplog.text
    assert ("rule grawa uses the per-step scalar 'grad_norm', which worker 5 does not give"
            in caplog.text and "worker.step(loss, grad_norm=...)" in caplog.text)


# ------------------------------------------------------------------ PyTorch: .grad


def test_the_torch_hook_reads_the_gradient_norm_at_rounds():
    torch = pytest.importorskip("torch")
    from lsgd.worker.adapters import as_params

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    params = as_params(model)
    assert params.grad_norm() is None  # no backward yet
    model(torch.randn(8, 4)).pow(2).mean().backward()
    expected = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert float(params.grad_norm()) == pytest.approx(expected, rel=1e-6)
    double = torch.nn.Linear(3, 2).double()  # any float dtype
    double(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    assert float(as_params(double).grad_norm()) == pytest.approx(math.sqrt(8))  # 2x3 ones, 2 ones

    assert grad_norm_source(params, None, wanted=True) == params.grad_norm  # default: when used
    assert grad_norm_source(params, True, wanted=False) is None  # no rule reads it: not computed
    assert grad_norm_source(params, False, wanted=True) is None
    numpy_params = as_params([np.zeros(3, np.float32)])
    assert grad_norm_source(numpy_params, None, wanted=True) is None
    with pytest.raises(TypeError, match=r"grad_norm=True\) reads the gradients \(.grad\) of PyTorch"):
        grad_norm_source(numpy_params, True, wanted=True)
    with pytest.raises(TypeError, match=r"grad_norm=True\) reads"):
        SoloWorker().register([np.zeros(3, np.float32)], grad_norm=True)

    win = ScalarsWindow(("grad_norm",), momentum=0.0, sources={"grad_norm": params.grad_norm})
    assert win.read() == {"grad_norm": pytest.approx(expected, rel=1e-6)}
    win.latest["grad_norm"] = 9.0  # a value the loop gives wins over the hook
    assert win.read() == {"grad_norm": 9.0}


def test_no_gradient_at_a_round_is_told_once(caplog):
    win = ScalarsWindow(("grad_norm",), sources={"grad_norm": lambda: None})
    with caplog.at_level(logging.WARNING, "lsgd.worker.scalars_window"):
        assert win.read(stepped=False) == {}  # before any step: nothing to say
        assert not caplog.records
        assert win.read() == {} and win.read() == {}
    assert [r.getMessage() for r in caplog.records] == [NO_GRAD]


def test_the_default_job_computes_the_norm_only_when_asked_and_trains_the_same():
    from lsgd.jobs.digits_mlp import DigitsMLP, load_digits_split

    data = load_digits_split()
    xb, yb = data.x_train[:32], data.y_train[:32]
    plain, tracked = DigitsMLP(seed=3), DigitsMLP(seed=3, grad_norm=True)
    assert math.isnan(tracked.grad_norm)
    before = np.concatenate([p.get_value().ravel() for p in tracked.params])
    assert plain.train_step(xb, yb) == tracked.train_step(xb, yb)
    after = np.concatenate([p.get_value().ravel() for p in tracked.params])
    # First Nesterov step from v = 0: p' - p = -(1 + mu) lr g, so ||g|| = ||p' - p|| / ((1 + mu) lr)
    g = np.linalg.norm((after - before).astype(np.float64)) / ((1 + 0.9) * 0.05)
    assert tracked.grad_norm == pytest.approx(g, rel=1e-3)
    assert math.isnan(plain.grad_norm)
    for a, b in zip(plain.params, tracked.params):  # the same update either way
        np.testing.assert_array_equal(a.get_value(), b.get_value())


# ------------------------------------------------------------------ end to end


@pytest.mark.timeout(240)
def test_grawa_trains_the_default_job_on_two_nodes(cluster):
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ALGORITHM="grawa", ITERATIONS=8000)
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n1.wait(180) == 0, n1.output
    assert n0.wait(60) == 0, n0.output
    counter = global_summary(cluster.run_dir)["counter"]
    done = sum(sum(n.summary()["workers"].values()) for n in (n0, n1))
    assert counter == done == 8000
    ev = n0.summary()["evaluation"]
    print(f"grawa: {ev}")
    assert ev["center"]["accuracy"] >= 0.95
    output = n0.output + n1.output
    assert "per-step scalar" not in output, output  # the job gave every worker's norm
    assert "Traceback" not in output
    assert_clean_exit(cluster.run_dir, [n0, n1])
