"""Tests for the default training job ``lsgd.jobs.digits_mlp``."""

from __future__ import annotations

import numpy as np
import pytest
from pytensor.compile.builders import OpFromGraph
from pytensor.link.basic import PerformLinker
from sklearn.datasets import load_digits

from lsgd.jobs.digits_mlp import DigitsData, DigitsMLP, load_digits_split, minibatches

N_SAMPLES = 1797


@pytest.fixture(scope="module")
def data() -> DigitsData:
    """The default split, shared by the tests of this module."""
    return load_digits_split()


def test_split_is_deterministic(data: DigitsData) -> None:
    again = load_digits_split()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(data, name), getattr(again, name))
    other = load_digits_split(split_seed=1)
    assert not np.array_equal(data.y_test, other.y_test) or not np.array_equal(
        data.x_test, other.x_test
    )


def test_split_sizes_dtypes_and_disjointness(data: DigitsData) -> None:
    n_train, n_test = len(data.x_train), len(data.x_test)
    assert n_train + n_test == N_SAMPLES
    counts = np.bincount(np.concatenate([data.y_train, data.y_test]))
    assert n_test == sum(round(0.2 * c) for c in counts)  # a fifth of every class
    np.testing.assert_array_equal(np.bincount(data.y_test), np.round(0.2 * counts))
    assert data.x_train.shape == (n_train, 64) and data.x_test.shape == (n_test, 64)
    assert data.y_train.shape == (n_train,) and data.y_test.shape == (n_test,)
    assert data.x_train.dtype == np.float32 and data.x_test.dtype == np.float32
    assert data.y_train.dtype == np.int32 and data.y_test.dtype == np.int32

    # Standardised with the training statistics.
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-4)
    assert np.all(np.isfinite(data.x_train)) and np.all(np.isfinite(data.x_test))

    # Stratified: every class in both parts, label counts add up to the full set.
    full = load_digits()
    counts = np.bincount(data.y_train, minlength=10) + np.bincount(data.y_test, minlength=10)
    np.testing.assert_array_equal(counts, np.bincount(full.target, minlength=10))
    assert set(np.unique(data.y_test)) == set(range(10))

    # Disjoint: the same per-feature increasing affine map is applied to both
    # parts, so train + test hold as many distinct images as the full dataset.
    both = np.concatenate([data.x_train, data.x_test]).round(4)
    assert len(np.unique(both, axis=0)) == len(np.unique(full.data, axis=0))


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(ValueError):
        load_digits_split(test_fraction=0.0)
    with pytest.raises(ValueError):
        load_digits_split(test_fraction=1.0)


def test_minibatches(data: DigitsData) -> None:
    x, y = data.x_train[:100], data.y_train[:100]
    batches = minibatches(x, y, 32, np.random.default_rng(3))
    epoch = [next(batches) for _ in range(3)]  # 100 // 32 = 3 batches per epoch
    for xb, yb in epoch:
        assert xb.shape == (32, 64) and yb.shape == (32,)
    rows = np.concatenate([xb for xb, _ in epoch])
    assert len(np.unique(rows, axis=0)) == 96  # no sample repeated within an epoch

    same = minibatches(x, y, 32, np.random.default_rng(3))
    for xb, yb in epoch:
        xb2, yb2 = next(same)
        np.testing.assert_array_equal(xb, xb2)
        np.testing.assert_array_equal(yb, yb2)

    with pytest.raises(ValueError):
        next(minibatches(x, y, 101, np.random.default_rng(0)))
    with pytest.raises(ValueError):
        next(minibatches(x, y[:-1], 10, np.random.default_rng(0)))


def test_params_float32_and_seeded() -> None:
    a, b, c = DigitsMLP(seed=7), DigitsMLP(seed=7), DigitsMLP(seed=8)
    assert [p.name for p in a.params] == ["W1", "b1", "W2", "b2"]
    shapes = [(64, 64), (64,), (64, 10), (10,)]
    for pa, pb, shape in zip(a.params, b.params, shapes, strict=True):
        value = pa.get_value()
        assert value.dtype == np.float32 and pa.dtype == "float32"
        assert value.shape == shape
        np.testing.assert_array_equal(value, pb.get_value())
    assert not np.array_equal(a.params[0].get_value(), c.params[0].get_value())
    assert DigitsMLP(hidden=16).params[0].get_value().shape == (64, 16)


def test_compiled_without_jit_or_inner_graphs() -> None:
    # Guards the cold-start time: the functions must run on the Python linker
    # and contain no OpFromGraph, whose perform() would JIT-compile an inner
    # function with the global (numba) default mode on the first call.
    model = DigitsMLP()
    for fn in (model._train_fn, model._predict_fn, model._loss_fn):
        assert isinstance(fn.maker.linker, PerformLinker)
        assert not any(isinstance(node.op, OpFromGraph) for node in fn.maker.fgraph.apply_nodes)


def test_training_reduces_loss_and_is_accurate(data: DigitsData) -> None:
    model = DigitsMLP(seed=0)
    initial_loss = model.loss(data.x_train, data.y_train)
    initial_acc = model.accuracy(data.x_test, data.y_test)
    batches = minibatches(data.x_train, data.y_train, 32, np.random.default_rng(0))
    losses = [model.train_step(*next(batches)) for _ in range(300)]
    assert all(isinstance(loss, float) and np.isfinite(loss) for loss in losses)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])
    assert model.loss(data.x_train, data.y_train) < 0.25 * initial_loss
    acc = model.accuracy(data.x_test, data.y_test)
    assert acc >= 0.9 > initial_acc
    for p in model.params:
        assert p.get_value().dtype == np.float32


def test_same_seed_same_batches_same_trajectory(data: DigitsData) -> None:
    a, b = DigitsMLP(seed=1), DigitsMLP(seed=1)
    batches = minibatches(data.x_train, data.y_train, 32, np.random.default_rng(5))
    for _ in range(20):
        xb, yb = next(batches)
        assert a.train_step(xb, yb) == b.train_step(xb, yb)
    for pa, pb in zip(a.params, b.params, strict=True):
        np.testing.assert_array_equal(pa.get_value(), pb.get_value())


def test_set_lr_zero_freezes_params(data: DigitsData) -> None:
    model = DigitsMLP(seed=2)
    before = model.get_param_values()
    model.set_lr(0.0)
    assert model.lr == 0.0
    model.train_step(data.x_train[:32], data.y_train[:32])
    for old, p in zip(before, model.params, strict=True):
        np.testing.assert_array_equal(old, p.get_value())
    model.set_lr(0.05)
    model.train_step(data.x_train[:32], data.y_train[:32])
    assert not np.array_equal(before[0], model.params[0].get_value())
    with pytest.raises(ValueError):
        model.set_lr(-1.0)


def test_set_param_values_roundtrip() -> None:
    a, b = DigitsMLP(seed=3), DigitsMLP(seed=4)
    b.set_param_values(a.get_param_values())
    for pa, pb in zip(a.params, b.params, strict=True):
        np.testing.assert_array_equal(pa.get_value(), pb.get_value())
        assert pb.get_value().dtype == np.float32
    with pytest.raises(ValueError):
        b.set_param_values(a.get_param_values()[:2])
    with pytest.raises(ValueError):
        b.set_param_values([np.zeros((2, 2))] * 4)


def test_momentum_zero_is_plain_sgd(data: DigitsData) -> None:
    """MOMENTUM=0 is plain SGD (its own update graph: the ``0 * v`` one ran ~45x slower): from
    zero velocity, one Nesterov step moves the parameters (1 + momentum) times as far."""
    xb, yb = data.x_train[:32], data.y_train[:32]
    moves = {}
    for mu in (0.0, 0.5):
        model = DigitsMLP(seed=3, lr=0.05, momentum=mu)
        before = [p.copy() for p in model.get_param_values()]
        model.train_step(xb, yb)
        moves[mu] = [a - b for a, b in zip(model.get_param_values(), before)]
        if mu == 0.0:
            assert all(not v.get_value().any() for v in model.velocities)
    for plain, nesterov in zip(moves[0.0], moves[0.5]):
        np.testing.assert_allclose(nesterov, 1.5 * plain, rtol=1e-4, atol=1e-7)
