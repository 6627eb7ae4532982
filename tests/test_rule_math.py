"""The rules' math on hand-computed float32 values, through the rule test kit
(lsgd/rules/testkit.py): no processes, milliseconds."""

from __future__ import annotations

import numpy as np
import pytest

from lsgd.rules import RULES, Average, DiLoCo, EASGD, LSGD
from lsgd.rules.testkit import RoundDriver

f32 = np.float32


def vecs(*rows):
    return [np.array(r, dtype=np.float32) for r in rows]


def test_average_replaces_every_worker_by_the_mean():
    w = vecs([1, 2], [3, 6], [5, 10], [7, 2])
    d = RoundDriver(Average(), [w[:2], w[2:]])
    d.global_round([0.1, 0.2, 0.3, 0.4])
    expected = np.array([4, 5], np.float32)  # (1+3+5+7)/4, (2+6+10+2)/4
    for x in w:
        np.testing.assert_array_equal(x, expected)
    np.testing.assert_array_equal(d.center, expected)


def test_diloco_takes_a_nesterov_outer_step_on_the_pseudo_gradient():
    w = vecs([1.0, 0.0], [3.0, 2.0])  # theta starts as worker 0's: [1, 0]
    d = RoundDriver(DiLoCo(outer_lr=0.5, outer_momentum=0.9), [w])
    # the workers trained: mean [2, 1]; delta = theta - mean = [-1, -1]
    w[0][:] = [1.0, 1.0]
    w[1][:] = [3.0, 1.0]
    d.global_round([0.0, 0.0])
    # m = 0.9*0 + delta = [-1, -1]; step = delta + 0.9*m = [-1.9, -1.9]; theta -= 0.5*step
    np.testing.assert_allclose(d.center, [1.95, 0.95], rtol=0, atol=1e-6)
    np.testing.assert_allclose(d.state["momentum"], [-1, -1])
    for x in w:  # every worker restarts from theta
        np.testing.assert_array_equal(x, d.center)
    # second round, no training in between: mean = theta, delta = 0, m = 0.9*[-1,-1]
    d.global_round([0.0, 0.0])
    m = f32(0.9) * f32(-1)
    step = f32(0) + f32(0.9) * m
    np.testing.assert_allclose(d.center, [f32(1.95) - f32(0.5) * step, f32(0.95) - f32(0.5) * step],
                               atol=1e-6)


def test_diloco_without_nesterov_steps_along_the_momentum():
    w = vecs([0.0], [4.0])
    d = RoundDriver(DiLoCo(outer_lr=1.0, outer_momentum=0.5, nesterov=False), [w])
    d.global_round([0.0, 0.0])  # mean 2, delta -2, m -2, theta = 0 + 2
    np.testing.assert_allclose(d.center, [2.0])


def test_easgd_pulls_toward_the_old_center_and_moves_it_toward_the_old_mean():
    w = vecs([2.0], [6.0])
    d = RoundDriver(EASGD(alpha=0.25), [w])
    d.center[:] = [0.0]
    d.global_round([0.0, 0.0])
    np.testing.assert_allclose([w[0][0], w[1][0]], [1.5, 4.5])  # x - 0.25 (x - 0)
    np.testing.assert_allclose(d.center, [2.0])  # 0 + 0.5 * (4 - 0), beta = alpha * 2


def test_lsgd_pulls_toward_the_local_then_the_global_leader():
    w = vecs([0.0], [10.0], [20.0], [40.0])
    d = RoundDriver(LSGD(c1=0.5, c2=0.25), [w[:2], w[2:]])
    d.global_round([0.9, 0.1, 0.2, 0.8])  # local leaders 1 and 2; global leader 1
    # worker 0: toward 10 by 0.5 -> 5, then toward 10 by 0.25 -> 6.25
    # worker 3: toward 20 by 0.5 -> 30, then toward 10 by 0.25 -> 25
    # worker 2 (local leader, not global): toward 10 by 0.25 -> 17.5; worker 1 stays
    np.testing.assert_allclose([x[0] for x in w], [6.25, 10.0, 17.5, 25.0])


@pytest.mark.parametrize("workers", [2, 4])
def test_average_every_step_is_large_batch_sgd(workers):
    """BSP: with G_COMM=1 and plain SGD on a linear least-squares model, model averaging gives
    the same iterates as one SGD run on the union of the workers' minibatches."""
    rng = np.random.default_rng(0)
    dim, batch, lr, steps = 5, 8, 0.05, 30
    true = rng.normal(size=dim).astype(np.float32)
    data = [[(rng.normal(size=(batch, dim)).astype(np.float32),) for _ in range(steps)]
            for _ in range(workers)]
    data = [[(x, x @ true + rng.normal(scale=0.1, size=batch).astype(np.float32)) for (x,) in ws]
            for ws in data]

    def grad(w, x, y):
        return (2.0 / len(y)) * x.T @ (x @ w - y)

    start = rng.normal(size=dim).astype(np.float32)
    nodes = [[start.copy() for _ in range(workers // 2)] for _ in range(2)]
    d = RoundDriver(Average(), nodes)
    t = {"k": 0}

    def step(i, w):
        x, y = data[i][t["k"]]
        w -= (lr * grad(w, x, y)).astype(np.float32)
        return float(np.mean((x @ w - y) ** 2))

    for k in range(steps):
        t["k"] = k
        d.run(1, 1, step)
    big = start.copy()
    for k in range(steps):
        x = np.concatenate([data[i][k][0] for i in range(workers)])
        y = np.concatenate([data[i][k][1] for i in range(workers)])
        big -= (lr * grad(big, x, y)).astype(np.float32)
    for w in d.workers:
        np.testing.assert_allclose(w, big, rtol=1e-4, atol=1e-5)


def test_the_built_ins_are_registered_under_their_names():
    assert {"lsgd", "easgd", "average", "diloco"} <= set(RULES)
    for name, cls in RULES.items():
        assert cls.name == name
