"""Pull math: the closed forms of LSGD and EASGD on float32, with hand-computed values."""

import math

import numpy as np
import pytest

from lsgd.rules import ops


def test_pull_toward_matches_closed_form_by_hand():
    x = np.array([1.0, 2.0, -3.0], dtype=np.float32)
    leader = np.array([0.0, 4.0, -1.0], dtype=np.float32)
    dist = ops.pull_toward_(x, leader, 0.25)
    # x - 0.25 (x - l): 1 - .25*1 = .75; 2 - .25*(-2) = 2.5; -3 - .25*(-2) = -2.5
    np.testing.assert_array_equal(x, np.array([0.75, 2.5, -2.5], dtype=np.float32))
    assert dist == pytest.approx(math.sqrt(1 + 4 + 4))
    assert x.dtype == np.float32


def test_pull_is_chunked_in_place_and_equals_whole_vector_formula():
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000).astype(np.float32)
    t = rng.normal(size=1000).astype(np.float32)
    expected = x - np.float32(0.1) * (x - t)
    before = x.__array_interface__["data"][0]
    ops.pull_toward_(x, t, 0.1, chunk=64)
    assert x.__array_interface__["data"][0] == before
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)


def test_zero_strength_leaves_x_and_reports_distance():
    x = np.array([3.0, 4.0], dtype=np.float32)
    d = ops.pull_toward_(x, np.zeros(2, np.float32), 0.0)
    assert d == 5.0
    np.testing.assert_array_equal(x, [3.0, 4.0])


@pytest.mark.parametrize("strength", [-0.1, 1.5])
def test_strength_outside_unit_interval_is_rejected(strength):
    with pytest.raises(ValueError, match="pulling strength"):
        ops.pull_toward_(np.zeros(2, np.float32), np.zeros(2, np.float32), strength)


def test_elastic_center_by_hand():
    center = np.array([0.0, 10.0], dtype=np.float32)
    # two participants (before their pull): [2, 10] and [4, 6] -> sum [6, 16], mean [3, 8]
    total = np.array([6.0, 16.0], dtype=np.float32)
    ops.elastic_center_(center, total, count=2, beta=0.5)
    # center + 0.5 (mean - center) = [1.5, 9.0]
    np.testing.assert_array_equal(center, np.array([1.5, 9.0], dtype=np.float32))


def test_easgd_round_closed_form():
    from lsgd.rules import EASGD

    rule = EASGD(alpha=0.25)
    workers = [np.array([2.0, 10.0], np.float32), np.array([4.0, 6.0], np.float32)]
    center = np.array([0.0, 10.0], np.float32)
    total = np.zeros(2, np.float32)
    ops.sum_into_(total, workers)
    for w in workers:
        ops.pull_toward_(w, center, rule.alpha)  # toward the center from before the update
    rule.update_(center, total, 2.0, 2, {})  # beta = alpha * 2 = 0.5
    np.testing.assert_array_equal(workers[0], [1.5, 10.0])
    np.testing.assert_array_equal(workers[1], [3.0, 7.0])
    np.testing.assert_array_equal(center, [1.5, 9.0])


def test_sum_scale_copy_and_finite_check():
    a, b = np.array([1, 2], np.float32), np.array([3, 5], np.float32)
    out = np.empty(2, np.float32)
    ops.sum_into_(out, [a, b], chunk=1)
    np.testing.assert_array_equal(out, [4, 7])
    ops.scale_(out, 0.5)
    np.testing.assert_array_equal(out, [2, 3.5])
    ops.copy_(a, out)
    np.testing.assert_array_equal(a, [2, 3.5])
    assert ops.all_finite(a)
    a[1] = np.inf
    assert not ops.all_finite(a)
